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
//! | `mixed` | held out: a quarter each of `chat`, `rag`, `agent` and `eviction` on one cluster |
//! | `unique` | held out: no two prompts share a token; long-tailed prompts and answers |
//!
//! The first seven are [`WorkloadKind::ALL`], on which the routing defaults
//! were tuned (every `kvroute-lab matrix` runs them unless told otherwise);
//! `mixed` and `unique` came after them and are kept out of that set
//! ([`WorkloadKind::HELD_OUT`]), a check on what the tuning did not see.
//!
//! Each generator documents its parameters in its own file.
//!
//! **Open and closed loop.** By default every arrival time is fixed in
//! advance and a load level squeezes or stretches all of them, think times
//! included (open loop). `chat`, `long_conv` and `agent` are made of
//! sessions whose turns follow one another; with [`Shape::closed_loop`] a
//! turn is sent its think time after the previous turn's answer has ended,
//! think times stay as generated (people do not read faster on a bigger
//! cluster), a load level scales only when sessions start, and sessions are
//! never cut short (a run has at least the requested number of requests).
//!
//! Open loop stays the default: the CI gate and every earlier comparison
//! use it, and a closed loop reaches its nominal load only once sessions
//! start over longer than one lasts (chat: ~50 s), so it needs about
//! rate × 100 s requests (at 64 workers, 10⁵). Open loop's cost is that a
//! squeezed think time can send a turn before the previous answer has
//! ended, which understates what a router can reuse on big clusters.

mod agent;
mod burst;
mod chat;
mod eviction;
mod long_conv;
mod mixed;
mod rag;
mod trace;
mod unique;

use std::collections::HashSet;
use std::path::PathBuf;

use crate::prompt::{Prompt, Segment, splitmix64};
use crate::time::Micros;

pub use trace::default_trace_path;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    /// Arrival time; in a closed loop only a session's first turn keeps it,
    /// later turns' are what they would be if every answer were instant.
    pub at: Micros,
    pub prompt: Prompt,
    pub max_tokens: u32,
    /// Its place in a session, if the workload has sessions.
    pub turn: Option<Turn>,
    /// Closed loop: the index of the request whose answer this one waits for.
    pub after: Option<u32>,
}

impl RequestSpec {
    pub fn new(at: Micros, prompt: Prompt, max_tokens: u32) -> RequestSpec {
        RequestSpec { at, prompt, max_tokens, turn: None, after: None }
    }

    pub fn in_session(mut self, turn: Turn) -> RequestSpec {
        self.turn = Some(turn);
        self
    }
}

