//! Choosing a worker (DESIGN.md §4).
//!
//! A [`Policy`] is a pure, synchronous function of what the router knows about
//! one request — its block keys, each candidate's cached-prefix depth, load and
//! health — to a [`Decision`] with a [`Reason`]. It never sees HTTP types, so
//! every policy is unit-tested on plain values and the benchmark compares them
//! on equal terms.

mod baselines;
mod cache_aware;
mod dynamo;
mod llm_d;
mod preble;
mod predicted_ttft;
mod prefix_threshold;
mod sticky;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_shared::BlockKey;
use serde::Serialize;

pub use baselines::{ConsistentHash, LeastLoaded, PowerOfTwo, RoundRobin};
pub use cache_aware::{CacheAware, CacheAwareParams};
pub use dynamo::{DynamoKv, DynamoParams};
pub use llm_d::{LlmdParams, LlmdWeighted};
pub use preble::{Preble, PrebleParams};
pub use predicted_ttft::{PredictedTtft, PredictedTtftParams};
pub use prefix_threshold::{PrefixThreshold, PrefixThresholdParams};
pub use sticky::StickyLeastLoaded;

use crate::index::{MatchKind, Slot};

/// The policy a router runs unless configured otherwise (chosen in the
/// virtual-time lab, BENCHMARKS.md).
pub const DEFAULT_POLICY: &str = "predicted_ttft";

/// One worker's load as the router sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LoadView {
    /// Requests this router has in flight there.
    pub inflight: u32,
    /// Prompt tokens sent there and not yet past first token: this router's,
    /// plus what the other replicas last reported (`replica_pending_prefill_tokens`).
    pub pending_prefill_tokens: u64,
    /// The other replicas' part of `pending_prefill_tokens`
    /// (`crate::replicas`; 0 without them).
    pub replica_pending_prefill_tokens: u64,
    /// Requests the other replicas last reported in flight there.
    pub replica_inflight: u32,
    /// vLLM's `num_requests_running` / `num_requests_waiting` as the sidecar
    /// last reported them (all routers' traffic).
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
    /// Requests per second this router sent there lately ([`ArrivalRate`]).
    pub arrival_rate: f64,
    /// The worker's measured pace: its recent first tokens' time over what
    /// the timing model predicted for them ([`Pace`]); `None` until it has
    /// enough samples.
    pub pace: Option<f64>,
    /// KV blocks the index holds for the worker (every kind), and its KV
    /// cache in blocks (vLLM's `num_gpu_blocks`; `None` while unknown). An
    /// engine keeps a block's contents cached until it needs the block
    /// again, so a warm worker holds about all of them: room is what only a
    /// cold or newly added worker (or one traffic has passed by) has.
    pub held_blocks: u64,
    pub capacity_blocks: Option<u64>,
}

/// Requests reaching the workers that this router does not know of: those of
/// another router that does not exchange with it, or of clients that bypass
/// the routers ([`ReportWatch`] finds them in a worker's load reports). For
/// [`ForeignTraffic::HOLD_MS`] after the last sighting the router does not
/// count itself the [sole router](RouteView::sole_router).
#[derive(Debug, Default)]
pub struct ForeignTraffic {
    /// Unix (or virtual) ms of the last report with unaccounted requests; 0: none.
    last_seen_ms: AtomicU64,
}

impl ForeignTraffic {
    /// How long unaccounted requests keep a router from counting itself the
    /// only one.
    pub const HOLD_MS: u64 = 60_000;

    /// A worker's report showed `unaccounted` requests at `now_ms`. True
    /// when that is news: none was seen in the last [`Self::HOLD_MS`].
    pub fn observe(&self, unaccounted: u32, now_ms: u64) -> bool {
        if unaccounted == 0 {
            return false;
        }
        let before = self.last_seen_ms.swap(now_ms.max(1), Ordering::Relaxed);
        before == 0 || now_ms.saturating_sub(before) >= Self::HOLD_MS
    }

    /// Were unaccounted requests seen in the last [`Self::HOLD_MS`] before `now_ms`?
    pub fn seen(&self, now_ms: u64) -> bool {
        let at = self.last_seen_ms.load(Ordering::Relaxed);
        at != 0 && now_ms.saturating_sub(at) < Self::HOLD_MS
    }
}

