//! `dynamo_kv`: NVIDIA Dynamo's KV router cost function, reimplemented from
//! its documentation for comparison (not Dynamo's code).
//!
//! `logit(w) = overlap_weight · prefill_blocks(w) + decode_blocks(w)`, lowest
//! wins, where `prefill_blocks` is the request's blocks the worker does not
//! hold plus the prefill already scheduled there, and `decode_blocks` the
//! blocks of the sequences active there. At `temperature` 0 (Dynamo's
//! default) the lowest logit wins (ties by rendezvous, so replicas agree);
//! above 0 a worker is drawn with probability ∝ `exp(−normalised logit / T)`.
//! The router sees active blocks as requests in flight (or the engine's
//! running count) at the mean prompt size.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;

use super::{Decision, Policy, Reason, RouteView, rendezvous, splitmix64};

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamoParams {
    pub overlap_weight: f64,
    pub temperature: f64,
}

impl Default for DynamoParams {
    fn default() -> Self {
        DynamoParams { overlap_weight: 1.0, temperature: 0.0 }
    }
}

#[derive(Debug, Default)]
pub struct DynamoKv {
    pub params: DynamoParams,
    draws: AtomicU64,
}

impl DynamoKv {
    pub fn new(params: DynamoParams) -> Self {
        DynamoKv { params, draws: AtomicU64::new(0) }
    }

    pub fn logit(&self, view: &RouteView<'_>, i: usize) -> f64 {
        let c = &view.candidates[i];
        let bs = view.block_size.max(1) as f64;
        let prefill = (view.uncached_tokens(c) + c.load.pending_prefill_tokens) as f64 / bs;
        let active = f64::from(c.load.inflight.max(c.load.running));
        let decode = active * view.mean_prompt_tokens / bs;
        self.params.overlap_weight * prefill + decode
    }
}

impl Policy for DynamoKv {
    fn name(&self) -> &'static str {
        "dynamo_kv"
    }

    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let n = view.candidates.len();
        let logits: Vec<f64> = (0..n).map(|i| self.logit(view, i)).collect();
        let chosen = if self.params.temperature <= 0.0 {
            (0..n)
                .min_by(|&a, &b| {
                    logits[a].total_cmp(&logits[b]).then_with(|| {
                        rendezvous(view.head_hash, view.candidates[b].id_hash)
                            .cmp(&rendezvous(view.head_hash, view.candidates[a].id_hash))
                    })
                })
                .unwrap_or(0)
        } else {
            let (lo, hi) = logits.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| (l.min(x), h.max(x)));
            let span = (hi - lo).max(1e-9);
            let weights: Vec<f64> =
                logits.iter().map(|&l| (-(l - lo) / span / self.params.temperature).exp()).collect();
            let draw = if view.dry_run {
                self.draws.load(Ordering::Relaxed)
            } else {
                self.draws.fetch_add(1, Ordering::Relaxed)
            };
            let u = (splitmix64(draw ^ view.head_hash) >> 11) as f64 / (1u64 << 53) as f64;
            let mut target = u * weights.iter().sum::<f64>();
            weights
                .iter()
                .position(|&w| {
                    target -= w;
                    target < 0.0
                })
                .unwrap_or(n - 1)
        };
        let mut d = Decision::with_fallbacks(view, chosen, Reason::BestCost);
        d.costs = logits.into_iter().map(Some).collect();
        d
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn overlap_and_active_blocks_trade_off() {
        let k = keys(40);
        // Holder: 40 blocks cached, 4 active requests (4 × 1,000 / 16 = 250 blocks).
        let mut holder = cand(0, 40, 4);
        holder.load.pending_prefill_tokens = 0;
        let idle = cand(1, 0, 0);
        let d = DynamoKv::default().choose(&view(&k, &[holder, idle]));
        // Holder: 0.3 + 250; idle: 40.3 prefill blocks. The idle worker wins.
        assert_eq!(d.chosen(), Some(1));
        holder.load.inflight = 0;
        assert_eq!(DynamoKv::default().choose(&view(&k, &[holder, idle])).chosen(), Some(0));
    }

    #[test]
    fn temperature_spreads_choices() {
        let k = keys(4);
        let c = [cand(0, 4, 0), cand(1, 3, 0), cand(2, 0, 0)];
        let p = DynamoKv::new(DynamoParams { temperature: 1.0, ..Default::default() });
        let picks: std::collections::BTreeSet<_> = (0..200).map(|_| p.choose(&view(&k, &c)).chosen()).collect();
        assert!(picks.len() >= 2, "{picks:?}");
    }
}
