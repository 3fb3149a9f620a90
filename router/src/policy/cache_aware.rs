//! `cache_aware`, the default: minimise the time to first token as the router
//! can estimate it,
//!
//! `cost(w) = uncached_prefill_tokens(w) + load_weight · pending_tokens(w)`,
//!
//! where `pending_tokens` is the prefill this router has queued there plus the
//! engine-reported requests of other routers at the mean prompt size. Two
//! guardrails keep a popular prefix from overloading its holder: a spill gate
//! drops candidates far above the mean load, and when load is badly skewed the
//! policy falls back to least-loaded. Cold prefixes (no holder anywhere) are
//! placed by bounded-load rendezvous hashing of the first block key, so router
//! replicas that never talk agree on where a new prefix goes.

use serde::Deserialize;

use super::{Decision, Policy, Reason, RouteView, bounded_rendezvous, rendezvous};

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareParams {
    /// Tokens of cost per pending prefill token on the worker (see
    /// `CacheAware::pending_tokens`). Below 1: vLLM
    /// batches prefills (up to `max_num_batched_tokens` a step), so a queued
    /// token delays a new request less than one of its own uncached tokens;
    /// at 1.0 the in-flight prefill of the very prefix being placed would tie
    /// its holder with an idle worker and scatter a burst.
    pub load_weight: f64,
    /// A candidate with more than `spill_factor` × mean + `spill_slack`
    /// requests is not eligible (unless none is).
    pub spill_factor: f64,
    pub spill_slack: f64,
    /// Load is imbalanced when max − min > `imbalance_abs` requests and
    /// max > `imbalance_rel` × min.
    pub imbalance_abs: u64,
    pub imbalance_rel: f64,
    /// Bounded-load factor of cold placement (≥ 1).
    pub placement_factor: f64,
    /// Below this share of the prompt matched anywhere, a request is placed
    /// like a cold one (see `CacheAware::choose`).
    pub min_match_ratio: f64,
}

impl CacheAwareParams {
    /// The spill gate: a worker carrying more requests than this (given every
    /// candidate's request count) is not eligible for a cache hit.
    pub fn spill_limit(&self, loads: &[u64]) -> f64 {
        let mean = loads.iter().sum::<u64>() as f64 / loads.len().max(1) as f64;
        self.spill_factor * mean + self.spill_slack
    }
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        CacheAwareParams {
            load_weight: 0.5,
            spill_factor: 1.5,
            spill_slack: 4.0,
            imbalance_abs: 32,
            imbalance_rel: 3.0,
            placement_factor: 1.25,
            min_match_ratio: 0.5,
        }
    }
}

#[derive(Debug, Default)]
pub struct CacheAware {
    pub params: CacheAwareParams,
}

impl CacheAware {
    /// Prefill queued ahead of a new request on the worker: this router's own
    /// not-yet-prefilled tokens, or the engine's waiting queue (which also
    /// holds other routers' requests) at the mean prompt size, whichever is
    /// larger. Not their sum: this router's requests are in that queue too.
    /// Running requests are not counted: they are past their prefill or in
    /// this step's batch, and the engine's reported count lags by up to a
    /// scrape interval, which made the busiest holder look far busier than it
    /// was.
    fn pending_tokens(&self, view: &RouteView<'_>, i: usize) -> f64 {
        let l = &view.candidates[i].load;
        let queued = f64::from(l.waiting) * view.mean_prompt_tokens;
        (l.pending_prefill_tokens as f64).max(queued)
    }

