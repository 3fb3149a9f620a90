//! One router replica: the router's real [`Index`] and a real [`Policy`],
//! with the per-worker figures `routing.rs` puts into each [`Candidate`]:
//! this router's in-flight requests and pending prefill tokens (counted as
//! `proxy.rs`'s in-flight guard counts them) and the engine load the
//! sidecars last reported.
//!
//! One `Index` holds at most `MAX_WORKERS` (128) workers; past that the lab
//! gives each 128 workers an index of their own and concatenates their match
//! depths, which is what raising the bitset's width would do.

use kvroute_router::index::MatchKind;
use kvroute_router::index::{Index, MAX_WORKERS, Slot};
use kvroute_router::policy::{
    ArrivalRate, Candidate, ForeignTraffic, LoadView, Pace, Policy, PredictedTtftParams, Reason, ReportWatch, RouteView,
};
use kvroute_router::replicas::{MAX_HINT_KEYS, PrefixHints, SentPrefix, prefixes, still_reported};
use kvroute_router::workers::id_hash;
use kvroute_shared::{BlockKey, WorkerId};

use crate::engine::EngineLoad;
use crate::sidecar::Batch;
use crate::time::Micros;

/// Where one request went and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routed {
    pub worker: usize,
    pub reason: Reason,
    /// Prompt tokens the router believed uncached there (its pending prefill).
    pub uncached: u64,
    pub matched_blocks: usize,
    /// When it was routed, and the timing model's time to its first token
    /// there: the sample for that worker's [`Pace`].
    pub sent: Micros,
    pub modelled_us: Option<f64>,
    /// Its entry in this replica's reports to the others (`sent_log`).
    pub sent_id: u64,
}

/// What one replica tells the others (`kvroute_router::replicas::ReplicaReport`):
/// per worker its pending prefill tokens and in-flight requests, and its
/// recent requests' sampled prefixes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Told {
    pub pending: Vec<u64>,
    pub inflight: Vec<u32>,
    pub sent: Vec<SentPrefix>,
}

#[derive(Debug)]
pub struct LabRouter {
    shards: Vec<Index>,
    policy: Box<dyn Policy>,
    id_hashes: Vec<u64>,
    inflight: Vec<u32>,
    pending: Vec<u64>,
    rates: Vec<ArrivalRate>,
    paces: Vec<Pace>,
    /// The timing model paces are measured against: the policy's own, as
    /// the router's proxy uses its configured one (the default's for a
    /// policy without one).
    model: PredictedTtftParams,
    reported: Vec<EngineLoad>,
    /// What each other replica last said (`Scenario::peer_exchange`; empty
    /// without it), and the prefix hints its `sent` lists make.
    peers: Vec<Option<Told>>,
    hints: PrefixHints,
    /// This replica's requests as its reports name them: id → (where and
    /// what, virtual ms of its first token).
    sent_log: std::collections::BTreeMap<u64, (SentPrefix, Option<u64>)>,
    next_sent_id: u64,
    /// Keeps `sent_log` (the scenario's replicas exchange reports).
    pub tells_peers: bool,
    /// Each engine's KV blocks (`num_gpu_blocks`), as the router learns
    /// them from its `/metrics`; `None`: unknown.
    pub capacity_blocks: Option<u64>,
    mean_prompt_tokens: f64,
    mean_uncached_tokens: f64,
    block_size: usize,
    speculative_ttl_ms: u64,
    /// Decisions by reason, for the report.
    pub reasons: std::collections::BTreeMap<&'static str, u64>,
    /// Each worker's load reports against this replica's requests there,
    /// and what they counted beyond its and its peers' ([`ForeignTraffic`]).
    watches: Vec<ReportWatch>,
    foreign: ForeignTraffic,
    /// Load reports that counted requests no router this one hears sent.
    pub foreign_reports: u64,
}