/// A request's place in a session (a conversation, an agent's loop).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Turn {
    pub session: u64,
    /// 0 for the session's first request.
    pub index: u32,
    /// How long after the previous turn's answer this one is sent.
    pub think: Micros,
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
    Mixed,
    Unique,
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

    /// Workloads no default was tuned on (see the module docs).
    pub const HELD_OUT: [WorkloadKind; 2] = [WorkloadKind::Mixed, WorkloadKind::Unique];

    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::Trace => "trace",
            WorkloadKind::Chat => "chat",
            WorkloadKind::LongConv => "long_conv",
            WorkloadKind::Rag => "rag",
            WorkloadKind::Agent => "agent",
            WorkloadKind::Eviction => "eviction",
            WorkloadKind::Burst => "burst",
            WorkloadKind::Mixed => "mixed",
            WorkloadKind::Unique => "unique",
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
    /// Send a session's turns after the previous answer (see the module docs).
    pub closed_loop: bool,
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
            WorkloadKind::Mixed => mixed::generate(shape),
            WorkloadKind::Unique => unique::generate(shape),
        };
        requests.sort_by_key(|r| r.at);
        let closed = shape.closed_loop && requests.iter().any(|r| r.turn.is_some());
        if closed {
            link_turns(&mut requests);
        } else {
            requests.truncate(shape.requests);
        }
        Ok(Workload { kind, requests })
    }

    /// Whether turns wait for the previous answer (see the module docs).
    pub fn closed_loop(&self) -> bool {
        self.requests.iter().any(|r| r.after.is_some())
    }

    /// Mean arrival rate (requests per second) over the workload's span; in
    /// a closed loop, the request count over the span in which sessions
    /// start (the rate in the steady state, where as many end as start).
    pub fn rate(&self) -> f64 {
        let span = self.span().as_secs_f64();
        if span <= 0.0 { f64::INFINITY } else { self.requests.len() as f64 / span }
    }

    /// From the first arrival to the last (closed loop: the last session start).
    pub fn span(&self) -> Micros {
        let closed = self.closed_loop();
        let last = self.requests.iter().rev().find(|r| !closed || r.after.is_none());
        match (self.requests.first(), last) {
            (Some(a), Some(b)) => b.at.saturating_sub(a.at),
            _ => Micros::ZERO,
        }
    }

    /// The same requests, arrival times scaled so the mean rate is `rate`
    /// (closed loop: only session starts are scaled; a later turn's nominal
    /// time is its predecessor's plus its think time).
    pub fn at_rate(&self, rate: f64) -> Workload {
        let factor = self.rate() / rate;
        let t0 = self.requests.first().map_or(0, |r| r.at.0);
        let scaled = |at: Micros| Micros(((at.0 - t0) as f64 * factor).round() as u64);
        let mut requests: Vec<RequestSpec> = Vec::with_capacity(self.requests.len());
        for r in &self.requests {
            let at = match (r.after, r.turn) {
                (Some(prev), Some(turn)) => requests[prev as usize].at + turn.think,
                _ => scaled(r.at),
            };
            requests.push(RequestSpec { at, ..r.clone() });
        }
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

/// Points every later turn at its session's previous one (`after`); the
/// requests are in arrival order, so a predecessor always comes first.
fn link_turns(requests: &mut [RequestSpec]) {
    let mut last: std::collections::HashMap<u64, (u32, u32)> = std::collections::HashMap::new();
    for (i, r) in requests.iter_mut().enumerate() {
        let Some(turn) = r.turn else { continue };
        if let Some(&(prev, index)) = last.get(&turn.session)
            && index + 1 == turn.index
        {
            r.after = Some(prev);
        }
        last.insert(turn.session, (i as u32, turn.index));
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
        Shape {
            requests: n,
            seed: 3,
            cluster_kv_tokens: 4 * 2_000 * 16,
            trace_path: default_trace_path(),
            closed_loop: false,
        }
    }

    #[test]
    fn every_synthetic_workload_is_deterministic_and_sized() {
        for kind in WorkloadKind::ALL.into_iter().chain(WorkloadKind::HELD_OUT).filter(|k| *k != WorkloadKind::Trace) {
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
    fn unique_prompts_share_nothing() {
        let w = Workload::generate(WorkloadKind::Unique, &shape(2_000)).unwrap();
        let firsts: HashSet<Segment> = w.requests.iter().map(|r| r.prompt.0[0]).collect();
        assert_eq!(firsts.len(), w.requests.len(), "every prompt its own");
        assert!(w.requests.iter().all(|r| r.prompt.0.len() == 1));
        let long = w.requests.iter().filter(|r| r.prompt.len() >= 4_000).count();
        assert!((40..=180).contains(&long), "a long tail of prompts: {long} of 2,000 past 4k tokens");
    }

    #[test]
    fn mixed_is_a_quarter_of_each_tenant_over_one_span() {
        let s = shape(400);
        let w = Workload::generate(WorkloadKind::Mixed, &s).unwrap();
        // Each tenant's prompts start with its own first segment.
        let tenant = |r: &RequestSpec| match r.prompt.0[0] {
            x if x == seg(s.seed, 1, 0, 1_200) => 0,  // chat's system prompt
            x if x == seg(s.seed, 20, 0, 300) => 1,   // rag's instruction
            x if x == seg(s.seed, 30, 0, 6_000) => 2, // agent's tool prompt
            x if x.len == 2_048 => 3,                 // an eviction document
            x => panic!("a prompt of no tenant: {x:?}"),
        };
        let mut count = [0usize; 4];
        let mut last = [Micros::ZERO; 4];
        for r in &w.requests {
            let t = tenant(r);
            count[t] += 1;
            last[t] = last[t].max(r.at);
        }
        assert_eq!(count, [100; 4]);
        // Scaled to one span: every tenant's last request comes at the end.
        let end = w.requests.last().unwrap().at;
        assert!(last.iter().all(|&l| l.0 + 1 >= end.0), "{last:?} against {end:?}");
        // Sessions of different tenants never share an id.
        let sessions = |t: usize| -> HashSet<u64> {
            w.requests.iter().filter(|r| tenant(r) == t).filter_map(|r| r.turn.map(|x| x.session)).collect()
        };
        assert!(sessions(0).is_disjoint(&sessions(2)));
        assert!(!sessions(0).is_empty() && !sessions(2).is_empty());
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
    fn a_closed_loop_keeps_whole_sessions_and_scales_only_their_starts() {
        let open = Workload::generate(WorkloadKind::Chat, &shape(300)).unwrap();
        let closed = Workload::generate(WorkloadKind::Chat, &Shape { closed_loop: true, ..shape(300) }).unwrap();
        assert!(!open.closed_loop() && closed.closed_loop());
        assert!(closed.requests.len() >= 300, "sessions are not cut short");
        // Every later turn waits for its session's previous one, which comes first.
        for (i, r) in closed.requests.iter().enumerate() {
            let turn = r.turn.expect("chat requests are turns");
            match r.after {
                None => assert_eq!(turn.index, 0, "request {i}"),
                Some(prev) => {
                    let p = closed.requests[prev as usize].turn.unwrap();
                    assert!((prev as usize) < i);
                    assert_eq!((p.session, p.index + 1), (turn.session, turn.index), "request {i}");
                }
            }
        }
        // Ten times the rate: starts ten times closer, think times as they were.
        let fast = closed.at_rate(closed.rate() * 10.0);
        assert!((fast.span().as_secs_f64() * 10.0 - closed.span().as_secs_f64()).abs() < 0.01);
        for (a, b) in closed.requests.iter().zip(&fast.requests) {
            if let (Some(prev), Some(turn)) = (b.after, b.turn) {
                assert_eq!(b.at, fast.requests[prev as usize].at + turn.think);
                // (generated as sums of seconds, so within a microsecond)
                let generated = a.at.saturating_sub(closed.requests[prev as usize].at);
                assert!(generated.0.abs_diff(turn.think.0) <= 1, "{generated:?} against {:?}", turn.think);
            }
        }
        // Workloads without sessions are the same either way.
        let rag = |closed_loop| Workload::generate(WorkloadKind::Rag, &Shape { closed_loop, ..shape(300) }).unwrap();
        assert_eq!(rag(true).requests, rag(false).requests);
    }

    #[test]
    fn the_trace_workload_says_when_its_file_is_missing() {
        let s = Shape { trace_path: "/nonexistent/trace.jsonl".into(), ..shape(10) };
        let e = Workload::generate(WorkloadKind::Trace, &s).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }
}