/// One worker's load reports against this router's requests there.
///
/// The engine's count (`running + waiting`) is of a scrape (once a second)
/// that the sidecar resends with every push (every 100 ms) until the next.
/// The router can account for its own requests in flight there, its
/// replicas', and its own that ended since the scrape. It does not know
/// when the scrape was, only when it first saw these figures: at most
/// [`Self::FIRST_SEEN_SLACK_MS`] after the scrape, unless the figures did
/// not change from one scrape to the next, and then earlier still, which
/// only counts more requests as possibly ended. A report it cannot judge
/// (figures first seen longer ago than the ends it remembers) it leaves.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReportWatch {
    ends: RecentEnds,
    /// The last figures reported (running, waiting, KV usage bits), and when
    /// they were first seen.
    last: Option<((u32, u32, u64), u64)>,
}

impl ReportWatch {
    /// Between a scrape and the first push that carries it: the sidecar's
    /// 100 ms push interval, the push itself, and room for a busy machine.
    pub const FIRST_SEEN_SLACK_MS: u64 = 1_000;

    /// One of this router's requests there ended at `now_ms`.
    pub fn ended(&mut self, now_ms: u64) {
        self.ends.record(now_ms);
    }

    /// A report of `running`, `waiting` and `kv_usage` at `now_ms`, while
    /// this router and the replicas it hears have `routed_inflight` requests
    /// there: how many of the engine's requests are someone else's.
    pub fn report(&mut self, running: u32, waiting: u32, kv_usage: f64, routed_inflight: u32, now_ms: u64) -> u32 {
        let figures = (running, waiting, kv_usage.to_bits());
        let first_seen = match self.last {
            Some((f, at)) if f == figures => at,
            _ => now_ms,
        };
        self.last = Some((figures, first_seen));
        let window = now_ms.saturating_sub(first_seen) + Self::FIRST_SEEN_SLACK_MS;
        if window > RecentEnds::SPAN_MS {
            return 0;
        }
        let accounted = u64::from(routed_inflight).saturating_add(self.ends.since(now_ms, window));
        u64::from(running.saturating_add(waiting)).saturating_sub(accounted).try_into().unwrap_or(u32::MAX)
    }
}

/// A worker's requests that ended lately, in [`RecentEnds::BUCKET_MS`]
/// buckets over [`RecentEnds::SPAN_MS`]; [`RecentEnds::since`] may count up
/// to one bucket more than asked, never less.
#[derive(Clone, Copy, Debug, Default)]
struct RecentEnds {
    /// (bucket number, requests ended in it), by bucket number modulo the length.
    buckets: [(u64, u32); RecentEnds::BUCKETS],
}

impl RecentEnds {
    const BUCKET_MS: u64 = 250;
    /// The longest window [`Self::since`] answers for.
    const SPAN_MS: u64 = 3_000;
    const BUCKETS: usize = (Self::SPAN_MS / Self::BUCKET_MS) as usize + 2;

    /// A request ended at `now_ms`.
    fn record(&mut self, now_ms: u64) {
        let n = now_ms / Self::BUCKET_MS;
        let b = &mut self.buckets[(n % Self::BUCKETS as u64) as usize];
        *b = if b.0 == n { (n, b.1.saturating_add(1)) } else { (n, 1) };
    }

    /// Requests that ended in the `window_ms` (at most [`Self::SPAN_MS`])
    /// before `now_ms`.
    fn since(&self, now_ms: u64, window_ms: u64) -> u64 {
        let now = now_ms / Self::BUCKET_MS;
        let first = now_ms.saturating_sub(window_ms) / Self::BUCKET_MS;
        self.buckets.iter().filter(|(n, _)| (first..=now).contains(n)).map(|&(_, c)| u64::from(c)).sum()
    }
}

/// A worker's recent request rate: a count that decays exponentially with a
/// time constant of [`ArrivalRate::TAU_MS`], read and updated at times the
/// caller gives (wall-clock ms in the router, virtual ms in the lab).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ArrivalRate {
    per_s: f64,
    at_ms: u64,
}

impl ArrivalRate {
    pub const TAU_MS: f64 = 2_000.0;

    /// Requests per second as of `now_ms`.
    pub fn at(self, now_ms: u64) -> f64 {
        self.per_s * (-(now_ms.saturating_sub(self.at_ms) as f64) / Self::TAU_MS).exp()
    }

    /// One more request sent at `now_ms`.
    pub fn record(&mut self, now_ms: u64) {
        *self = ArrivalRate { per_s: self.at(now_ms) + 1e3 / Self::TAU_MS, at_ms: now_ms.max(self.at_ms) };
    }
}