impl LabRouter {
    pub fn new(workers: usize, policy: Box<dyn Policy>, block_size: usize, speculative_ttl_ms: u64) -> LabRouter {
        let model = policy.timing_model().copied().unwrap_or_default();
        LabRouter {
            shards: (0..workers.div_ceil(MAX_WORKERS)).map(|_| Index::new()).collect(),
            policy,
            id_hashes: (0..workers).map(|w| id_hash(&WorkerId::new(format!("w{w}")))).collect(),
            inflight: vec![0; workers],
            pending: vec![0; workers],
            rates: vec![ArrivalRate::default(); workers],
            paces: vec![Pace::default(); workers],
            model,
            reported: vec![EngineLoad::default(); workers],
            peers: Vec::new(),
            hints: PrefixHints::default(),
            sent_log: Default::default(),
            next_sent_id: 0,
            tells_peers: false,
            capacity_blocks: None,
            // `AppState`'s starting estimate.
            mean_prompt_tokens: 512.0,
            mean_uncached_tokens: 512.0,
            block_size,
            speculative_ttl_ms,
            reasons: Default::default(),
            watches: vec![ReportWatch::default(); workers],
            foreign: ForeignTraffic::default(),
            foreign_reports: 0,
        }
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    fn shard(&mut self, worker: usize) -> (&mut Index, Slot) {
        (&mut self.shards[worker / MAX_WORKERS], Slot((worker % MAX_WORKERS) as u16))
    }

    /// This replica's pending prefill tokens per worker.
    pub fn pending(&self) -> &[u64] {
        &self.pending
    }

    /// What this replica tells the others at `now`: its own pending prefill
    /// tokens and in-flight requests per worker, and its requests not yet
    /// past their first token or past it less than `SENT_LINGER_MS` ago.
    pub fn own_load(&mut self, now: Micros) -> Told {
        let now_ms = now.as_ms();
        self.sent_log.retain(|_, (_, done)| still_reported(*done, now_ms));
        Told {
            pending: self.pending.clone(),
            inflight: self.inflight.clone(),
            sent: self.sent_log.values().map(|(p, _)| p.clone()).collect(),
        }
    }

    /// Replica `peer` told this one `told`. The hints are rebuilt at once:
    /// the router spaces rebuilds by `MIN_HINTS_REBUILD_GAP` (10 ms), and
    /// the lab's full reports, staggered over the exchange period, come at
    /// least 33 ms apart (3 replicas), so the router would not defer one.
    pub fn hear_peer(&mut self, peer: usize, told: &Told) {
        if self.peers.len() <= peer {
            self.peers.resize(peer + 1, None);
        }
        self.peers[peer] = Some(told.clone());
        self.hints = PrefixHints::build(self.peers.iter().flatten().flat_map(|t| &t.sent), MAX_HINT_KEYS);
    }

    /// Replica `peer` told this one its new per-worker figures between full
    /// reports: its prefixes are as it last said.
    pub fn hear_peer_loads(&mut self, peer: usize, told: &Told) {
        match self.peers.get_mut(peer) {
            Some(Some(last)) => {
                last.pending.clone_from(&told.pending);
                last.inflight.clone_from(&told.inflight);
            }
            _ => self.hear_peer(peer, &Told { sent: Vec::new(), ..told.clone() }),
        }
    }

    /// Routes a request (as `routing::plan` does for a live request), records
    /// it speculatively and counts it in flight. `everyone_pending`
    /// ([`crate::cluster::Scenario::shared_pending`]): every replica's
    /// pending prefill per worker, which then replaces this replica's own
    /// and the engine's waiting count.
    pub fn route(
        &mut self,
        prompt_tokens: usize,
        keys: &[BlockKey],
        head_hash: u64,
        now: Micros,
        everyone_pending: Option<&[u64]>,
    ) -> Routed {
        let now_ms = now.as_ms();
        let mut depth = vec![0usize; self.id_hashes.len()];
        for (s, index) in self.shards.iter().enumerate() {
            for (slot, d) in index.match_depths(keys) {
                depth[s * MAX_WORKERS + slot.0 as usize] = d;
            }
        }
        let mut hinted = vec![0usize; self.id_hashes.len()];
        for (id, d) in self.hints.depths(keys) {
            if let Some(w) = id.as_str().strip_prefix('w').and_then(|n| n.parse::<usize>().ok())
                && w < hinted.len()
            {
                hinted[w] = d;
            }
        }
        let candidates: Vec<Candidate> = (0..self.id_hashes.len())
            .map(|w| {
                let r = self.reported[w];
                let heard = self.peers.iter().flatten();
                let (peer_pending, peer_inflight) =
                    heard.fold((0u64, 0u32), |(p, i), t| (p + t.pending[w], i + t.inflight[w]));
                let (matched_blocks, matched_kind) = if hinted[w] > depth[w] {
                    (hinted[w], MatchKind::Sent)
                } else {
                    let slot = Slot((w % MAX_WORKERS) as u16);
                    (depth[w], self.shards[w / MAX_WORKERS].match_kind(slot, &keys[..depth[w]]))
                };
                Candidate {
                    slot: Slot(w as u16),
                    matched_blocks,
                    matched_kind,
                    load: LoadView {
                        inflight: self.inflight[w],
                        pending_prefill_tokens: everyone_pending.map_or(self.pending[w] + peer_pending, |p| p[w]),
                        replica_pending_prefill_tokens: peer_pending,
                        replica_inflight: peer_inflight,
                        running: r.running,
                        waiting: if everyone_pending.is_some() { 0 } else { r.waiting },
                        kv_usage: r.kv_usage,
                        arrival_rate: self.rates[w].at(now_ms),
                        pace: self.paces[w].get(),
                        held_blocks: self.shards[w / MAX_WORKERS].held(Slot((w % MAX_WORKERS) as u16)) as u64,
                        capacity_blocks: self.capacity_blocks,
                    },
                    id_hash: self.id_hashes[w],
                }
            })
            .collect();
        // As `State::sole_router` and `State::routers_counted`.
        let (heard, foreign) = (self.peers.iter().any(Option::is_some), self.foreign.seen(now_ms));
        let view = RouteView {
            prompt_tokens,
            block_size: self.block_size,
            keys,
            head_hash,
            candidates: &candidates,
            mean_prompt_tokens: self.mean_prompt_tokens,
            mean_uncached_tokens: self.mean_uncached_tokens,
            prefix_hint: None,
            dry_run: false,
            sole_router: !heard && !foreign,
            routers_counted: heard || !foreign,
        };
        let decision = self.policy.choose(&view);
        let worker = decision.chosen().unwrap_or(0);
        let uncached = view.uncached_tokens(&candidates[worker]);
        let modelled_us = self.model.pace_model_us(&candidates[worker].load, uncached, self.mean_uncached_tokens);
        *self.reasons.entry(decision.reason.as_str()).or_default() += 1;
        if !keys.is_empty() {
            let (index, slot) = self.shard(worker);
            index.record_routed(slot, keys, now_ms);
        }
        self.inflight[worker] += 1;
        self.pending[worker] += uncached;
        let sent_id = self.next_sent_id;
        self.next_sent_id += 1;
        if !keys.is_empty() && self.tells_peers {
            let prefix = SentPrefix { worker: WorkerId::new(format!("w{worker}")), keys: prefixes::sample(keys) };
            self.sent_log.insert(sent_id, (prefix, None));
        }
        self.rates[worker].record(now_ms);
        self.mean_prompt_tokens = self.mean_prompt_tokens * 0.95 + prompt_tokens as f64 * 0.05;
        self.mean_uncached_tokens = self.mean_uncached_tokens * 0.95 + uncached as f64 * 0.05;
        Routed {
            worker,
            reason: decision.reason,
            uncached,
            matched_blocks: candidates[worker].matched_blocks,
            sent: now,
            modelled_us,
            sent_id,
        }
    }

    /// The first byte came back at `now`: the request's prefill is no
    /// longer pending, and its time is a sample of the worker's pace.
    pub fn first_token(&mut self, r: &Routed, now: Micros) {
        self.pending[r.worker] -= r.uncached;
        self.sent_done(r, now);
        if let Some(modelled) = r.modelled_us {
            self.paces[r.worker].record(now.saturating_sub(r.sent).0 as f64, modelled);
        }
    }

    /// The answer ended (or failed before its first byte, `first_seen` false).
    pub fn finished(&mut self, r: &Routed, first_seen: bool, now: Micros) {
        if !first_seen {
            self.pending[r.worker] -= r.uncached;
            self.sent_done(r, now);
        }
        self.inflight[r.worker] -= 1;
        self.watches[r.worker].ended(now.as_ms());
    }

    /// `r`'s first token came, or it ended without one, at `now`.
    fn sent_done(&mut self, r: &Routed, now: Micros) {
        if let Some((_, done)) = self.sent_log.get_mut(&r.sent_id) {
            done.get_or_insert(now.as_ms());
        }
    }

    /// `/internal/eviction`.
    pub fn apply_batch(&mut self, worker: usize, batch: &Batch, now: Micros) {
        let (index, slot) = self.shard(worker);
        index.apply_events(slot, batch.cleared, &batch.evicted, &batch.stored);
        if let Some(load) = batch.load {
            self.reported[worker] = load;
            let now_ms = now.as_ms();
            let routed = self.inflight[worker] + self.peers.iter().flatten().map(|t| t.inflight[worker]).sum::<u32>();
            let unaccounted = self.watches[worker].report(load.running, load.waiting, load.kv_usage, routed, now_ms);
            if unaccounted > 0 {
                self.foreign_reports += 1;
                self.foreign.observe(unaccounted, now_ms);
            }
        }
    }

    /// `/internal/sync`.
    pub fn sync(&mut self, worker: usize, keys: &[BlockKey], as_of_ms: u64) {
        let (index, slot) = self.shard(worker);
        index.sync(slot, keys, as_of_ms);
    }

    /// The router's once-a-second housekeeping: speculative entries expire.
    pub fn housekeeping(&mut self, now_ms: u64) {
        let ttl = self.speculative_ttl_ms;
        for index in &mut self.shards {
            index.expire_speculative(now_ms, ttl);
        }
    }

    pub fn entries(&self) -> usize {
        self.shards.iter().map(Index::entry_count).sum()
    }
}

#[cfg(test)]
mod tests {
    use kvroute_router::replicas::SENT_LINGER_MS;

