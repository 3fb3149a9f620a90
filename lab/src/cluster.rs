//! The whole cluster in virtual time: workload arrivals reach router replicas,
//! routers choose engines, engines step, sidecars carry KV events and load
//! back to routers in batches, with losses. One seed, one history.

use std::collections::HashSet;
use std::time::Instant;

use kvroute_router::policy::Policy;
use kvroute_shared::{BlockKey, KeyRoot, block_keys};
use kvroute_sim::config::Config as SimConfig;
use serde::Serialize;

use crate::engine::{LabEngine, Progress};
use crate::measure::{RequestRecord, StepModel, Summary, summarize};
use crate::prompt::{Rng, splitmix64};
use crate::router::{LabRouter, Routed};
use crate::sidecar::Sidecar;
use crate::time::{Event, Micros, Queue};
use crate::workload::{RequestSpec, Workload};

/// How sidecars reach routers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SidecarModel {
    /// Fast-path batches (`/internal/eviction`), 100 ms in kvroute.
    pub batch_every: Micros,
    /// Full syncs, 5 s.
    pub sync_every: Micros,
    /// Engine metrics scrape (running / waiting / KV usage), 1 s.
    pub load_every: Micros,
    /// Fraction of pushes (batches and syncs, per router) lost.
    pub loss: f64,
}

impl Default for SidecarModel {
    fn default() -> Self {
        SidecarModel {
            batch_every: Micros::from_ms(100),
            sync_every: Micros::from_ms(5_000),
            load_every: Micros::from_ms(1_000),
            loss: 0.0,
        }
    }
}

/// The request path's own latency ahead of the engine: client to router to
/// engine over HTTP, the prompt's token ids parsed and its blocks hashed on
/// the way. The lab leaves it out (0) by default: next to the modelled
/// engine's times it is small (a few µs against 70 µs of prefill per
/// token), but `kvroute-bench` runs engines 20× faster than the model and
/// this path at its real speed, so [`crate::crosscheck`] can put it in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PathModel {
    pub fixed_us: u64,
    pub ns_per_token: u64,
}

impl PathModel {
    pub fn delay(&self, prompt_tokens: usize) -> Micros {
        Micros(self.fixed_us + self.ns_per_token * prompt_tokens as u64 / 1_000)
    }
}

/// A mixed or throttled fleet: the first `share` of the engines (rounded)
/// take `factor` × the timing model's time for every step (an older GPU, a
/// node shared with other work). None by default. Load levels count the
/// slower engines' capacity; the queueing figure (TTFT minus the request's
/// own prefill on an idle engine of the model's speed) counts a slow
/// engine's extra prefill time as queueing.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SlowWorkers {
    pub share: f64,
    pub factor: f64,
}

impl Default for SlowWorkers {
    fn default() -> Self {
        SlowWorkers { share: 0.0, factor: 1.0 }
    }
}

impl SlowWorkers {
    pub fn count(&self, workers: usize) -> usize {
        ((self.share.clamp(0.0, 1.0) * workers as f64).round() as usize).min(workers)
    }
}

/// The engines' costs where they differ from kvroute-sim's default (the
/// numbers `predicted_ttft`'s timing model is written with): an engine the
/// router's model does not describe, a bigger model, another GPU, a smaller
/// chunked-prefill budget. Each `None` keeps the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct EngineCosts {
    pub prefill_us_per_token: Option<f64>,
    pub step_overhead_us: Option<f64>,
    pub decode_us_per_seq: Option<f64>,
    pub max_batched_tokens: Option<usize>,
}

impl EngineCosts {
    pub fn apply(&self, c: &mut SimConfig) {
        if let Some(v) = self.prefill_us_per_token {
            c.cost.prefill_us_per_token = v;
        }
        if let Some(v) = self.step_overhead_us {
            c.cost.overhead_us = v;
        }
        if let Some(v) = self.decode_us_per_seq {
            c.cost.decode_us_per_seq = v;
        }
        if let Some(v) = self.max_batched_tokens {
            c.max_num_batched_tokens = v;
        }
    }
}