/// How fast a worker really is: a low quantile of its recent requests'
/// measured time to first token over what the timing model predicted for
/// them at dispatch, counting only requests with nothing known to be queued
/// ahead of them there and a KV cache below the model's stall knee
/// ([`PredictedTtftParams::pace_model_us`]). The model's
/// constants are one GPU's; a slower GPU, a throttled or shared node, or an
/// engine running a larger model shows up as a pace above the other
/// workers', and [`PredictedTtft`] scales that worker's predictions by it.
/// A low quantile, not a mean: what the router cannot see (another
/// replica's prefill running there, a step already under way when the
/// request arrives) only ever adds time, so the fastest tenth of the
/// samples is the worker's speed and the rest is load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    ratios: [f32; Pace::WINDOW],
    len: usize,
    next: usize,
    quantile: Option<f64>,
}

impl Default for Pace {
    fn default() -> Self {
        Pace { ratios: [0.0; Pace::WINDOW], len: 0, next: 0, quantile: None }
    }
}

impl Pace {
    /// Samples kept.
    pub const WINDOW: usize = 32;
    /// Samples before the pace is trusted.
    pub const MIN_SAMPLES: usize = 8;
    /// The quantile of the kept ratios taken as the pace (with 32 kept, the
    /// 4th smallest: one lucky sample, such as a hit the index did not
    /// know of, does not set it, and a worker that recovers is fast again
    /// after 4 samples).
    pub const QUANTILE: f64 = 0.1;

    /// A first token came `measured_us` after dispatch; the model predicted
    /// `predicted_us`. Non-finite or non-positive figures are ignored.
    pub fn record(&mut self, measured_us: f64, predicted_us: f64) {
        if !(measured_us.is_finite() && predicted_us.is_finite() && measured_us >= 0.0 && predicted_us > 0.0) {
            return;
        }
        self.ratios[self.next] = (measured_us / predicted_us) as f32;
        self.next = (self.next + 1) % Self::WINDOW;
        self.len = (self.len + 1).min(Self::WINDOW);
        if self.len >= Self::MIN_SAMPLES {
            let mut kept = self.ratios;
            let kept = &mut kept[..self.len];
            let at = ((self.len - 1) as f64 * Self::QUANTILE).round() as usize;
            let (_, q, _) = kept.select_nth_unstable_by(at, f32::total_cmp);
            self.quantile = Some(f64::from(*q));
        }
    }

    /// Measured over predicted, once there are enough samples.
    pub fn get(&self) -> Option<f64> {
        self.quantile
    }
}

impl LoadView {
    /// Requests on the worker: the engine's own count when the sidecar reports
    /// one (it covers other routers), never less than what this router knows.
    pub fn requests(&self) -> u64 {
        u64::from(self.routed_inflight().max(self.running.saturating_add(self.waiting)))
    }

    /// Requests that this router and the replicas reporting to it have in
    /// flight there.
    pub fn routed_inflight(&self) -> u32 {
        self.inflight.saturating_add(self.replica_inflight)
    }

    /// The engine's waiting requests that no router accounts for in its
    /// pending prefill: those of replicas that do not report here, and traffic
    /// that bypasses the routers. The engine's count includes every
    /// router's requests, so each in flight that a router reports is taken
    /// off (running ones too: the count cannot tell them apart).
    pub fn foreign_waiting(&self) -> u32 {
        self.waiting.saturating_sub(self.routed_inflight())
    }
}

/// One worker a request could go to (healthy, serving the requested model).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Candidate {
    #[serde(skip)]
    pub slot: Slot,
    /// Leading blocks of the request the worker holds (index match depth).
    pub matched_blocks: usize,
    /// What this router knows of the deepest matched block there.
    pub matched_kind: MatchKind,
    pub load: LoadView,
    /// Stable per-worker hash, for rendezvous placement; equal on every router.
    #[serde(skip)]
    pub id_hash: u64,
}

