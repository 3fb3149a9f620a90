//! Hot functions of kvroute-shared: block-key hashing and prompt tokenization.
//! Run: `cargo bench -p kvroute-shared` (figures in BENCHMARKS.md).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::testdata::tokenizer_dir;
use kvroute_shared::tokenize::PromptTokenizer;
use kvroute_shared::{BlockSize, KeyRoot, block_keys};
use serde_json::json;

fn keys(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..16 * 1024).map(|i| (i * 7919) % 151_000).collect();
    let root = KeyRoot::new("qwen3-8b", None);
    let mut g = c.benchmark_group("block_keys");
    g.throughput(Throughput::Elements(1024));
    g.bench_function("1024 blocks of 16 tokens", |b| {
        b.iter(|| block_keys(root, black_box(&tokens), BlockSize::DEFAULT))
    });
    g.finish();
}

/// English-ish text of about `words` words.
fn text(words: usize) -> String {
    let vocab = [
        "the",
        "router",
        "sends",
        "each",
        "request",
        "to",
        "a",
        "worker",
        "that",
        "holds",
        "its",
        "prefix,",
        "caching",
        "attention",
        "keys",
        "and",
        "values",
        "for",
        "later",
        "turns.",
    ];
    (0..words).map(|i| vocab[(i * 7 + i / 3) % vocab.len()]).collect::<Vec<_>>().join(" ")
}

fn tokenize(c: &mut Criterion) {
    let mut g = c.benchmark_group("tokenize");
    for name in ["gpt2", "qwen3"] {
        let tok = match tokenizer_dir(name) {
            Ok(dir) => PromptTokenizer::load(&dir).expect("tokenizer loads"),
            Err(why) => {
                eprintln!("tokenize/{name} not measured: {why}");
                continue;
            }
        };
        for target in [1_000usize, 8_000] {
            // Find the word count that gives about `target` tokens.
            let words = target * 9 / 10;
            let t = text(words);
            let n = tok.encode(&t, true).expect("encodes").len();
            let req =
                PromptRequest::parse(Endpoint::Completions, json!({"model": "m", "prompt": t}).to_string().as_bytes())
                    .expect("parses");
            g.throughput(Throughput::Elements(n as u64));
            // Cold: encoded whole, nothing cached.
            g.bench_function(format!("{name} completion cold {n} tokens"), |b| {
                b.iter(|| tok.encode_uncached(black_box(&t), true))
            });
            // Warm: the same text again (every chunk cached).
            g.bench_function(format!("{name} completion {n} tokens"), |b| {
                b.iter(|| tok.prompt_tokens(black_box(&req)))
            });
            // A cached document with a new question after it: only the
            // question's chunk is encoded.
            let mut k = 0u64;
            g.bench_function(format!("{name} completion new question after a cached {n}-token document"), |b| {
                b.iter_batched(
                    || {
                        k += 1;
                        let prompt = format!("{t}\nQuestion {k}: {}", text(40));
                        let body = json!({"model": "m", "prompt": prompt}).to_string();
                        PromptRequest::parse(Endpoint::Completions, body.as_bytes()).expect("parses")
                    },
                    |r| tok.prompt_tokens(&r),
                    criterion::BatchSize::SmallInput,
                )
            });
        }
        // Words no cache has seen (random letters): every piece is a word
        // cache miss, BPE-merged on the fast path.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        g.bench_function(format!("{name} completion of 1,000 new words"), |b| {
            b.iter_batched(
                || {
                    (0..1_000)
                        .map(|_| {
                            seed ^= seed << 13;
                            seed ^= seed >> 7;
                            seed ^= seed << 17;
                            let len = 4 + (seed % 6) as usize;
                            (0..len).map(|k| char::from(b'a' + ((seed >> (5 * k)) % 26) as u8)).collect::<String>()
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                },
                |t| tok.encode(&t, false),
                criterion::BatchSize::SmallInput,
            )
        });
        if name == "qwen3" {
            // An 8k-token conversation: system prompt, 20 turns.
            let mut messages = vec![json!({"role": "system", "content": text(600)})];
            for i in 0..20 {
                messages.push(json!({"role": "user", "content": text(150 + i)}));
                messages.push(json!({"role": "assistant", "content": text(200 + i)}));
            }
            messages.push(json!({"role": "user", "content": "And finally?"}));
            let body = json!({"model": "qwen3", "messages": messages}).to_string();
            let req = PromptRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).expect("parses");
            let n = tok.prompt_tokens(&req).expect("renders").len();
            let PromptRequest::Chat(chat) = &req else { unreachable!() };
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(format!("qwen3 chat render only {n} tokens"), |b| {
                b.iter(|| tok.render_chat(black_box(chat)))
            });
            // Cold: the whole rendered text encoded at once, nothing cached.
            g.bench_function(format!("qwen3 chat render+tokenize cold {n} tokens"), |b| {
                b.iter(|| tok.encode_uncached(&tok.render_chat(black_box(chat)).expect("renders"), false))
            });
            // Warm: the same conversation again (every segment cached).
            g.bench_function(format!("qwen3 chat render+tokenize warm {n} tokens"), |b| {
                b.iter(|| tok.prompt_tokens(black_box(&req)))
            });
            // The multi-turn case: a known conversation plus a new user turn.
            let mut turn = 0u64;
            g.bench_function(format!("qwen3 chat new turn on a cached {n}-token conversation"), |b| {
                b.iter_batched(
                    || {
                        turn += 1;
                        let mut c = chat.clone();
                        let msg = json!({"role": "user", "content": format!("New question {turn}: {}", text(40))});
                        c.messages.push(msg.as_object().cloned().expect("object"));
                        PromptRequest::Chat(c)
                    },
                    |r| tok.prompt_tokens(&r),
                    criterion::BatchSize::SmallInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = keys, tokenize
}
criterion_main!(benches);
