//! The router's per-request CPU cost, stage by stage (issue 16): body parse,
//! chat render, tokenize (cold, with a cached shared half, warm), block-key
//! hashing, index match, policy decision, and the hand-off to the tokenize
//! pool, for 1k, 8k and 32k-token completions (GPT-2, Qwen3) and chats
//! (Qwen3). Forwarding and streaming are what `kvroute-bench overhead`
//! measures beyond these (its added latency minus this table's sum).
//!
//! Run: `cargo bench -p kvroute-router --bench request_path` (prints a
//! Markdown table; `-- 8192` for one length). Each figure is the median of
//! repeated single runs; a cold tokenization always gets a text the
//! tokenizer's caches have never seen.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_router::index::{Index, Slot};
use kvroute_router::policy::{Candidate, LoadView, Policy, PredictedTtft, RouteView};
use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::testdata::tokenizer_dir;
use kvroute_shared::tokenize::PromptTokenizer;
use kvroute_shared::{BlockSize, KeyRoot, block_keys};
use serde_json::json;

/// English-like text of about `tokens` tokens, different for every `seed`:
/// words, capitals, commas, numbers and line breaks.
fn text(seed: u64, tokens: usize) -> String {
    const WORDS: &str = "the router keeps a map of which worker holds each block and sends every request where \
        its prefix is cached so prefill work shrinks while load stays even across engines in one cluster tokenizer \
        attention latency throughput because however measured between documents questions answer should would \
        cannot policy decision memory budget queue scheduler sequence batch model weights context window sliding \
        eviction replica gateway network";
    let words: Vec<&str> = WORDS.split_whitespace().collect();
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = String::with_capacity(tokens * 7);
    for n in 0..tokens {
        let r = next();
        let w = words[(r % words.len() as u64) as usize];
        if n % 14 == 0 {
            if n > 0 {
                out.push_str(if r % 7 == 0 { ".\n" } else { ". " });
            }
            let mut c = w.chars();
            out.extend(c.next().map(|f| f.to_ascii_uppercase()));
            out.push_str(c.as_str());
        } else if r % 23 == 0 {
            out.push_str(&format!(" {}", r % 10_000));
        } else {
            out.push_str(if r % 11 == 0 { ", " } else { " " });
            out.push_str(w);
        }
    }
    out.push('.');
    out
}

/// Median of `runs` timings of `f(i)`, `i` counting from 0.
fn median(runs: usize, mut f: impl FnMut(usize)) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|i| {
            let s = Instant::now();
            f(i);
            s.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 0.1 { format!("{:.4}", ms) } else { format!("{:.2}", ms) }
}

