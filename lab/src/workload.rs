//! The workload library: every workload is a list of requests (arrival time,
//! prompt as [`Segment`]s, output length) generated deterministically from a
//! seed, then stretched or squeezed in time to the rate a run asks for.
//!
//! | name | shape |
//! |---|---|
//! | `trace` | Mooncake-format trace replay (`hash_ids` are 512-token blocks) |
//! | `chat` | multi-turn chat behind one shared system prompt; users come and go, conversations grow |
//! | `long_conv` | conversations sharing only their first block, ~14k-token prompts |
//! | `rag` | a few long documents, many short questions |
//! | `agent` | tool/agent loops: a long shared tool prompt, short appended turns |
//! | `eviction` | Zipf popularity over a working set 3–5 × the cluster's KV capacity |
//! | `burst` | bursts of requests sharing a fresh prefix, over light background traffic |
//!
//! Each generator documents its parameters in its own file.

mod agent;
mod burst;
mod chat;
mod eviction;
mod long_conv;
mod rag;
mod trace;

use std::collections::HashSet;
use std::path::PathBuf;

use crate::prompt::{Prompt, Segment, splitmix64};
use crate::time::Micros;

pub use trace::default_trace_path;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    pub at: Micros,
    pub prompt: Prompt,
    pub max_tokens: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum WorkloadKind {
    Trace,
    Chat,
    LongConv,
    Rag,
    Agent,
    Eviction,
    Burst,
}

impl WorkloadKind {
    pub const ALL: [WorkloadKind; 7] = [
        WorkloadKind::Trace,
        WorkloadKind::Chat,
        WorkloadKind::LongConv,
        WorkloadKind::Rag,
        WorkloadKind::Agent,
        WorkloadKind::Eviction,
        WorkloadKind::Burst,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::Trace => "trace",
            WorkloadKind::Chat => "chat",
            WorkloadKind::LongConv => "long_conv",
            WorkloadKind::Rag => "rag",
            WorkloadKind::Agent => "agent",
            WorkloadKind::Eviction => "eviction",
            WorkloadKind::Burst => "burst",
        }
    }
}

/// What a generator needs to know.
#[derive(Clone, Debug)]
pub struct Shape {
    pub requests: usize,
    pub seed: u64,
    /// The cluster's total KV capacity in tokens (sizes `eviction`'s working set).
    pub cluster_kv_tokens: u64,
    /// Where the `trace` workload reads its file.
    pub trace_path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error(
        "the trace workload needs {path}, which does not exist (it lives in ../shared/testdata beside the checkout; pass --trace PATH)"
    )]
    TraceMissing { path: PathBuf },
    #[error("cannot read trace {path}: {source}")]
    TraceRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("trace {path} line {line}: {source}")]
    TraceParse {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("trace {path} has no requests")]
    TraceEmpty { path: PathBuf },
}

#[derive(Clone, Debug)]
pub struct Workload {
    pub kind: WorkloadKind,
    /// In arrival order.
    pub requests: Vec<RequestSpec>,
}

impl Workload {
    pub fn generate(kind: WorkloadKind, shape: &Shape) -> Result<Workload, WorkloadError> {
        let mut requests = match kind {
            WorkloadKind::Trace => trace::generate(shape)?,
            WorkloadKind::Chat => chat::generate(shape),
            WorkloadKind::LongConv => long_conv::generate(shape),
            WorkloadKind::Rag => rag::generate(shape),
            WorkloadKind::Agent => agent::generate(shape),
            WorkloadKind::Eviction => eviction::generate(shape),
            WorkloadKind::Burst => burst::generate(shape),
        };
        requests.sort_by_key(|r| r.at);
        requests.truncate(shape.requests);
        Ok(Workload { kind, requests })
    }

    /// Mean arrival rate (requests per second) over the workload's span.
    pub fn rate(&self) -> f64 {
        let span = self.span().as_secs_f64();
        if span <= 0.0 { f64::INFINITY } else { self.requests.len() as f64 / span }
    }

