//! Engine statistics the engine thread writes and `GET /metrics` reads.
//!
//! Plain atomics: one writer (the engine thread, once per step), many readers,
//! and no reader needs two values to agree exactly. The TTFT histogram sits
//! behind a mutex held for a few nanoseconds per first token.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

/// vLLM's `vllm:time_to_first_token_seconds` bucket bounds.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// f64 bits.
    kv_usage: AtomicU64,
    /// Prompt tokens looked up in the prefix cache (vLLM counts tokens).
    pub prefix_queries: AtomicU64,
    /// Prompt tokens found there.
    pub prefix_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Requests sent back to the waiting queue for lack of KV blocks.
    pub preemptions: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished: AtomicU64,
    pub ttft: Mutex<Histogram>,
}

impl EngineMetrics {
    pub fn set_kv_usage(&self, v: f64) {
        self.kv_usage.store(v.to_bits(), Relaxed);
    }

    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage.load(Relaxed))
    }
}

/// A cumulative Prometheus histogram over [`TTFT_BUCKETS`].
#[derive(Debug, Clone)]
pub struct Histogram {
    /// Non-cumulative counts per bucket; one extra for `+Inf`.
    counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: vec![0; TTFT_BUCKETS.len() + 1], sum: 0.0, count: 0 }
    }
}

impl Histogram {
    pub fn observe(&mut self, v: f64) {
        let i = TTFT_BUCKETS.iter().position(|&b| v <= b).unwrap_or(TTFT_BUCKETS.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// `(upper bound, cumulative count)` per finite bucket.
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        TTFT_BUCKETS
            .iter()
            .zip(self.counts.iter().scan(0u64, |acc, c| {
                *acc += c;
                Some(*acc)
            }))
            .map(|(b, c)| (*b, c))
    }
}
