//! The router's hot paths: applying events, matching, syncing, deciding, and
//! memory per index entry. Run: `cargo bench -p kvroute-router` (figures in
//! BENCHMARKS.md). Besides criterion's means, `percentiles` prints p50/p99 of
//! single operations, which criterion does not report.
#![allow(unsafe_code)] // the counting allocator below

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_router::index::{DeltaCursor, Index, Slot};
use kvroute_router::internal::SYNC_WRITE_CHUNK;
use kvroute_router::policy::{CacheAware, Candidate, LoadView, Policy, RouteView};
use kvroute_router::replicas::{MAX_HINT_KEYS, PrefixHints, ReplicaLoad, ReplicaReport, SentPrefix, prefixes};
use kvroute_shared::{BlockKey, KeyRoot, WorkerId};

/// Counts live heap bytes, to measure the index's memory per entry.
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A chain of `n` keys, distinct per `seed`.
fn chain(seed: u64, n: usize) -> Vec<BlockKey> {
    let mut parent = KeyRoot::new("bench", Some(&seed.to_string())).0;
    (0..n)
        .map(|i| {
            parent = BlockKey::chain(parent, &[i as u32; 4]);
            parent
        })
        .collect()
}

/// 16 workers × 62,500 keys = 1 M entries, in chains of 500 blocks; every
/// chain is held by one worker, and chain 0 by workers 0..4 (a hot prefix).
fn big_index() -> (Index, Vec<BlockKey>) {
    let mut ix = Index::new();
    for w in 0..16u16 {
        for c in 0..125u64 {
            ix.apply_events(Slot(w), false, &[], &chain(u64::from(w) * 1000 + c, 500));
        }
    }
    let hot = chain(999_999, 512);
    for w in 0..4u16 {
        ix.apply_events(Slot(w), false, &[], &hot[..128 * (usize::from(w) + 1)]);
    }
    (ix, hot)
}

fn events(c: &mut Criterion) {
    let keys = chain(1, 10_000);
    let mut g = c.benchmark_group("index");
    g.throughput(Throughput::Elements(2 * keys.len() as u64));
    g.bench_function("apply 10k stores + 10k evictions", |b| {
        b.iter_batched_ref(
            Index::new,
            |ix| {
                ix.apply_events(Slot(1), false, &[], black_box(&keys));
                ix.apply_events(Slot(1), false, black_box(&keys), &[]);
            },
            BatchSize::SmallInput,
        )
    });
    let sync_keys = chain(2, 100_000);
    let old = chain(3, 100_000);
    g.throughput(Throughput::Elements(sync_keys.len() as u64));
    g.bench_function("destructive sync of 100k keys (replacing 100k)", |b| {
        b.iter_batched_ref(
            || {
                let mut ix = Index::new();
                ix.apply_events(Slot(0), false, &[], &old);
                ix
            },
            |ix| ix.sync(Slot(0), black_box(&sync_keys), 0),
            BatchSize::LargeInput,
        )
    });
    g.finish();

    let (ix, hot) = big_index();
    let mut g = c.benchmark_group("match");
    g.bench_function("512-block request vs 1M entries / 16 workers", |b| b.iter(|| ix.match_depths(black_box(&hot))));
    g.finish();
}

fn percentiles(label: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!("{label}: p50 {:?}  p99 {:?}  max {:?}  (n = {})", p(0.5), p(0.99), p(1.0), samples.len());
}