    use super::*;

    fn replica() -> LabRouter {
        LabRouter::new(2, crate::policies::factory("predicted_ttft").expect("registered")(), 16, 10_000)
    }

    /// A variant's paces are measured against its own timing model, as a
    /// router configured with those parameters measures them.
    #[test]
    fn a_variant_paces_against_its_own_model() {
        let variant = crate::policies::factory("predicted_ttft:kv_knee=0.5").expect("a valid variant");
        assert_eq!(LabRouter::new(2, variant(), 16, 10_000).model.kv_knee, 0.5);
        assert_eq!(replica().model, PredictedTtftParams::default());
        let other = crate::policies::factory("preble").expect("registered");
        assert_eq!(LabRouter::new(2, other(), 16, 10_000).model, PredictedTtftParams::default());
    }

    /// What another replica says it has pending on a worker counts as
    /// queued there.
    #[test]
    fn a_peers_pending_prefill_steers_a_cold_request_away() {
        // A cold 64-token prompt whose tie-break falls on worker 0.
        let keys = (0u64..)
            .map(|s| (0..4).map(|i| BlockKey(s * 100 + i)).collect::<Vec<_>>())
            .find(|k| replica().route(64, k, k[0].0, Micros::ZERO, None).worker == 0)
            .expect("some prompt breaks the tie towards worker 0");
        let mut r = replica();
        r.tells_peers = true;
        r.hear_peer(1, &Told { pending: vec![40_000, 0], inflight: vec![3, 0], sent: Vec::new() });
        let routed = r.route(64, &keys, keys[0].0, Micros::ZERO, None);
        assert_eq!(routed.worker, 1);
        // The same knowledge, handed over directly (`shared_pending`).
        assert_eq!(replica().route(64, &keys, keys[0].0, Micros::ZERO, Some(&[40_000, 0])).worker, 1);
        // What it said is not this replica's own: it tells its peers only its own.
        let told = r.own_load(Micros::ZERO);
        assert_eq!((told.pending, told.inflight), (vec![0, 64], vec![0, 1]));
        let sent = SentPrefix { worker: WorkerId::new("w1"), keys: prefixes::sample(&keys) };
        assert_eq!(told.sent, std::slice::from_ref(&sent));
        // Named until a while after its first token.
        r.first_token(&routed, Micros::from_ms(10));
        assert_eq!(r.own_load(Micros::from_ms(10 + SENT_LINGER_MS - 1)).sent, [sent]);
        assert!(r.own_load(Micros::from_ms(10 + SENT_LINGER_MS)).sent.is_empty());
    }

