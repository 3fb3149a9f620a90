//! `prefix_threshold`, SGLang's cache-aware router (and Ray Serve's prefix
//! router) in miniature: while load is balanced, go to the best-matching
//! worker if its match ratio clears a threshold, else to the least loaded;
//! when load is imbalanced (by absolute and relative thresholds), least loaded.

use serde::Deserialize;

use super::{Decision, Policy, Reason, RouteView};

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixThresholdParams {
    /// Matched tokens / prompt tokens needed to follow the cache.
    pub threshold: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
}

impl Default for PrefixThresholdParams {
    fn default() -> Self {
        // SGLang's defaults: cache_threshold 0.5, balance_abs_threshold 32,
        // balance_rel_threshold 1.0001 (here 1.5: a ratio over an idle worker
        // of 0 requests is otherwise always "imbalanced").
        PrefixThresholdParams { threshold: 0.5, balance_abs: 32, balance_rel: 1.5 }
    }
}

#[derive(Debug, Default)]
pub struct PrefixThreshold {
    pub params: PrefixThresholdParams,
}

impl Policy for PrefixThreshold {
    fn name(&self) -> &'static str {
        "prefix_threshold"
    }
    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let p = &self.params;
        let n = view.candidates.len();
        let loads: Vec<u64> = view.candidates.iter().map(|c| c.load.requests()).collect();
        let (min, max) = (loads.iter().min().copied().unwrap_or(0), loads.iter().max().copied().unwrap_or(0));
        if max - min > p.balance_abs && max as f64 > p.balance_rel * min as f64 {
            let i = view.least_loaded(0..n).unwrap_or(0);
            return Decision::with_fallbacks(view, i, Reason::Imbalanced);
        }
        let best = (0..n).max_by_key(|&i| (view.candidates[i].matched_blocks, std::cmp::Reverse(loads[i])));
        if let Some(i) = best {
            let matched = (view.candidates[i].matched_blocks * view.block_size) as f64;
            if view.prompt_tokens > 0 && matched / view.prompt_tokens as f64 >= p.threshold {
                return Decision::with_fallbacks(view, i, Reason::ThresholdMatch);
            }
        }
        let i = view.least_loaded(0..n).unwrap_or(0);
        Decision::with_fallbacks(view, i, Reason::BelowThreshold)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn follows_a_good_match_when_balanced() {
        let k = keys(10);
        let c = [cand(0, 8, 3), cand(1, 0, 0)];
        let d = PrefixThreshold::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::ThresholdMatch));
    }

    #[test]
    fn ignores_a_weak_match() {
        let k = keys(10);
        let c = [cand(0, 2, 3), cand(1, 0, 0)];
        let d = PrefixThreshold::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::BelowThreshold));
    }

    #[test]
    fn least_loaded_when_imbalanced() {
        let k = keys(10);
        let c = [cand(0, 10, 50), cand(1, 0, 2)];
        let d = PrefixThreshold::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::Imbalanced));
    }
}
