//! `llmd_weighted`: llm-d's inference scheduler (the Gateway API inference
//! extension's endpoint picker) default profile, reimplemented for
//! comparison: weighted scorers, each in [0, 1], highest total wins.
//!
//! - prefix-cache scorer (weight 3): share of the prompt's blocks the
//!   endpoint holds;
//! - queue scorer (weight 2): min-max normalised waiting queue, 1 for the
//!   shortest (the engine's count, or this router's in-flight requests when
//!   the report is older);
//! - KV-cache utilisation scorer (weight 2): `1 − kv_usage`.
//!
//! Ties go to the rendezvous favourite so router replicas agree.

use serde::Deserialize;

use super::{Decision, Policy, Reason, RouteView, rendezvous};

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlmdParams {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
}

impl Default for LlmdParams {
    fn default() -> Self {
        LlmdParams { prefix_weight: 3.0, queue_weight: 2.0, kv_weight: 2.0 }
    }
}

#[derive(Debug, Default)]
pub struct LlmdWeighted {
    pub params: LlmdParams,
}

impl LlmdWeighted {
    pub fn scores(&self, view: &RouteView<'_>) -> Vec<f64> {
        let p = &self.params;
        let blocks = view.keys.len().max(1) as f64;
        let queue: Vec<f64> = view.candidates.iter().map(|c| f64::from(c.load.waiting.max(c.load.inflight))).collect();
        let (lo, hi) = queue.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &x| (l.min(x), h.max(x)));
        view.candidates
            .iter()
            .zip(&queue)
            .map(|(c, &q)| {
                let prefix = c.matched_blocks as f64 / blocks;
                let queue = if hi > lo { (hi - q) / (hi - lo) } else { 1.0 };
                let kv = 1.0 - c.load.kv_usage.clamp(0.0, 1.0);
                p.prefix_weight * prefix + p.queue_weight * queue + p.kv_weight * kv
            })
            .collect()
    }
}

impl Policy for LlmdWeighted {
    fn name(&self) -> &'static str {
        "llmd_weighted"
    }

    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let scores = self.scores(view);
        let chosen = (0..scores.len())
            .max_by(|&a, &b| {
                scores[a].total_cmp(&scores[b]).then_with(|| {
                    rendezvous(view.head_hash, view.candidates[a].id_hash)
                        .cmp(&rendezvous(view.head_hash, view.candidates[b].id_hash))
                })
            })
            .unwrap_or(0);
        let mut d = Decision::with_fallbacks(view, chosen, Reason::BestCost);
        d.costs = scores.into_iter().map(|s| Some(-s)).collect();
        d
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn prefix_dominates_until_the_queue_differs_a_lot() {
        let k = keys(10);
        let mut holder = cand(0, 10, 2);
        holder.load.waiting = 2;
        let c = [holder, cand(1, 0, 0)];
        // Holder: 3 + 0 + 2 = 5; idle: 0 + 2 + 2 = 4.
        assert_eq!(LlmdWeighted::default().choose(&view(&k, &c)).chosen(), Some(0));
        let mut half = holder;
        half.matched_blocks = 3;
        // 0.9 + 0 + 2 against 4: the idle worker.
        assert_eq!(LlmdWeighted::default().choose(&view(&k, &[half, c[1]])).chosen(), Some(1));
    }
}