/// Everything a policy may look at.
#[derive(Clone, Copy, Debug)]
pub struct RouteView<'a> {
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub keys: &'a [BlockKey],
    /// A hash of the prompt's first tokens (the paper's and consistent
    /// hashing's request identity), computed even when there is no full block.
    pub head_hash: u64,
    pub candidates: &'a [Candidate],
    /// Mean prompt tokens of recent requests, to turn request counts into tokens.
    pub mean_prompt_tokens: f64,
    /// Mean tokens recent requests left to prefill where they were sent (their
    /// uncached part): what a queued request of another router costs there.
    pub mean_uncached_tokens: f64,
    /// The request's `prefix_len` (the paper's hint), in tokens.
    pub prefix_hint: Option<usize>,
    /// An explanation (`/debug/route`), not a decision: a policy must not
    /// advance its own state (round-robin's turn), so explaining a request
    /// never changes where the next one goes.
    pub dry_run: bool,
    /// This router is, as far as it can tell, the only one sending requests
    /// to these workers: it hears from no other replica, and no engine has
    /// lately reported requests it cannot account for
    /// ([`ForeignTraffic`]). Its figures are then current as it routes, and
    /// a policy may break near-ties by them rather than by a hash that
    /// keeps replicas with lagging views from herding onto one worker.
    pub sole_router: bool,
    /// Every router sending to these workers is counted in the candidates'
    /// loads, as far as this one can tell: it is the sole router, or other
    /// replicas report their requests to it (`crate::replicas`). A
    /// replica that hears none, seeing foreign traffic, is not.
    pub routers_counted: bool,
}

impl RouteView<'_> {
    pub fn uncached_tokens(&self, c: &Candidate) -> u64 {
        (self.prompt_tokens.saturating_sub(c.matched_blocks * self.block_size)) as u64
    }

    /// Index of the least-loaded candidate; ties go to the higher rendezvous
    /// score so that independent routers break them the same way.
    pub fn least_loaded(&self, among: impl Iterator<Item = usize>) -> Option<usize> {
        among.min_by_key(|&i| {
            let c = &self.candidates[i];
            (c.load.requests(), c.load.pending_prefill_tokens, std::cmp::Reverse(rendezvous(self.head_hash, c.id_hash)))
        })
    }
}

/// Why a worker was chosen; a bounded set, used as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The cheapest candidate by cached prefix and load.
    BestCost,
    /// No candidate holds any block: rendezvous placement on the first key.
    ColdPlacement,
    /// The load across workers is too uneven: least loaded, cache ignored.
    Imbalanced,
    /// Too short for one block: least loaded.
    NoFullBlock,
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
    ConsistentHash,
    /// Sticky policy: the least-loaded holder of the request's prefix.
    StickyHolder,
    /// Sticky policy: nobody holds the prefix; least loaded, recorded.
    StickyMiss,
    /// Threshold policy: the best match clears the threshold.
    ThresholdMatch,
    /// Threshold policy: no match clears it; least loaded.
    BelowThreshold,
    /// A session pinned the request to this worker.
    Session,
    /// An idle worker took the request from a busy holder (`predicted_ttft`).
    IdlePull,
    /// A worker with no prefill queued took a follower of a new prefix
    /// from the worker still prefilling it (`predicted_ttft`).
    BurstSpread,
    /// A worker with never-used KV blocks took a new branch of a prefix
    /// from a holder whose cache is full (`predicted_ttft`).
    CacheRoom,
    /// A holder of the hot prefix carrying fewer than half the chosen
    /// worker's requests took the request (`predicted_ttft`).
    LightPull,
}

impl Reason {
    /// Every reason, for metric series that exist before the first decision.
    pub const ALL: [Reason; 17] = [
        Reason::BestCost,
        Reason::ColdPlacement,
        Reason::Imbalanced,
        Reason::NoFullBlock,
        Reason::RoundRobin,
        Reason::LeastLoaded,
        Reason::PowerOfTwo,
        Reason::ConsistentHash,
        Reason::StickyHolder,
        Reason::StickyMiss,
        Reason::ThresholdMatch,
        Reason::BelowThreshold,
        Reason::Session,
        Reason::IdlePull,
        Reason::BurstSpread,
        Reason::CacheRoom,
        Reason::LightPull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BestCost => "best_cost",
            Reason::ColdPlacement => "cold_placement",
            Reason::Imbalanced => "imbalanced",
            Reason::NoFullBlock => "no_full_block",
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoaded => "least_loaded",
            Reason::PowerOfTwo => "power_of_two",
            Reason::ConsistentHash => "consistent_hash",
            Reason::StickyHolder => "sticky_holder",
            Reason::StickyMiss => "sticky_miss",
            Reason::ThresholdMatch => "threshold_match",
            Reason::BelowThreshold => "below_threshold",
            Reason::Session => "session",
            Reason::IdlePull => "idle_pull",
            Reason::BurstSpread => "burst_spread",
            Reason::CacheRoom => "cache_room",
            Reason::LightPull => "light_pull",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy's answer: candidates in order of preference (the first is the
/// choice, the rest are where a failed attempt is retried), with the reason
/// and, for `/debug/route`, each candidate's cost where the policy has one.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub ranked: Vec<usize>,
    pub reason: Reason,
    pub costs: Vec<Option<f64>>,
}

impl Decision {
    pub fn chosen(&self) -> Option<usize> {
        self.ranked.first().copied()
    }

