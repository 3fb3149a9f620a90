//! One router replica: the router's real [`Index`] and a real [`Policy`],
//! with the per-worker figures `routing.rs` puts into each [`Candidate`]:
//! this router's in-flight requests and pending prefill tokens (counted as
//! `proxy.rs`'s in-flight guard counts them) and the engine load the
//! sidecars last reported.
//!
//! One `Index` holds at most `MAX_WORKERS` (128) workers; past that the lab
//! gives each 128 workers an index of their own and concatenates their match
//! depths, which is what raising the bitset's width would do.

use kvroute_router::index::{Index, MAX_WORKERS, Slot};
use kvroute_router::policy::{ArrivalRate, Candidate, LoadView, Pace, Policy, PredictedTtftParams, Reason, RouteView};
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
    /// The timing model paces are measured against (the default's, as the
    /// router's proxy uses its configured one).
    model: PredictedTtftParams,
    reported: Vec<EngineLoad>,
    /// What each other replica last said it had pending and in flight per
    /// worker (`Scenario::peer_exchange`; empty without it).
    peers: Vec<Option<(Vec<u64>, Vec<u32>)>>,
    mean_prompt_tokens: f64,
    mean_uncached_tokens: f64,
    block_size: usize,
    speculative_ttl_ms: u64,
    /// Decisions by reason, for the report.
    pub reasons: std::collections::BTreeMap<&'static str, u64>,
}

impl LabRouter {
    pub fn new(workers: usize, policy: Box<dyn Policy>, block_size: usize, speculative_ttl_ms: u64) -> LabRouter {
        LabRouter {
            shards: (0..workers.div_ceil(MAX_WORKERS)).map(|_| Index::new()).collect(),
            policy,
            id_hashes: (0..workers).map(|w| id_hash(&WorkerId::new(format!("w{w}")))).collect(),
            inflight: vec![0; workers],
            pending: vec![0; workers],
            rates: vec![ArrivalRate::default(); workers],
            paces: vec![Pace::default(); workers],
            model: PredictedTtftParams::default(),
            reported: vec![EngineLoad::default(); workers],
            peers: Vec::new(),
            // `AppState`'s starting estimate.
            mean_prompt_tokens: 512.0,
            mean_uncached_tokens: 512.0,
            block_size,
            speculative_ttl_ms,
            reasons: Default::default(),
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

    /// This replica's pending prefill tokens and in-flight requests per
    /// worker, as it tells its peers.
    pub fn own_load(&self) -> (Vec<u64>, Vec<u32>) {
        (self.pending.clone(), self.inflight.clone())
    }

    /// Replica `peer` said it has `pending` tokens and `inflight` requests
    /// per worker.
    pub fn hear_peer(&mut self, peer: usize, pending: &[u64], inflight: &[u32]) {
        if self.peers.len() <= peer {
            self.peers.resize(peer + 1, None);
        }
        self.peers[peer] = Some((pending.to_vec(), inflight.to_vec()));
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
        let candidates: Vec<Candidate> = (0..self.id_hashes.len())
            .map(|w| {
                let r = self.reported[w];
                let heard = self.peers.iter().flatten();
                let (peer_pending, peer_inflight) = heard.fold((0u64, 0u32), |(p, i), (pp, pi)| (p + pp[w], i + pi[w]));
                let matched_kind =
                    self.shards[w / MAX_WORKERS].match_kind(Slot((w % MAX_WORKERS) as u16), &keys[..depth[w]]);
                Candidate {
                    slot: Slot(w as u16),
                    matched_blocks: depth[w],
                    matched_kind,
                    load: LoadView {
                        inflight: self.inflight[w],
                        pending_prefill_tokens: everyone_pending.map_or(self.pending[w] + peer_pending, |p| p[w]),
                        running: r.running,
                        waiting: if everyone_pending.is_some() { 0 } else { r.waiting.saturating_sub(peer_inflight) },
                        kv_usage: r.kv_usage,
                        arrival_rate: self.rates[w].at(now_ms),
                        pace: self.paces[w].get(),
                    },
                    id_hash: self.id_hashes[w],
                }
            })
            .collect();
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
        }
    }

    /// The first byte came back at `now`: the request's prefill is no
    /// longer pending, and its time is a sample of the worker's pace.
    pub fn first_token(&mut self, r: &Routed, now: Micros) {
        self.pending[r.worker] -= r.uncached;
        if let Some(modelled) = r.modelled_us {
            self.paces[r.worker].record(now.saturating_sub(r.sent).0 as f64, modelled);
        }
    }

    /// The answer ended (or failed before its first byte, `first_seen` false).
    pub fn finished(&mut self, r: &Routed, first_seen: bool) {
        if !first_seen {
            self.pending[r.worker] -= r.uncached;
        }
        self.inflight[r.worker] -= 1;
    }

    /// `/internal/eviction`.
    pub fn apply_batch(&mut self, worker: usize, batch: &Batch) {
        let (index, slot) = self.shard(worker);
        index.apply_events(slot, batch.cleared, &batch.evicted, &batch.stored);
        if let Some(load) = batch.load {
            self.reported[worker] = load;
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
    use super::*;

    fn replica() -> LabRouter {
        LabRouter::new(2, crate::policies::factory("predicted_ttft").expect("registered")(), 16, 10_000)
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
        r.hear_peer(1, &[40_000, 0], &[3, 0]);
        assert_eq!(r.route(64, &keys, keys[0].0, Micros::ZERO, None).worker, 1);
        // The same knowledge, handed over directly (`shared_pending`).
        assert_eq!(replica().route(64, &keys, keys[0].0, Micros::ZERO, Some(&[40_000, 0])).worker, 1);
        // What it said is not this replica's own: it tells its peers only its own.
        assert_eq!(r.own_load(), (vec![0, 64], vec![0, 1]));
    }
}