    pub fn span(&self) -> Micros {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.at.saturating_sub(a.at),
            _ => Micros::ZERO,
        }
    }

    /// The same requests, arrival times scaled so the mean rate is `rate`.
    pub fn at_rate(&self, rate: f64) -> Workload {
        let factor = self.rate() / rate;
        let t0 = self.requests.first().map_or(0, |r| r.at.0);
        let requests = self
            .requests
            .iter()
            .map(|r| RequestSpec { at: Micros(((r.at.0 - t0) as f64 * factor).round() as u64), ..r.clone() })
            .collect();
        Workload { kind: self.kind, requests }
    }

    /// Mean engine work per request in µs if every prompt hit the infinite
    /// cache's ceiling, at segment granularity (an estimate for choosing
    /// rates; the run itself measures the exact ceiling per block):
    /// uncached prefill at `prefill_us` a token plus `decode_us` per output token.
    pub fn ideal_work_us(&self, prefill_us: f64, decode_us: f64) -> f64 {
        let mut seen: HashSet<u64> = HashSet::new();
        let mut total = 0.0;
        for r in &self.requests {
            let mut chain = 0u64;
            let mut hit = 0usize;
            let mut prefix_alive = true;
            for s in &r.prompt.0 {
                chain = splitmix64(chain ^ s.seed ^ (u64::from(s.len) << 40));
                if prefix_alive && seen.contains(&chain) {
                    hit += s.len as usize;
                } else {
                    prefix_alive = false;
                    seen.insert(chain);
                }
            }
            let miss = r.prompt.len().saturating_sub(hit).max(1);
            total += miss as f64 * prefill_us + f64::from(r.max_tokens) * decode_us;
        }
        total / self.requests.len().max(1) as f64
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.prompt.len() as u64).sum()
    }
}

/// A segment seeded by a workload-specific domain and index: distinct
/// (domain, index) pairs never share tokens.
pub(crate) fn seg(seed: u64, domain: u64, index: u64, len: u64) -> Segment {
    Segment { seed: splitmix64(seed ^ splitmix64(domain.wrapping_mul(0x1000_0000_01b3) ^ index)), len: len as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize) -> Shape {
        Shape { requests: n, seed: 3, cluster_kv_tokens: 4 * 2_000 * 16, trace_path: default_trace_path() }
    }

    #[test]
    fn every_synthetic_workload_is_deterministic_and_sized() {
        for kind in WorkloadKind::ALL.into_iter().filter(|k| *k != WorkloadKind::Trace) {
            let a = Workload::generate(kind, &shape(300)).unwrap();
            let b = Workload::generate(kind, &shape(300)).unwrap();
            assert_eq!(a.requests, b.requests, "{kind:?}");
            assert_eq!(a.requests.len(), 300, "{kind:?}");
            assert!(a.requests.windows(2).all(|w| w[0].at <= w[1].at));
            let c = Workload::generate(kind, &Shape { seed: 4, ..shape(300) }).unwrap();
            assert_ne!(a.requests, c.requests, "{kind:?}: the seed matters");
        }
    }

    #[test]
    fn rescaling_sets_the_rate_and_keeps_the_order() {
        let w = Workload::generate(WorkloadKind::Chat, &shape(200)).unwrap();
        let fast = w.at_rate(50.0);
        assert!((fast.rate() - 50.0).abs() < 0.5, "{}", fast.rate());
        assert_eq!(fast.requests.len(), w.requests.len());
        assert!(fast.requests.windows(2).all(|p| p[0].at <= p[1].at));
    }

    #[test]
    fn the_trace_workload_says_when_its_file_is_missing() {
        let s = Shape { trace_path: "/nonexistent/trace.jsonl".into(), ..shape(10) };
        let e = Workload::generate(WorkloadKind::Trace, &s).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }
}