    fn cost(&self, view: &RouteView<'_>, i: usize) -> f64 {
        view.uncached_tokens(&view.candidates[i]) as f64 + self.params.load_weight * self.pending_tokens(view, i)
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let p = &self.params;
        let n = view.candidates.len();
        let all = 0..n;
        let costs: Vec<Option<f64>> = (0..n).map(|i| Some(self.cost(view, i))).collect();
        let by_cost = |chosen: usize, reason: Reason| {
            let mut rest: Vec<usize> = (0..n).filter(|&i| i != chosen).collect();
            rest.sort_by(|&a, &b| costs[a].partial_cmp(&costs[b]).unwrap_or(std::cmp::Ordering::Equal));
            let mut ranked = vec![chosen];
            ranked.extend(rest);
            Decision { ranked, reason, costs: costs.clone() }
        };
        let least = |among: &mut dyn Iterator<Item = usize>| view.least_loaded(among).unwrap_or(0);

        let Some(first_key) = view.keys.first() else {
            return by_cost(least(&mut all.clone()), Reason::NoFullBlock);
        };

        let loads: Vec<u64> = view.candidates.iter().map(|c| c.load.requests()).collect();
        let (min, max) = (loads.iter().min().copied().unwrap_or(0), loads.iter().max().copied().unwrap_or(0));
        if max - min > p.imbalance_abs && max as f64 > p.imbalance_rel * min as f64 {
            return by_cost(least(&mut all.clone()), Reason::Imbalanced);
        }

        let limit = p.spill_limit(&loads);
        let mut eligible: Vec<usize> = all.clone().filter(|&i| loads[i] as f64 <= limit).collect();
        if eligible.is_empty() {
            eligible = all.collect();
        }

        // A weak match is not worth chasing: when the best holder has only a
        // small share of the prompt (typically a system prompt every request
        // shares), following it would send every new conversation or document
        // to that one worker and thrash its cache. Such requests are placed
        // like cold ones, deterministically by where they diverge; the shared
        // prefix soon lives on every worker anyway.
        let best_ratio =
            eligible.iter().map(|&i| (view.candidates[i].matched_blocks * view.block_size) as f64).fold(0.0, f64::max)
                / view.prompt_tokens.max(1) as f64;
        if best_ratio < p.min_match_ratio {
            // Place by the first block nobody holds: where this prompt leaves
            // everything cached. Hashing the first block instead would send
            // every conversation behind one shared system prompt to the same
            // worker.
            let deepest = view.candidates.iter().map(|c| c.matched_blocks).max().unwrap_or(0);
            let anchor = view.keys.get(deepest).or(view.keys.last()).unwrap_or(first_key);
            let slack = p.spill_slack as u64;
            let chosen = bounded_rendezvous(view, anchor.0, &eligible, p.placement_factor, slack).unwrap_or(0);
            return by_cost(chosen, Reason::ColdPlacement);
        }

        let chosen = eligible
            .iter()
            .copied()
            .min_by(|&a, &b| {
                let ord = costs[a].partial_cmp(&costs[b]).unwrap_or(std::cmp::Ordering::Equal);
                // Equal cost: the rendezvous favourite, identical on all routers.
                ord.then_with(|| {
                    rendezvous(first_key.0, view.candidates[b].id_hash)
                        .cmp(&rendezvous(first_key.0, view.candidates[a].id_hash))
                })
            })
            .unwrap_or(0);
        by_cost(chosen, Reason::BestCost)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn prefers_the_longest_cached_prefix() {
        let k = keys(20);
        let c = [cand(0, 2, 1), cand(1, 20, 2), cand(2, 0, 0)];
        let d = CacheAware::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::BestCost));
        assert_eq!(d.ranked.len(), 3);
    }

    #[test]
    fn spills_from_an_overloaded_holder() {
        let k = keys(20);
        // Holder has 20 requests against a mean of ~7: over 1.5 × mean + 4.
        let c = [cand(0, 20, 20), cand(1, 0, 1), cand(2, 0, 1)];
        let d = CacheAware::default().choose(&view(&k, &c));
        assert_ne!(d.chosen(), Some(0));
    }

    #[test]
    fn falls_back_to_least_loaded_when_imbalanced() {
        let k = keys(4);
        let c = [cand(0, 4, 40), cand(1, 0, 2), cand(2, 0, 5)];
        let d = CacheAware::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::Imbalanced));
    }

    #[test]
    fn cold_prefixes_are_placed_identically_by_independent_routers() {
        let k = keys(3);
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let a = CacheAware::default().choose(&view(&k, &c));
        let b = CacheAware::default().choose(&view(&k, &c));
        assert_eq!(a.reason, Reason::ColdPlacement);
        assert_eq!(a.chosen(), b.chosen());
        // Different first keys spread over workers.
        let chosen: std::collections::BTreeSet<_> = (0..64u64)
            .map(|s| {
                let k: Vec<_> = (0..3).map(|i| kvroute_shared::BlockKey(s * 1000 + i)).collect();
                CacheAware::default().choose(&view(&k, &c)).chosen()
            })
            .collect();
        assert_eq!(chosen.len(), 4);
    }

    #[test]
    fn a_burst_in_flight_stays_on_its_holder() {
        let k = keys(100);
        // The holder has the prefix's first prefill (1,600 tokens) and seven
        // more requests in flight; the others are idle.
        let mut holder = cand(0, 100, 8);
        holder.load.pending_prefill_tokens = 1_600 + 7 * 5;
        let c = [holder, cand(1, 0, 0), cand(2, 0, 0)];
        let d = CacheAware::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::BestCost));
        // A cold burst's first requests, before any is recorded, share a worker.
        let cold = [cand(0, 0, 2), cand(1, 0, 0), cand(2, 0, 0)];
        let first = CacheAware::default().choose(&view(&k, &[cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0)])).chosen();
        let again = CacheAware::default().choose(&view(&k, &{
            let mut c = cold;
            for (i, x) in c.iter_mut().enumerate() {
                x.load.inflight = if Some(i) == first { 2 } else { 0 };
                x.load.pending_prefill_tokens = 0;
            }
            c
        }));
        assert_eq!(again.chosen(), first);
    }

    #[test]
    fn engine_reported_running_requests_do_not_push_work_off_the_holder() {
        let k = keys(60);
        // The holder's engine reports 6 running (decoding) requests; nothing waits.
        let mut holder = cand(0, 60, 1);
        holder.load.running = 6;
        holder.load.pending_prefill_tokens = 0;
        let c = [holder, cand(1, 0, 0)];
        assert_eq!(CacheAware::default().choose(&view(&k, &c)).chosen(), Some(0));
    }

    #[test]
    fn another_routers_queue_counts_once() {
        let k = keys(60);
        // 3 requests wait in the holder's engine (other routers' traffic);
        // this router's own pending prefill there is smaller than that queue.
        let mut holder = cand(0, 10, 0);
        holder.load.waiting = 3;
        holder.load.pending_prefill_tokens = 500;
        let p = CacheAware::default();
        let v = view(&k, std::slice::from_ref(&holder));
        // max(500, 3 × 1000 mean prompt tokens) = 3000, not 3500.
        assert_eq!(p.pending_tokens(&v, 0), 3000.0);
    }

    #[test]
    fn spilled_conversations_spread_instead_of_following_the_system_prompt() {
        // Worker 0 holds the shared system prompt (2 blocks) but is over the
        // spill gate; new conversations differ from block 2 on.
        let mut chosen = std::collections::BTreeSet::new();
        for conv in 0..32u64 {
            let mut k = keys(2);
            k.extend((0..4).map(|i| kvroute_shared::BlockKey(1000 + conv * 10 + i)));
            let c = [cand(0, 2, 30), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
            let d = CacheAware::default().choose(&view(&k, &c));
            assert_eq!(d.reason, Reason::ColdPlacement);
            chosen.insert(d.chosen());
        }
        assert_eq!(chosen.len(), 3, "spread over the three eligible workers: {chosen:?}");
    }

    #[test]
    fn short_prompts_go_to_the_least_loaded() {
        let c = [cand(0, 0, 3), cand(1, 0, 1)];
        let d = CacheAware::default().choose(&view(&[], &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::NoFullBlock));
    }

    #[test]
    fn load_can_outweigh_a_hit() {
        let k = keys(10);
        // Worker 0 holds 60 % of the prompt but has 8 requests' prefill queued.
        let mut busy = cand(0, 6, 8);
        busy.load.pending_prefill_tokens = 8 * 1000;
        let c = [busy, cand(1, 0, 0), cand(2, 0, 1)];
        let d = CacheAware::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::BestCost));
    }

    #[test]
    fn a_weak_match_is_placed_like_a_cold_prompt_and_a_strong_one_is_followed() {
        // Every conversation shares 2 system-prompt blocks (20 % of 10) held
        // by worker 0 only: conversations spread by where they diverge.
        let mut chosen = std::collections::BTreeSet::new();
        for conv in 0..32u64 {
            let mut k = keys(2);
            k.extend((0..8).map(|i| kvroute_shared::BlockKey(5000 + conv * 10 + i)));
            let c = [cand(0, 2, 0), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
            let d = CacheAware::default().choose(&view(&k, &c));
            assert_eq!(d.reason, Reason::ColdPlacement);
            chosen.insert(d.chosen());
        }
        assert_eq!(chosen.len(), 4, "{chosen:?}");
        // A conversation whose history (80 %) worker 2 holds stays there.
        let k = keys(10);
        let c = [cand(0, 2, 0), cand(1, 0, 0), cand(2, 8, 0), cand(3, 0, 0)];
        let d = CacheAware::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(2), Reason::BestCost));
    }
}