/// Everything that defines a run besides the workload.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub workers: usize,
    pub routers: usize,
    pub engine: SimConfig,
    pub sidecar: SidecarModel,
    pub seed: u64,
    /// The router's `head_tokens` (64) and `speculative_ttl` (10 s).
    pub head_tokens: usize,
    pub speculative_ttl_ms: u64,
    /// Zero unless set: requests reach their engine as they are routed.
    pub path: PathModel,
    /// Per request (by index), a measured path delay that replaces `path`'s
    /// model for that request (`crosscheck --path-from`).
    pub measured_path: Option<std::sync::Arc<[Micros]>>,
    /// Request `i` goes to router replica `i mod routers`, as the bench's
    /// clients alternate; otherwise (the default) to a seeded random one,
    /// like clients behind a load balancer.
    pub alternate_routers: bool,
    pub slow: SlowWorkers,
    /// What-if, not a deployable mode: every router replica knows every
    /// replica's pending prefill on each worker (as if they shared it, or
    /// the engine reported its queued prefill tokens), instead of its own
    /// plus the engine's waiting count at the mean uncached size. Measures
    /// what the information the replicas lack costs a policy.
    pub shared_pending: bool,
    /// The router replicas' exchange (`kvroute-router --replica`,
    /// `kvroute_router::replicas`): every period each replica tells the
    /// others its pending prefill tokens and in-flight requests per worker,
    /// and its recent requests' sampled prefixes; a replica counts what it
    /// last heard on top of its own (the others' in-flight requests are
    /// then not counted again in the engine's waiting count) and follows a
    /// prefix another replica just sent. Off (`None`) unless asked for, so
    /// earlier figures and the CI gate, which modelled replicas without
    /// it, stay comparable.
    pub peer_exchange: Option<Micros>,
    /// With [`Self::peer_exchange`]: a replica that routes a request tells
    /// the others its new per-worker figures (not its prefixes) this long
    /// after its last report at the soonest, as `kvroute-router`'s
    /// `replica_news_interval` (10 ms) does between full reports; delivered
    /// 1 ms after it is made (a POST on a LAN). `None`: full reports only.
    pub peer_news: Option<Micros>,
}

impl Scenario {
    /// kvroute-sim's default engine (an 8B model on one H100), with room for
    /// the trace's longest prompts.
    pub fn new(workers: usize, routers: usize, seed: u64) -> Scenario {
        let mut engine = SimConfig::for_model("lab-model");
        engine.max_model_len = 262_144;
        Scenario {
            workers,
            routers,
            engine,
            sidecar: SidecarModel::default(),
            seed,
            head_tokens: 64,
            speculative_ttl_ms: 10_000,
            path: PathModel::default(),
            measured_path: None,
            alternate_routers: false,
            slow: SlowWorkers::default(),
            shared_pending: false,
            peer_exchange: None,
            peer_news: None,
        }
    }

    /// Engine `e`'s configuration: the scenario's, slowed for a slow worker.
    pub fn engine_config(&self, e: usize) -> SimConfig {
        let mut c = self.engine.clone();
        if e < self.slow.count(self.workers) {
            let f = self.slow.factor;
            c.cost.overhead_us *= f;
            c.cost.prefill_us_per_token *= f;
            c.cost.decode_us_per_seq *= f;
        }
        c
    }

    /// The cluster's throughput in engines of the model's speed.
    pub fn capacity(&self) -> f64 {
        let slow = self.slow.count(self.workers);
        (self.workers - slow) as f64 + slow as f64 / self.slow.factor
    }

    pub fn kv_tokens(&self) -> u64 {
        self.workers as u64 * u64::from(self.engine.num_blocks - 1) * self.engine.block_size.get() as u64
    }

