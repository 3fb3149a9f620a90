//! `sticky_least_loaded`, the paper's Algorithm 1: the request's identity is
//! its first 64 tokens (or its `prefix_len` hint); send it to the least-loaded
//! worker that holds that prefix, else to the least-loaded worker overall and
//! record it there speculatively (the router records every routed request).

use super::{Decision, Policy, Reason, RouteView};

#[derive(Debug)]
pub struct StickyLeastLoaded {
    /// Tokens that identify a request when it gives no `prefix_len`.
    pub prefix_tokens: usize,
}

impl Default for StickyLeastLoaded {
    fn default() -> Self {
        StickyLeastLoaded { prefix_tokens: 64 }
    }
}

impl StickyLeastLoaded {
    /// Blocks the identifying prefix spans (at least one, at most the request's).
    fn prefix_blocks(&self, view: &RouteView<'_>, hint: Option<usize>) -> usize {
        let tokens = hint.unwrap_or(self.prefix_tokens);
        (tokens / view.block_size).clamp(1, view.keys.len().max(1))
    }

    pub fn choose_with_hint(&self, view: &RouteView<'_>, prefix_len: Option<usize>) -> Decision {
        let n = view.candidates.len();
        if view.keys.is_empty() {
            let i = view.least_loaded(0..n).unwrap_or(0);
            return Decision::with_fallbacks(view, i, Reason::NoFullBlock);
        }
        let need = self.prefix_blocks(view, prefix_len);
        let holders = (0..n).filter(|&i| view.candidates[i].matched_blocks >= need);
        match view.least_loaded(holders) {
            Some(i) => Decision::with_fallbacks(view, i, Reason::StickyHolder),
            None => Decision::with_fallbacks(view, view.least_loaded(0..n).unwrap_or(0), Reason::StickyMiss),
        }
    }
}

impl Policy for StickyLeastLoaded {
    fn name(&self) -> &'static str {
        "sticky_least_loaded"
    }
    fn choose(&self, view: &RouteView<'_>) -> Decision {
        self.choose_with_hint(view, view.prefix_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn sticks_to_the_least_loaded_holder_even_when_others_are_idle() {
        let k = keys(8);
        let c = [cand(0, 8, 5), cand(1, 4, 3), cand(2, 0, 0)];
        let d = StickyLeastLoaded::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::StickyHolder));
    }

    #[test]
    fn a_miss_goes_to_the_least_loaded() {
        let k = keys(8);
        let c = [cand(0, 2, 0), cand(1, 0, 3), cand(2, 0, 1)];
        let d = StickyLeastLoaded::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::StickyMiss));
    }

    #[test]
    fn prefix_len_hint_narrows_the_identity() {
        let k = keys(8);
        let c = [cand(0, 2, 5), cand(1, 0, 0)];
        let d = StickyLeastLoaded::default().choose_with_hint(&view(&k, &c), Some(32));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::StickyHolder));
    }
}