    /// `first`, then every other candidate by load.
    pub fn with_fallbacks(view: &RouteView<'_>, first: usize, reason: Reason) -> Decision {
        let mut rest: Vec<usize> = (0..view.candidates.len()).filter(|&i| i != first).collect();
        rest.sort_by_key(|&i| (view.candidates[i].load.requests(), view.candidates[i].load.pending_prefill_tokens));
        let mut ranked = vec![first];
        ranked.extend(rest);
        Decision { ranked, reason, costs: vec![None; view.candidates.len()] }
    }
}

pub trait Policy: Send + Sync + fmt::Debug {
    fn name(&self) -> &'static str;
    /// Called with at least one candidate.
    fn choose(&self, view: &RouteView<'_>) -> Decision;
    /// The timing model this policy predicts with, if any: what a worker's
    /// [`Pace`] is measured against.
    fn timing_model(&self) -> Option<&PredictedTtftParams> {
        None
    }
}

/// The policy names `--policy` accepts.
pub const POLICY_NAMES: &[&str] = &[
    "cache_aware",
    "round_robin",
    "least_loaded",
    "power_of_two",
    "consistent_hash",
    "sticky_least_loaded",
    "prefix_threshold",
    "predicted_ttft",
    "dynamo_kv",
    "llmd_weighted",
    "preble",
];

/// Rendezvous (highest-random-weight) score of a worker for a request: equal
/// on every router replica, so they place a cold prefix on the same worker
/// without talking to each other.
pub fn rendezvous(request_hash: u64, worker_hash: u64) -> u64 {
    splitmix64(request_hash ^ splitmix64(worker_hash))
}

/// SplitMix64's output for state `x`: its increment, then its finalizer.
fn splitmix64(x: u64) -> u64 {
    kvroute_shared::hash::finalize(x.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// Bounded-load rendezvous: the highest-scoring candidate whose load is below
/// `factor` × the mean (+1, so an idle cluster accepts anyone) plus `slack`
/// requests. With `factor` > 1 a hot prefix spills to its second choice
/// instead of piling up; `slack` keeps a small burst together where the
/// relative bound alone (1 request at an idle start) would scatter it.
pub fn bounded_rendezvous(
    view: &RouteView<'_>,
    request_hash: u64,
    among: &[usize],
    factor: f64,
    slack: u64,
) -> Option<usize> {
    if among.is_empty() {
        return None;
    }
    let total: u64 = among.iter().map(|&i| view.candidates[i].load.requests()).sum();
    let bound = (factor * (total as f64 + 1.0) / among.len() as f64).ceil() as u64 + slack;
    let by_score = |&i: &usize| rendezvous(request_hash, view.candidates[i].id_hash);
    among
        .iter()
        .copied()
        .filter(|&i| view.candidates[i].load.requests() < bound.max(1))
        .max_by_key(by_score)
        .or_else(|| view.least_loaded(among.iter().copied()))
}

#[cfg(test)]
pub(crate) mod testkit {
    use super::*;

    /// A candidate with `matched` blocks and `inflight` requests.
    pub fn cand(slot: u16, matched: usize, inflight: u32) -> Candidate {
        Candidate {
            slot: Slot(slot),
            matched_blocks: matched,
            matched_kind: Default::default(),
            load: LoadView { inflight, pending_prefill_tokens: u64::from(inflight) * 100, ..Default::default() },
            id_hash: splitmix64(u64::from(slot) + 1),
        }
    }

    pub fn view<'a>(keys: &'a [BlockKey], candidates: &'a [Candidate]) -> RouteView<'a> {
        RouteView {
            prompt_tokens: keys.len() * 16 + 5,
            block_size: 16,
            keys,
            head_hash: keys.first().map_or(7, |k| k.0),
            candidates,
            mean_prompt_tokens: 1000.0,
            mean_uncached_tokens: 1000.0,
            prefix_hint: None,
            dry_run: false,
            sole_router: false,
            routers_counted: false,
        }
    }

    pub fn keys(n: u64) -> Vec<BlockKey> {
        (1..=n).map(BlockKey).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{ArrivalRate, ForeignTraffic, Pace, RecentEnds, ReportWatch};

    #[test]
    fn the_pace_is_a_low_quantile_of_measured_over_modelled_first_tokens() {
        let mut p = Pace::default();
        for _ in 0..Pace::MIN_SAMPLES - 1 {
            p.record(2_000.0, 1_000.0);
        }
        assert_eq!(p.get(), None, "too few samples");
        p.record(2_000.0, 1_000.0);
        assert_eq!(p.get(), Some(2.0));
        // Interference only adds time: a minority of slow samples (another
        // replica's prefill ahead) leaves the pace where the worker's speed is.
        for i in 0..Pace::WINDOW {
            p.record(if i % 3 == 0 { 9_000.0 } else { 2_000.0 }, 1_000.0);
        }
        assert_eq!(p.get(), Some(2.0));
        // The window moves: the worker got faster.
        for _ in 0..Pace::WINDOW {
            p.record(1_000.0, 1_000.0);
        }
        assert_eq!(p.get(), Some(1.0));
        // Nonsense is ignored.
        for (m, e) in [(f64::NAN, 1.0), (1.0, 0.0), (-1.0, 1.0), (f64::INFINITY, 1.0), (1.0, f64::NAN)] {
            p.record(m, e);
        }
        assert_eq!(p.get(), Some(1.0));
    }

    #[test]
    fn the_arrival_rate_counts_requests_over_its_time_constant_and_decays() {
        let mut r = ArrivalRate::default();
        assert_eq!(r.at(0), 0.0);
        for _ in 0..4 {
            r.record(1_000);
        }
        // 4 requests over a 2 s time constant: 2 per second, then e^-1 of it.
        assert!((r.at(1_000) - 2.0).abs() < 1e-9);
        assert!((r.at(3_000) - 2.0 / std::f64::consts::E).abs() < 1e-9);
        // A clock that steps back reads the latest value, never more.
        assert!((r.at(500) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn recent_ends_count_the_window_and_forget_what_is_older() {
        let mut e = RecentEnds::default();
        for t in [10_000, 10_100, 11_900, 12_400] {
            e.record(t);
        }
        // 10.1–12.1 s: the window starts in the bucket of 10.0–10.25 s,
        // which counts whole (the end at 10.0 s too: never less).
        assert_eq!(e.since(12_100, 2_000), 3);
        // 10.5–12.5 s, 12.0–12.5 s.
        assert_eq!(e.since(12_500, 2_000), 2);
        assert_eq!(e.since(12_500, 500), 1);
        // Much later, none; and a bucket reused for a later time starts over.
        assert_eq!(e.since(30_000, 2_000), 0);
        e.record(30_000);
        assert_eq!(e.since(30_000, 2_000), 1);
    }

    #[test]
    fn a_report_counts_what_the_router_cannot_account_for() {
        let mut w = ReportWatch::default();
        // 5 on the engine: 3 in flight here or at a replica, 1 ended just now.
        w.ended(10_000);
        assert_eq!(w.report(4, 1, 0.5, 3, 10_050), 1);
        assert_eq!(w.report(3, 1, 0.4, 3, 10_150), 0);
        // The same figures pushed again for a while: the scrape may be older,
        // so ends before it count too; past what the ends span, no verdict.
        w.ended(10_600);
        assert_eq!(w.report(3, 1, 0.4, 1, 10_900), 1);
        assert_eq!(w.report(3, 1, 0.4, 0, 12_100), 2);
        assert_eq!(w.report(3, 1, 0.4, 0, 12_500), 0, "first seen 2.35 s ago: not judged");
        // New figures are judged again, against the ends of the last second.
        assert_eq!(w.report(5, 0, 0.4, 0, 12_600), 5);
    }

    #[test]
    fn foreign_traffic_is_news_once_and_held_for_a_while() {
        let f = ForeignTraffic::default();
        assert!(!f.seen(1_000));
        assert!(!f.observe(0, 1_000), "nothing unaccounted is no news");
        assert!(!f.seen(1_000));
        assert!(f.observe(2, 1_000), "the first sighting is news");
        assert!(!f.observe(1, 2_000), "a second within the hold is not");
        assert!(f.seen(2_000 + ForeignTraffic::HOLD_MS - 1));
        assert!(!f.seen(2_000 + ForeignTraffic::HOLD_MS));
        assert!(f.observe(1, 2_000 + ForeignTraffic::HOLD_MS), "news again after the hold");
    }
}
