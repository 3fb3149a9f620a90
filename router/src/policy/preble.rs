//! `preble`: Preble's (ICLR 2025) explore/exploit split, reimplemented for
//! comparison.
//!
//! When some worker holds more of the prompt than `exploit_ratio` of it
//! (Preble's default 0.5), *exploit*: send it to the best-matching worker,
//! unless that worker's load exceeds `rebalance_factor` × the lightest
//! worker's (+ slack), Preble's post-assignment load adjustment. Otherwise
//! *explore*: choose the worker with the least total cost, Preble's
//! `load + prefill of the missed tokens`, where load is the prefill tokens in
//! flight there plus the running decodes (each worth `decode_token_weight`
//! prefill tokens per step), all in tokens.

use serde::Deserialize;

use super::{Decision, Policy, Reason, RouteView, rendezvous};

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrebleParams {
    pub exploit_ratio: f64,
    pub rebalance_factor: f64,
    pub rebalance_slack_tokens: f64,
    pub decode_token_weight: f64,
}

impl Default for PrebleParams {
    fn default() -> Self {
        PrebleParams {
            exploit_ratio: 0.5,
            rebalance_factor: 2.0,
            rebalance_slack_tokens: 8_192.0,
            decode_token_weight: 32.0,
        }
    }
}

#[derive(Debug, Default)]
pub struct Preble {
    pub params: PrebleParams,
}

impl Preble {
    /// Work already on the worker, in prefill tokens.
    fn load(&self, view: &RouteView<'_>, i: usize) -> f64 {
        let c = &view.candidates[i].load;
        let foreign = f64::from(c.foreign_waiting()) * view.mean_prompt_tokens;
        c.pending_prefill_tokens as f64
            + foreign
            + f64::from(c.running.max(c.routed_inflight())) * self.params.decode_token_weight
    }
}

impl Policy for Preble {
    fn name(&self) -> &'static str {
        "preble"
    }

    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let p = &self.params;
        let n = view.candidates.len();
        let loads: Vec<f64> = (0..n).map(|i| self.load(view, i)).collect();
        let lightest = loads.iter().copied().fold(f64::INFINITY, f64::min);
        let best = (0..n).max_by(|&a, &b| {
            let (ca, cb) = (&view.candidates[a], &view.candidates[b]);
            ca.matched_blocks.cmp(&cb.matched_blocks).then(loads[b].total_cmp(&loads[a]))
        });
        if let Some(i) = best {
            let ratio = (view.candidates[i].matched_blocks * view.block_size) as f64 / view.prompt_tokens.max(1) as f64;
            if ratio > p.exploit_ratio && loads[i] <= p.rebalance_factor * lightest + p.rebalance_slack_tokens {
                return Decision::with_fallbacks(view, i, Reason::ThresholdMatch);
            }
        }
        let cost: Vec<f64> = (0..n).map(|i| loads[i] + view.uncached_tokens(&view.candidates[i]) as f64).collect();
        let chosen = (0..n)
            .min_by(|&a, &b| {
                cost[a].total_cmp(&cost[b]).then_with(|| {
                    rendezvous(view.head_hash, view.candidates[b].id_hash)
                        .cmp(&rendezvous(view.head_hash, view.candidates[a].id_hash))
                })
            })
            .unwrap_or(0);
        let mut d = Decision::with_fallbacks(view, chosen, Reason::BelowThreshold);
        d.costs = cost.into_iter().map(Some).collect();
        d
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn exploits_a_strong_match_and_explores_otherwise() {
        let k = keys(10);
        let c = [cand(0, 8, 1), cand(1, 0, 0)];
        let d = Preble::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::ThresholdMatch));
        let weak = [cand(0, 2, 1), cand(1, 0, 0)];
        let d = Preble::default().choose(&view(&k, &weak));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::BelowThreshold));
    }

    #[test]
    fn rebalances_off_an_overloaded_holder() {
        let k = keys(10);
        let mut holder = cand(0, 10, 4);
        holder.load.pending_prefill_tokens = 40_000;
        let d = Preble::default().choose(&view(&k, &[holder, cand(1, 0, 0)]));
        assert_eq!(d.chosen(), Some(1));
    }
}