struct Row {
    what: String,
    tokens: usize,
    stages: Vec<(&'static str, Duration)>,
}

fn load(name: &str) -> Option<PromptTokenizer> {
    match tokenizer_dir(name) {
        Ok(dir) => Some(PromptTokenizer::load(&dir).expect("tokenizer loads")),
        Err(why) => {
            eprintln!("{name} not measured: {why}");
            None
        }
    }
}

/// A completion of `tokens` tokens: half a shared document, half new.
fn completion_rows(name: &str, tok: &PromptTokenizer, tokens: usize) -> Row {
    let runs = (200_000 / tokens).clamp(9, 61);
    let shared = text(0, tokens / 2);
    let body = |i: usize, whole_new: bool| {
        let prompt = if whole_new {
            text(1_000 + i as u64 + 7_919 * tokens as u64, tokens)
        } else {
            format!("{shared}\n{}", text(2_000_000 + i as u64 + 7_919 * tokens as u64, tokens / 2))
        };
        json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string().into_bytes()
    };
    let parse = |b: &[u8]| PromptRequest::parse(Endpoint::Completions, b).expect("parses");
    let cold: Vec<PromptRequest> = (0..runs).map(|i| parse(&body(i, true))).collect();
    let half: Vec<PromptRequest> = (0..runs).map(|i| parse(&body(i, false))).collect();
    let one = body(0, false);
    let mut stages = Vec::new();
    stages.push(("parse", median(runs, |_| drop(black_box(parse(black_box(&one)))))));
    stages.push(("tokenize cold", median(runs, |i| drop(black_box(tok.prompt_tokens(&cold[i]))))));
    // The first request a freshly loaded tokenizer sees: no segment, word or
    // BPE cache holds anything yet.
    let first = (0..5)
        .map(|i| {
            let fresh = load(name).expect("loads again");
            let s = Instant::now();
            black_box(fresh.prompt_tokens(&cold[i % runs]).expect("encodes"));
            s.elapsed()
        })
        .min()
        .unwrap_or_default();
    stages.push(("tokenize cold, first request after load (best of 5)", first));
    tok.prompt_tokens(&half[0]).expect("encodes"); // the shared half, once
    stages
        .push(("tokenize, shared half cached", median(runs - 1, |i| drop(black_box(tok.prompt_tokens(&half[i + 1]))))));
    stages.push(("tokenize warm", median(runs, |_| drop(black_box(tok.prompt_tokens(&half[0]))))));
    let ids = tok.prompt_tokens(&half[0]).expect("encodes");
    let n = ids.len();
    let (keys, rest) = after_tokens(&ids, runs);
    stages.extend(keys);
    stages.extend(rest);
    Row { what: format!("{name} completion"), tokens: n, stages }
}

/// A chat of `tokens` tokens: a system prompt and turns, the last one new.
fn chat_rows(tok: &PromptTokenizer, tokens: usize) -> Row {
    let runs = (200_000 / tokens).clamp(9, 61);
    let turns = 8;
    let per = tokens / (2 * turns + 1);
    let messages = |seed: u64, last: u64| {
        let mut m = vec![json!({"role": "system", "content": text(seed, per)})];
        for t in 0..turns as u64 {
            m.push(json!({"role": "user", "content": text(seed + 1 + 2 * t, per)}));
            m.push(json!({"role": "assistant", "content": text(seed + 2 + 2 * t, per)}));
        }
        m.push(json!({"role": "user", "content": text(last, per)}));
        json!({"model": "m", "messages": m}).to_string().into_bytes()
    };
    let parse = |b: &[u8]| PromptRequest::parse(Endpoint::ChatCompletions, b).expect("parses");
    let base = 10_000_000 * tokens as u64;
    let cold: Vec<PromptRequest> = (0..runs).map(|i| parse(&messages(base + 100 * i as u64, 1))).collect();
    let turn: Vec<PromptRequest> = (0..runs).map(|i| parse(&messages(base - 1000, 5_000 + i as u64))).collect();
    let one = messages(base - 1000, 4_999);
    let PromptRequest::Chat(c0) = &turn[0] else { unreachable!() };
    let mut stages = Vec::new();
    stages.push(("parse", median(runs, |_| drop(black_box(parse(black_box(&one)))))));
    stages.push(("render", median(runs, |_| drop(black_box(tok.render_chat(c0).expect("renders"))))));
    stages.push(("render + tokenize cold", median(runs, |i| drop(black_box(tok.prompt_tokens(&cold[i]))))));
    tok.prompt_tokens(&turn[0]).expect("encodes");
    stages.push((
        "render + tokenize, new turn on a cached conversation",
        median(runs - 1, |i| drop(black_box(tok.prompt_tokens(&turn[i + 1])))),
    ));
    stages.push(("render + tokenize warm", median(runs, |_| drop(black_box(tok.prompt_tokens(&turn[0]))))));
    let ids = tok.prompt_tokens(&turn[0]).expect("encodes");
    let n = ids.len();
    let (keys, rest) = after_tokens(&ids, runs);
    stages.extend(keys);
    stages.extend(rest);
    Row { what: "qwen3 chat".into(), tokens: n, stages }
}

type Stages = Vec<(&'static str, Duration)>;

/// Hash, match against 4 workers holding the first half of the prompt to
/// different depths, and the default policy's decision.
fn after_tokens(ids: &[u32], runs: usize) -> (Stages, Stages) {
    let root = KeyRoot::new("m", None);
    let keys = block_keys(root, ids, BlockSize::DEFAULT);
    let hash = median(runs, |_| drop(black_box(block_keys(root, black_box(ids), BlockSize::DEFAULT))));
    let mut ix = Index::new();
    for w in 0..4u16 {
        let depth = keys.len() / 2 * (usize::from(w) + 1) / 4;
        ix.apply_events(Slot(w), false, &[], &keys[..depth]);
    }
    let matched = median(runs.max(1001), |_| drop(black_box(ix.match_depths(black_box(&keys)))));
    let policy = PredictedTtft::default();
    let depths = ix.match_depths(&keys);
    let decide = median(runs.max(1001), |i| {
        let candidates: Vec<Candidate> = (0..4u16)
            .map(|w| Candidate {
                slot: Slot(w),
                matched_blocks: depths.iter().find(|(s, _)| *s == Slot(w)).map_or(0, |d| d.1),
                matched_kind: Default::default(),
                load: LoadView { inflight: u32::from(w % 3), ..Default::default() },
                id_hash: u64::from(w) * 0x9e37_79b9,
            })
            .collect();
        let view = RouteView {
            prompt_tokens: ids.len(),
            block_size: 16,
            keys: &keys,
            head_hash: i as u64,
            candidates: &candidates,
            mean_prompt_tokens: ids.len() as f64,
            mean_uncached_tokens: ids.len() as f64 / 2.0,
            prefix_hint: None,
            dry_run: false,
            sole_router: false,
            routers_counted: false,
        };
        black_box(policy.choose(&view));
    });
    (vec![("hash (block keys)", hash)], vec![("match (4 workers)", matched), ("decide (predicted_ttft)", decide)])
}

/// The tokenize pool's hand-off: a semaphore slot, `spawn_blocking` and the
/// answer back to the async task, with nothing to compute.
fn handoff() -> Duration {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(2));
    rt.block_on(async {
        let mut t = Vec::new();
        for _ in 0..5_000 {
            let s = Instant::now();
            let _slot = slots.acquire().await.expect("open");
            black_box(tokio::task::spawn_blocking(|| black_box(1)).await.expect("runs"));
            t.push(s.elapsed());
        }
        t.sort();
        t[t.len() / 2]
    })
}

fn main() {
    let lengths: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect::<Vec<_>>()
        .into_iter()
        .chain(std::iter::once(0))
        .collect();
    let lengths: Vec<usize> =
        if lengths.len() > 1 { lengths.into_iter().filter(|&n| n > 0).collect() } else { vec![1024, 8192, 32768] };
    let (gpt2, qwen3) = (load("gpt2"), load("qwen3"));
    let mut rows = Vec::new();
    for &n in &lengths {
        if let Some(t) = &gpt2 {
            rows.push(completion_rows("gpt2", t, n));
        }
        if let Some(t) = &qwen3 {
            rows.push(completion_rows("qwen3", t, n));
            rows.push(chat_rows(t, n));
        }
    }
    println!("| request | tokens | stage | median ms |");
    println!("|---|---|---|---|");
    for r in &rows {
        for (stage, d) in &r.stages {
            println!("| {} | {} | {} | {} |", r.what, r.tokens, stage, ms(*d));
        }
    }
    println!("\ntokenize pool hand-off (semaphore + spawn_blocking + wake-up), median: {} ms", ms(handoff()));
}
