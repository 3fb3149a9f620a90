//! Baseline policies the benchmark compares `cache_aware` against: they ignore
//! (or only hash) the prompt, as plain load balancers do.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Decision, Policy, Reason, RouteView, bounded_rendezvous, splitmix64};

/// Each worker in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicU64,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let turn =
            if view.dry_run { self.next.load(Ordering::Relaxed) } else { self.next.fetch_add(1, Ordering::Relaxed) };
        let i = turn as usize % view.candidates.len();
        Decision::with_fallbacks(view, i, Reason::RoundRobin)
    }
}

/// Fewest requests (engine-reported or this router's in-flight).
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }
    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let i = view.least_loaded(0..view.candidates.len()).unwrap_or(0);
        Decision::with_fallbacks(view, i, Reason::LeastLoaded)
    }
}

/// The less loaded of two random workers.
#[derive(Debug, Default)]
pub struct PowerOfTwo {
    counter: AtomicU64,
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }
    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let n = view.candidates.len();
        let draw = if view.dry_run {
            self.counter.load(Ordering::Relaxed)
        } else {
            self.counter.fetch_add(1, Ordering::Relaxed)
        };
        let r = splitmix64(draw ^ view.head_hash);
        let a = (r % n as u64) as usize;
        let b = ((r >> 32) % n as u64) as usize;
        let i = view.least_loaded([a, b].into_iter()).unwrap_or(a);
        Decision::with_fallbacks(view, i, Reason::PowerOfTwo)
    }
}

/// Consistent hashing with bounded loads (KubeAI's CHWBL): the hash of the
/// prompt's first tokens picks a worker by rendezvous hashing, skipping workers
/// above `load_factor` × the mean.
#[derive(Debug)]
pub struct ConsistentHash {
    pub load_factor: f64,
}

impl Default for ConsistentHash {
    fn default() -> Self {
        ConsistentHash { load_factor: 1.25 }
    }
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }
    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let all: Vec<usize> = (0..view.candidates.len()).collect();
        let i = bounded_rendezvous(view, view.head_hash, &all, self.load_factor, 0).unwrap_or(0);
        Decision::with_fallbacks(view, i, Reason::ConsistentHash)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn round_robin_cycles() {
        let k = keys(1);
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0)];
        let p = RoundRobin::default();
        let picks: Vec<_> = (0..6).map(|_| p.choose(&view(&k, &c)).chosen().unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn explaining_a_decision_does_not_take_a_turn() {
        let k = keys(1);
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0)];
        let dry = |k, c| RouteView { dry_run: true, ..view(k, c) };
        for p in [&RoundRobin::default() as &dyn Policy, &PowerOfTwo::default()] {
            let explained: Vec<_> = (0..3).map(|_| p.choose(&dry(&k, &c)).chosen()).collect();
            let next = p.choose(&view(&k, &c)).chosen();
            assert!(explained.iter().all(|e| *e == next), "{}: {explained:?} then {next:?}", p.name());
        }
    }

    #[test]
    fn least_loaded_ignores_cache() {
        let k = keys(4);
        let c = [cand(0, 4, 3), cand(1, 0, 1), cand(2, 0, 2)];
        assert_eq!(LeastLoaded.choose(&view(&k, &c)).chosen(), Some(1));
    }

    #[test]
    fn power_of_two_never_picks_the_busiest_of_its_pair() {
        let k = keys(4);
        let c = [cand(0, 0, 9), cand(1, 0, 1)];
        let p = PowerOfTwo::default();
        for _ in 0..50 {
            let d = p.choose(&view(&k, &c));
            // With two workers, a pair of distinct picks always yields worker 1;
            // a pair of equal picks yields that worker. Worker 0 only alone.
            assert!(d.chosen().is_some());
        }
        let picks_1 = (0..200).filter(|_| p.choose(&view(&k, &c)).chosen() == Some(1)).count();
        assert!(picks_1 > 100, "{picks_1}");
    }

    #[test]
    fn consistent_hash_is_stable_and_bounded() {
        let k = keys(2);
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0)];
        let p = ConsistentHash::default();
        let first = p.choose(&view(&k, &c)).chosen().unwrap();
        assert_eq!(p.choose(&view(&k, &c)).chosen(), Some(first));
        // Overload the favourite: the request moves.
        let mut loaded = c;
        loaded[first] = cand(first as u16, 0, 10);
        assert_ne!(p.choose(&view(&k, &loaded)).chosen(), Some(first));
    }
}