/// Single-operation latencies and memory, printed once.
fn report(_: &mut Criterion) {
    let before = LIVE.load(Ordering::Relaxed);
    let (ix, hot) = big_index();
    let bytes = LIVE.load(Ordering::Relaxed) - before;
    println!(
        "index memory: {} entries, {} keys, {:.1} MB heap, {:.1} bytes per (key, worker) entry",
        ix.entry_count(),
        ix.key_count(),
        bytes as f64 / 1e6,
        bytes as f64 / ix.entry_count() as f64
    );

    let samples = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            black_box(ix.match_depths(black_box(&hot)));
            t.elapsed()
        })
        .collect();
    percentiles("match 512 blocks vs 1M entries", samples);

    // The whole decision after tokenization: keys of a 1k-token prompt (64
    // blocks, hashed), match, candidates, cache_aware.
    let tokens: Vec<u32> = (0..1024).collect();
    let policy = CacheAware::default();
    let samples = (0..20_000)
        .map(|i| {
            let t = Instant::now();
            let keys = kvroute_shared::block_keys(KeyRoot::new("bench", Some("999999")), &tokens, Default::default());
            let depths = ix.match_depths(&keys);
            let candidates: Vec<Candidate> = (0..16u16)
                .map(|w| Candidate {
                    slot: Slot(w),
                    matched_blocks: depths.iter().find(|(s, _)| *s == Slot(w)).map_or(0, |d| d.1),
                    matched_kind: Default::default(),
                    load: LoadView { inflight: u32::from(w % 3), ..Default::default() },
                    id_hash: u64::from(w) * 0x9e37_79b9,
                })
                .collect();
            let view = RouteView {
                prompt_tokens: tokens.len(),
                block_size: 16,
                keys: &keys,
                head_hash: i,
                candidates: &candidates,
                mean_prompt_tokens: 1000.0,
                mean_uncached_tokens: 1000.0,
                prefix_hint: None,
                dry_run: false,
                sole_router: false,
                routers_counted: false,
            };
            black_box(policy.choose(&view));
            t.elapsed()
        })
        .collect();
    percentiles("decision for a 1k-token prompt (hash 64 blocks + match + cache_aware, 16 workers)", samples);

    // The longest write-lock hold of a hostile (or far behind) delta: a
    // `cleared` batch of 1M stores over a worker holding 1M keys, at once
    // and in SYNC_WRITE_CHUNK pieces as `/internal/eviction` applies it.
    let (held, next) = (chain(7, 1_000_000), chain(8, 1_000_000));
    let worker = || {
        let mut ix = Index::new();
        ix.apply_events(Slot(0), false, &[], &held);
        ix
    };
    let mut ix = worker();
    let t = Instant::now();
    ix.apply_events(Slot(0), true, &[], black_box(&next));
    println!("cleared delta of 1M keys over 1M held, at once: {:?}", t.elapsed());
    let mut ix = worker();
    let mut cursor = DeltaCursor::new(true);
    let mut holds = Vec::new();
    loop {
        let t = Instant::now();
        let more = ix.apply_some(Slot(0), &mut cursor, &[], black_box(&next), SYNC_WRITE_CHUNK);
        holds.push(t.elapsed());
        if !more {
            break;
        }
    }
    println!("  in chunks: total {:?}", holds.iter().sum::<Duration>());
    percentiles("  in chunks, each write-lock hold", holds);
}

/// A replica's report as a busy one sends it: 16 workers with requests in
/// flight, and 200 requests named in `sent` (100 requests/s, each named
/// until a second after its first token), each a 9k-token prompt's
/// sampled keys.
fn busy_report(seed: u64) -> ReplicaReport {
    ReplicaReport {
        router_epoch: format!("epoch-{seed}"),
        seq: 1,
        workers: (0..16)
            .map(|w| ReplicaLoad { id: WorkerId::new(format!("w{w}")), pending_prefill_tokens: 20_000, inflight: 12 })
            .collect(),
        sent: (0..200u64)
            .map(|r| SentPrefix {
                worker: WorkerId::new(format!("w{}", r % 16)),
                keys: prefixes::sample(&chain(seed * 1_000 + r, 576)),
            })
            .collect(),
        loads_only: false,
    }
}

/// What the replicas' exchange costs one router per report: encoding its
/// own, decoding and checking another's, and rebuilding the prefix hints
/// from two peers' reports (`Replicas::publish` after a new one).
fn replicas(c: &mut Criterion) {
    let report = busy_report(1);
    let body = serde_json::to_vec(&report).expect("a report encodes");
    let peers = [busy_report(2), busy_report(3)];
    println!(
        "replica report: {} requests named, {} keys each, {} bytes of JSON",
        report.sent.len(),
        report.sent[0].keys.len(),
        body.len()
    );
    let mut g = c.benchmark_group("replicas");
    g.bench_function("encode a busy report", |b| b.iter(|| serde_json::to_vec(black_box(&report))));
    g.bench_function("decode and check a busy report", |b| {
        b.iter(|| kvroute_shared::wire::decode_valid::<ReplicaReport>(black_box(&body)).expect("valid"))
    });
    g.bench_function("prefix hints from two busy peers", |b| {
        b.iter(|| PrefixHints::build(black_box(&peers).iter().flat_map(|p| &p.sent), MAX_HINT_KEYS))
    });
    // The most any set of reports can make a rebuild read: 64 replicas
    // naming 1,024 requests of 128 distinct keys each, 8.4 M keys, of which
    // the first MAX_HINT_KEYS are taken.
    let flood: Vec<SentPrefix> = (0..64 * 1_024u64)
        .map(|r| SentPrefix {
            worker: WorkerId::new(format!("w{}", r % 64)),
            keys: (0..128).map(|k| BlockKey(r << 8 | k)).collect(),
        })
        .collect();
    g.bench_function("prefix hints at their cap (a flood of reports)", |b| {
        b.iter(|| PrefixHints::build(black_box(&flood), MAX_HINT_KEYS))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1)).sample_size(20);
    targets = report, events, replicas
}
criterion_main!(benches);
