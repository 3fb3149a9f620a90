//! Engine statistics the engine thread writes and `GET /metrics` reads.
//!
//! Plain atomics: one writer (the engine thread, once per step), many readers,
//! and no reader needs two values to agree exactly. The TTFT histogram is
//! `prometheus-client`'s (a lock held for a few nanoseconds per first token).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use prometheus_client::metrics::histogram::Histogram;

/// vLLM's `vllm:time_to_first_token_seconds` bucket bounds.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

#[derive(Debug)]
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
    /// `vllm:time_to_first_token_seconds` over [`TTFT_BUCKETS`].
    pub ttft: Histogram,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        EngineMetrics {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_usage: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS.iter().copied()),
        }
    }
}

impl EngineMetrics {
    pub fn set_kv_usage(&self, v: f64) {
        self.kv_usage.store(v.to_bits(), Relaxed);
    }

    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage.load(Relaxed))
    }
}
