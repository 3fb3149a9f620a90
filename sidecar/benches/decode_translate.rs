//! Decode + translate throughput (target ≥ 1 M block events/s on one core) and
//! the translator's memory per tracked block (target ≤ 64 bytes).
//!
//! `cargo bench -p kvroute-sidecar --bench decode_translate`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_shared::{BlockSize, ModelName};
use kvroute_sidecar::coalesce::Pending;
use kvroute_sidecar::decode::decode_payload;
use kvroute_sidecar::metrics::TranslateCounters;
use kvroute_sidecar::translate::{NullSink, Rank, Translator};
use rmpv::Value as M;

const BLOCK: u32 = 16;
const EVENTS: usize = 16;
const BLOCKS_PER_EVENT: usize = 32;

fn hash(i: u64) -> u64 {
    // Engine hashes are large, often ≥ 2^63 (msgpack uint64).
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | (1 << 63)
}

fn encode(events: Vec<M>) -> Vec<u8> {
    let payload = M::Array(vec![M::F64(1.7e9), M::Array(events), M::from(0)]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &payload).unwrap();
    buf
}

/// One batch storing EVENTS × BLOCKS_PER_EVENT chained blocks (vLLM's current
/// map encoding), and one removing them all.
fn payloads(base: u64) -> (Vec<u8>, Vec<u8>) {
    let mut stores = Vec::new();
    let mut all = Vec::new();
    let mut parent: Option<u64> = None;
    let mut n = base;
    for e in 0..EVENTS {
        let hashes: Vec<u64> = (0..BLOCKS_PER_EVENT)
            .map(|_| {
                n += 1;
                hash(n)
            })
            .collect();
        let tokens: Vec<M> = (0..BLOCKS_PER_EVENT as u32 * BLOCK)
            .map(|t| M::from((base as u32).wrapping_add(t * 7 + e as u32)))
            .collect();
        stores.push(M::Map(vec![
            (M::from("type"), M::from("BlockStored")),
            (M::from("block_hashes"), M::Array(hashes.iter().map(|h| M::from(*h)).collect())),
            (M::from("parent_block_hash"), parent.map_or(M::Nil, M::from)),
            (M::from("token_ids"), M::Array(tokens)),
            (M::from("block_size"), M::from(BLOCK)),
            (M::from("lora_id"), M::Nil),
            (M::from("medium"), M::from("GPU")),
            (M::from("lora_name"), M::Nil),
        ]));
        parent = hashes.last().copied();
        all.extend(hashes);
    }
    let remove = M::Map(vec![
        (M::from("type"), M::from("BlockRemoved")),
        (M::from("block_hashes"), M::Array(all.iter().map(|h| M::from(*h)).collect())),
        (M::from("medium"), M::from("GPU")),
    ]);
    (encode(stores), encode(vec![remove]))
}

fn translator() -> Translator {
    Translator::new(ModelName::new("qwen3-8b"), BlockSize::new(BLOCK).unwrap(), TranslateCounters::default())
}

fn bench(c: &mut Criterion) {
    let (store, remove) = payloads(0);
    let blocks = (EVENTS * BLOCKS_PER_EVENT) as u64;
    let mut g = c.benchmark_group("sidecar");
    g.throughput(Throughput::Elements(2 * blocks));
    g.bench_function("decode_translate_store_then_remove", |b| {
        let mut t = translator();
        let mut pending = Pending::new(1 << 20);
        pending.sync_taken();
        b.iter(|| {
            for p in [&store, &remove] {
                let batch = decode_payload(black_box(p)).unwrap();
                for ev in &batch.events {
                    t.apply(Rank(0), ev, &mut pending);
                }
            }
            // What the pusher does every 100 ms.
            black_box(pending.take());
        });
    });
    g.bench_function("decode_only", |b| {
        b.iter(|| {
            black_box(decode_payload(black_box(&store)).unwrap());
            black_box(decode_payload(black_box(&remove)).unwrap());
        });
    });
    let decoded = [decode_payload(&store).unwrap(), decode_payload(&remove).unwrap()];
    g.bench_function("translate_only", |b| {
        let mut t = translator();
        b.iter(|| {
            for batch in &decoded {
                for ev in &batch.events {
                    t.apply(Rank(0), ev, &mut NullSink);
                }
            }
        });
    });
    g.finish();
}

/// Table memory per tracked block at several cache sizes (printed once).
fn memory(_: &mut Criterion) {
    let mut t = translator();
    let mut tracked = 0usize;
    let mut base = 0u64;
    for target in [100_000usize, 300_000, 500_000, 700_000, 1_000_000, 1_500_000, 2_000_000] {
        while tracked < target {
            let (store, _) = payloads(base);
            base += (EVENTS * BLOCKS_PER_EVENT) as u64;
            for ev in &decode_payload(&store).unwrap().events {
                t.apply(Rank(0), ev, &mut NullSink);
            }
            tracked = t.block_count();
        }
        println!(
            "memory: {} blocks, {} keys, {} table bytes, {:.1} bytes/block",
            t.block_count(),
            t.key_count(),
            t.table_bytes(),
            t.table_bytes() as f64 / t.block_count() as f64
        );
    }
}

criterion_group!(benches, memory, bench);
criterion_main!(benches);