    pub fn step_model(&self) -> StepModel {
        StepModel {
            overhead_us: self.engine.cost.overhead_us,
            prefill_us_per_token: self.engine.cost.prefill_us_per_token,
            max_batched_tokens: self.engine.max_num_batched_tokens,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub policy: String,
    pub summary: Summary,
    /// Decisions by reason, summed over routers.
    pub reasons: std::collections::BTreeMap<&'static str, u64>,
    /// Hit rate as vLLM's counters give it (hits over queries, summed over
    /// engines), which is what `kvroute-bench` reads off live engines; it
    /// counts a preempted request's second lookup again, where
    /// `summary.hit_rate` counts each request once.
    pub engine_hit_rate: f64,
    /// Load reports, summed over routers, whose engine counted requests that
    /// router could not account for: other replicas' when they do not
    /// exchange (kvroute_router::policy::ForeignTraffic).
    pub foreign_reports: u64,
    #[serde(skip)]
    pub records: Vec<RequestRecord>,
    /// Wall-clock seconds the run took (never part of a comparison).
    pub wall_s: f64,
}

/// Runs `workload` on `scenario` with a fresh policy per router from `policy`.
pub fn run(scenario: &Scenario, workload: &Workload, policy: &dyn Fn() -> Box<dyn Policy>) -> RunResult {
    let wall = Instant::now();
    let n = scenario.workers;
    let bs = scenario.engine.block_size;
    let base = Instant::now();
    let mut engines: Vec<LabEngine> = (0..n).map(|e| LabEngine::new(&scenario.engine_config(e), base)).collect();
    let mut sidecars: Vec<Sidecar> =
        (0..n).map(|_| Sidecar::new(scenario.engine.model.as_str(), scenario.routers)).collect();
    let mut routers: Vec<LabRouter> =
        (0..scenario.routers).map(|_| LabRouter::new(n, policy(), bs.get(), scenario.speculative_ttl_ms)).collect();
    for r in &mut routers {
        r.tells_peers = scenario.peer_exchange.is_some();
        r.capacity_blocks = Some(u64::from(scenario.engine.num_blocks));
    }
    let policy_name = routers[0].policy_name().to_owned();
    let root = KeyRoot::new(scenario.engine.model.as_str(), None);
    let mut loss_rng = Rng::new(scenario.seed ^ 0x1055);

    let reqs = &workload.requests;
    let mut records: Vec<RequestRecord> = vec![RequestRecord::default(); reqs.len()];
    let mut routed: Vec<Option<(usize, Routed)>> = vec![None; reqs.len()];
    let mut seen: HashSet<BlockKey> = HashSet::new();
    let (next_arrival, follower) = arrival_order(reqs);
    let mut q = Queue::default();
    if !reqs.is_empty() {
        q.push(reqs[0].at, Event::Arrival(0));
    }
    // Periodic work is staggered so sidecars do not all push at one instant.
    let sc = scenario.sidecar;
    let stagger = |every: Micros, i: usize, of: usize| Micros(every.0 * i as u64 / of.max(1) as u64);
    for e in 0..n {
        q.push(stagger(sc.batch_every, e, n), Event::SidecarFlush(e as u32));
        q.push(stagger(sc.sync_every, e, n), Event::SidecarSync(e as u32));
        q.push(stagger(sc.load_every, e, n), Event::LoadScrape(e as u32));
    }
    for r in 0..scenario.routers {
        q.push(stagger(Micros::from_ms(1_000), r, scenario.routers), Event::Housekeeping(r as u32));
        if let Some(every) = scenario.peer_exchange {
            q.push(stagger(every, r, scenario.routers), Event::PeerExchange(r as u32));
        }
    }

    let (mut progress, mut events) = (Vec::new(), Vec::new());
    let mut finished = 0usize;
    // Per router: its last report to the others, and whether news is due.
    let news = scenario.peer_exchange.and(scenario.peer_news);
    let mut last_report = vec![Micros::ZERO; scenario.routers];
    let mut news_due = vec![false; scenario.routers];
    while finished < reqs.len() {
        let Some((now, ev)) = q.pop() else { break };
        match ev {
            Event::Arrival(i) => {
                let i = i as usize;
                if let Some(next) = next_arrival[i] {
                    q.push(reqs[next as usize].at, Event::Arrival(next));
                }
                let spec = &reqs[i];
                let tokens = spec.prompt.tokens();
                let keys = block_keys(root, &tokens, bs);
                let head = &tokens[..tokens.len().min(scenario.head_tokens)];
                let head_hash = BlockKey::chain(root.0, head).0;
                // The infinite cache: every block any earlier prompt had,
                // capped as vLLM caps a hit (the last token is computed).
                let hittable = tokens.len().saturating_sub(1) / bs.get();
                let ceiling = keys[..hittable.min(keys.len())].iter().take_while(|k| seen.contains(k)).count();
                seen.extend(keys.iter().copied());
                let r = if scenario.alternate_routers {
                    i % scenario.routers
                } else {
                    (splitmix64(scenario.seed ^ i as u64) % scenario.routers as u64) as usize
                };
                let everyone = scenario.shared_pending.then(|| {
                    let mut sum = vec![0u64; n];
                    for router in &routers {
                        sum.iter_mut().zip(router.pending()).for_each(|(s, p)| *s += p);
                    }
                    sum
                });
                let decision = routers[r].route(tokens.len(), &keys, head_hash, now, everyone.as_deref());
                records[i] = RequestRecord {
                    arrival: now,
                    prompt_tokens: tokens.len() as u32,
                    ceiling_tokens: (ceiling * bs.get()) as u32,
                    worker: decision.worker as u32,
                    router: r as u32,
                    reason: Some(decision.reason),
                    matched_tokens: (decision.matched_blocks * bs.get()) as u32,
                    ..Default::default()
                };
                routed[i] = Some((r, decision));
                if let Some(gap) = news
                    && !news_due[r]
                {
                    news_due[r] = true;
                    q.push((now + Micros::from_ms(1)).max(last_report[r] + gap), Event::PeerNews(r as u32));
                }
                let delay = match scenario.measured_path.as_deref().and_then(|m| m.get(i)) {
                    Some(&measured) => measured,
                    None => scenario.path.delay(tokens.len()),
                };
                if delay > Micros::ZERO {
                    q.push(now + delay, Event::Submit(i as u32));
                } else if let Some(end) = engines[decision.worker].submit(i as u32, tokens, spec.max_tokens, now) {
                    q.push(end, Event::StepEnd(decision.worker as u32));
                }
            }
            Event::Submit(i) => {
                let (i, spec) = (i as usize, &reqs[i as usize]);
                let Some((_, d)) = routed[i] else { continue };
                if let Some(end) = engines[d.worker].submit(i as u32, spec.prompt.tokens(), spec.max_tokens, now) {
                    q.push(end, Event::StepEnd(d.worker as u32));
                }
            }
            Event::StepEnd(e) => {
                let e = e as usize;
                let next = engines[e].end_step(now, &mut progress, &mut events);
                sidecars[e].ingest(&events);
                events.clear();
                for p in progress.drain(..) {
                    match p {
                        Progress::FirstToken { req } => {
                            records[req as usize].first_token = Some(now);
                            if let Some((r, d)) = &routed[req as usize] {
                                routers[*r].first_token(d, now);
                            }
                        }
                        Progress::Done { req, outcome } => {
                            let rec = &mut records[req as usize];
                            rec.done = Some(now);
                            rec.cached_tokens = outcome.cached_tokens as u32;
                            if let Some((r, d)) = &routed[req as usize] {
                                routers[*r].finished(d, true, now);
                            }
                            next_turn(&mut q, reqs, follower[req as usize], now);
                            finished += 1;
                        }
                        Progress::Rejected { req } => {
                            records[req as usize].rejected = true;
                            if let Some((r, d)) = &routed[req as usize] {
                                routers[*r].finished(d, false, now);
                            }
                            // A user whose turn failed sends the next one anyway.
                            next_turn(&mut q, reqs, follower[req as usize], now);
                            finished += 1;
                        }
                    }
                }
                if let Some(end) = next {
                    q.push(end, Event::StepEnd(e as u32));
                }
            }
            Event::LoadScrape(e) => {
                sidecars[e as usize].scrape(engines[e as usize].load());
                q.push(now + sc.load_every, ev);
            }
            Event::SidecarFlush(e) => {
                let batch = sidecars[e as usize].take_batch();
                for (r, router) in routers.iter_mut().enumerate() {
                    if sc.loss > 0.0 && loss_rng.chance(sc.loss) {
                        sidecars[e as usize].mark_stale(r);
                    } else {
                        router.apply_batch(e as usize, &batch, now);
                    }
                }
                q.push(now + sc.batch_every, ev);
            }
            Event::SidecarSync(e) => {
                let s = &mut sidecars[e as usize];
                for (r, router) in routers.iter_mut().enumerate() {
                    if !s.needs_sync(r) || (sc.loss > 0.0 && loss_rng.chance(sc.loss)) {
                        continue;
                    }
                    router.sync(e as usize, &s.snapshot(), now.as_ms());
                    s.synced(r);
                }
                q.push(now + sc.sync_every, ev);
            }
            Event::Housekeeping(r) => {
                routers[r as usize].housekeeping(now.as_ms());
                q.push(now + Micros::from_ms(1_000), ev);
            }
            Event::PeerExchange(r) | Event::PeerNews(r) => {
                let (r, news) = (r as usize, matches!(ev, Event::PeerNews(_)));
                last_report[r] = now;
                let told = routers[r].own_load(now);
                for (_, other) in routers.iter_mut().enumerate().filter(|(o, _)| *o != r) {
                    if news {
                        other.hear_peer_loads(r, &told);
                    } else {
                        other.hear_peer(r, &told);
                    }
                }
                if news {
                    news_due[r] = false;
                } else if let Some(every) = scenario.peer_exchange {
                    q.push(now + every, ev);
                }
            }
        }
    }

    let prefill: Vec<u64> = engines.iter().map(|e| e.prefill_tokens).collect();
    let preemptions = engines.iter().map(LabEngine::preemptions).sum();
    let (queries, hits) =
        engines.iter().map(LabEngine::prefix_counters).fold((0, 0), |(q, h), (eq, eh)| (q + eq, h + eh));
    let mut reasons = std::collections::BTreeMap::new();
    for r in &routers {
        for (k, v) in &r.reasons {
            *reasons.entry(*k).or_insert(0) += v;
        }
    }
    RunResult {
        policy: policy_name,
        summary: summarize(&records, &prefill, preemptions, scenario.step_model()),
        reasons,
        engine_hit_rate: if queries == 0 { 0.0 } else { hits as f64 / queries as f64 },
        foreign_reports: routers.iter().map(|r| r.foreign_reports).sum(),
        records,
        wall_s: wall.elapsed().as_secs_f64(),
    }
}

/// Closed loop: a request's answer has ended (or failed), so its session's
/// next turn, if any, is sent its think time from `now`.
fn next_turn(q: &mut Queue, reqs: &[RequestSpec], follower: Option<u32>, now: Micros) {
    if let Some(f) = follower {
        q.push(now + reqs[f as usize].turn.map_or(Micros::ZERO, |t| t.think), Event::Arrival(f));
    }
}

/// Which arrival each arrival schedules, and which request waits for each
/// one's answer. Open loop: every request the next, in order. Closed loop:
/// a session's first turn (and every request outside sessions) the next
/// such request; a later turn is sent when its predecessor's answer ends.
fn arrival_order(reqs: &[RequestSpec]) -> (Vec<Option<u32>>, Vec<Option<u32>>) {
    let mut next = vec![None; reqs.len()];
    let mut follower = vec![None; reqs.len()];
    let mut last_open: Option<usize> = None;
    for (i, r) in reqs.iter().enumerate() {
        match r.after {
            Some(prev) => follower[prev as usize] = Some(i as u32),
            None => {
                if let Some(l) = last_open {
                    next[l] = Some(i as u32);
                }
                last_open = Some(i);
            }
        }
    }
    (next, follower)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::factory;
    use crate::prompt::{Prompt, Segment};
    use crate::workload::WorkloadKind;

    #[test]
    fn alternating_clients_send_request_i_to_replica_i_mod_routers() {
        let requests = (0..12)
            .map(|i| RequestSpec::new(Micros::from_ms(i), Prompt(vec![Segment { seed: i, len: 64 }]), 2))
            .collect();
        let w = Workload { kind: WorkloadKind::Chat, requests };
        let policy = factory("round_robin").expect("a known policy");
        let mut s = Scenario::new(2, 3, 1);
        let random: Vec<u32> = run(&s, &w, &policy).records.iter().map(|r| r.router).collect();
        s.alternate_routers = true;
        let alternating: Vec<u32> = run(&s, &w, &policy).records.iter().map(|r| r.router).collect();
        assert_eq!(alternating, (0..12).map(|i| i % 3).collect::<Vec<u32>>());
        assert_ne!(random, alternating, "by default a seeded random replica");
    }

    /// A replica that hears no other finds their requests on the engines
    /// (and stops counting itself the sole router); a router alone accounts
    /// for every request the engines report.
    #[test]
    fn replicas_that_do_not_exchange_see_each_others_requests_on_the_engines() {
        let foreign = |routers: usize| {
            let s = Scenario::new(4, routers, 3);
            let shape = crate::workload::Shape {
                requests: 400,
                seed: 3,
                cluster_kv_tokens: s.kv_tokens(),
                trace_path: crate::workload::default_trace_path(),
                closed_loop: false,
            };
            let w = Workload::generate(WorkloadKind::Chat, &shape).expect("synthetic").at_rate(30.0);
            run(&s, &w, &factory("predicted_ttft").expect("registered")).foreign_reports
        };
        assert_eq!(foreign(1), 0);
        assert!(foreign(3) > 0);
    }

    #[test]
    fn a_request_path_delay_reaches_the_first_token() {
        let request = RequestSpec::new(Micros::ZERO, Prompt(vec![Segment { seed: 1, len: 1_000 }]), 2);
        let w = Workload { kind: WorkloadKind::Chat, requests: vec![request] };
        let policy = factory("round_robin").expect("a known policy");
        let mut s = Scenario::new(2, 1, 1);
        let direct = run(&s, &w, &policy).records[0];
        s.path = PathModel { fixed_us: 1_000, ns_per_token: 500 };
        let delayed = run(&s, &w, &policy).records[0];
        let ttft = |r: RequestRecord| r.first_token.map(|t| t.saturating_sub(r.arrival));
        // 1 ms + 1,000 tokens × 0.5 µs, and nothing else changes.
        assert_eq!(ttft(delayed).map(|t| t.0), ttft(direct).map(|t| t.0 + 1_500));
        assert_eq!(delayed.cached_tokens, direct.cached_tokens);
    }

    #[test]
    fn a_closed_loop_sends_each_turn_its_think_time_after_the_previous_answer() {
        let kind = WorkloadKind::Chat;
        let shape = |closed_loop| crate::workload::Shape {
            requests: 200,
            seed: 5,
            cluster_kv_tokens: 4 * 2_000 * 16,
            trace_path: crate::workload::default_trace_path(),
            closed_loop,
        };
        let policy = factory("predicted_ttft").expect("a known policy");
        let s = Scenario::new(4, 1, 5);
        // Squeezed hard, so answers take longer than many think times.
        let closed = Workload::generate(kind, &shape(true)).unwrap();
        let closed = closed.at_rate(closed.rate() * 20.0);
        let records = run(&s, &closed, &policy).records;
        let mut late = 0;
        for (r, spec) in records.iter().zip(&closed.requests) {
            let (Some(prev), Some(turn)) = (spec.after, spec.turn) else {
                assert_eq!(r.arrival, spec.at, "a session starts when the workload says");
                continue;
            };
            let done = records[prev as usize].done.expect("every request ends");
            assert_eq!(r.arrival, done + turn.think, "turn after the previous answer");
            late += usize::from(r.arrival > spec.at);
        }
        assert!(late > 0, "some answers took longer than instant, so some turns came later than nominal");
        // The same workload in open loop sends turns before their previous answer ends.
        let open = Workload::generate(kind, &shape(false)).unwrap();
        let open = open.at_rate(open.rate() * 20.0);
        let records = run(&s, &open, &policy).records;
        let overtaking = open.requests.iter().enumerate().filter(|(i, spec)| {
            let prev = open.requests[..*i].iter().rposition(|p| {
                matches!((p.turn, spec.turn), (Some(a), Some(b)) if a.session == b.session && a.index + 1 == b.index)
            });
            prev.is_some_and(|p| records[p].done.is_some_and(|d| records[*i].arrival < d))
        });
        assert!(overtaking.count() > 0, "the open loop is what the closed loop fixes");
    }

    #[test]
    fn a_slow_engine_takes_longer_and_the_default_learns_to_send_it_less() {
        let ttft = |r: &RequestRecord| r.first_token.map(|t| t.saturating_sub(r.arrival).0);
        let one = RequestSpec::new(Micros::ZERO, Prompt(vec![Segment { seed: 1, len: 1_000 }]), 2);
        let w = Workload { kind: WorkloadKind::Chat, requests: vec![one] };
        let policy = factory("round_robin").expect("a known policy");
        let mut s = Scenario::new(1, 1, 1);
        let normal = ttft(&run(&s, &w, &policy).records[0]).unwrap();
        s.slow = SlowWorkers { share: 1.0, factor: 3.0 };
        let slow = ttft(&run(&s, &w, &policy).records[0]).unwrap();
        assert!(slow.abs_diff(3 * normal) <= 3, "{slow} µs against 3 × {normal}");

        // Distinct 2,000-token prompts, one every 50 ms, on 4 workers of
        // which the first is 3 × slower: with its pace measured, it gets
        // fewer of them than when every worker counts as the model says.
        let requests = (0..400)
            .map(|i| RequestSpec::new(Micros(i * 50_000), Prompt(vec![Segment { seed: 100 + i, len: 2_000 }]), 16))
            .collect();
        let w = Workload { kind: WorkloadKind::Chat, requests };
        let mut s = Scenario::new(4, 1, 1);
        s.slow = SlowWorkers { share: 0.25, factor: 3.0 };
        let on_slow = |policy: &str| {
            let r = run(&s, &w, &factory(policy).expect("a known policy"));
            r.records.iter().filter(|r| r.worker == 0).count()
        };
        let (measured, modelled) = (on_slow("predicted_ttft"), on_slow("predicted_ttft:pace_weight=0"));
        assert!(measured < modelled, "{measured} requests on the slow worker, {modelled} with its pace ignored");
    }
}