    /// A prefix another replica is prefilling on a worker: a new request
    /// sharing it follows it there, even though that worker's queue is the
    /// longer one, where the pending figures alone would send it away.
    #[test]
    fn a_prefix_another_replica_just_sent_is_followed() {
        let doc: Vec<BlockKey> = (0..560).map(|i| BlockKey(1_000 + i)).collect();
        let question = |q: u64| {
            let mut k = doc.clone();
            k.extend((0..4).map(|i| BlockKey(q * 100 + i)));
            k
        };
        let prompt = (564 * 16) as usize;
        // The other replica sent the document (+ a question) to worker 0.
        let pending = Told { pending: vec![prompt as u64, 0], inflight: vec![1, 0], sent: Vec::new() };
        let mut blind = replica();
        blind.hear_peer(1, &pending);
        let q2 = question(2);
        assert_eq!(blind.route(prompt, &q2, q2[0].0, Micros::ZERO, None).worker, 1, "a busy worker, nothing held");
        let sent = vec![SentPrefix { worker: WorkerId::new("w0"), keys: prefixes::sample(&question(1)) }];
        let mut told = replica();
        told.hear_peer(1, &Told { sent, ..pending });
        let routed = told.route(prompt, &q2, q2[0].0, Micros::ZERO, None);
        assert_eq!(routed.worker, 0);
        assert!(routed.matched_blocks >= 448, "{}", routed.matched_blocks);
    }

    /// News replaces what a replica said of its figures and keeps the
    /// prefixes of its last full report; news from a replica not yet heard
    /// names no prefixes.
    #[test]
    fn news_replaces_the_figures_and_keeps_the_prefixes() {
        let sent = vec![SentPrefix { worker: WorkerId::new("w0"), keys: vec![BlockKey(7)] }];
        let mut r = replica();
        r.hear_peer(1, &Told { pending: vec![100, 0], inflight: vec![1, 0], sent: sent.clone() });
        // What a replica's news is made of names its prefixes; they are not taken.
        let newer = vec![SentPrefix { worker: WorkerId::new("w1"), keys: vec![BlockKey(8)] }];
        r.hear_peer_loads(1, &Told { pending: vec![0, 900], inflight: vec![0, 2], sent: newer.clone() });
        assert_eq!(r.peers[1], Some(Told { pending: vec![0, 900], inflight: vec![0, 2], sent }));
        r.hear_peer_loads(2, &Told { pending: vec![5, 5], inflight: vec![1, 1], sent: newer });
        assert_eq!(r.peers[2].as_ref().map(|t| t.sent.len()), Some(0));
    }
}
