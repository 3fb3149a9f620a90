//! compare's repeated rounds (`--rounds N`) summarised: per run shape (policy,
//! replicas, sidecars, router config) the median over rounds of each figure,
//! and for hit rate and TTFT the smallest and largest round, so a reader sees
//! whether two policies differ by more than one policy differs from itself
//! between rounds.

use super::Record;

/// The median of a figure over rounds, and its range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// `None` for no values. The median of an even count is the mean of the
    /// middle two.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Spread> {
        let mut v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 };
        Some(Spread { min: v[0], median, max: v[v.len() - 1] })
    }

    /// (max − min) / median: the run-to-run noise relative to the figure
    /// (0 when the median is 0).
    pub fn relative_range(&self) -> f64 {
        if self.median == 0.0 { 0.0 } else { (self.max - self.min) / self.median }
    }

    /// Whether the two ranges share any value: if they do not, the difference
    /// between the medians exceeds what the rounds varied by.
    pub fn overlaps(&self, other: &Spread) -> bool {
        self.min <= other.max && other.min <= self.max
    }
}

/// One run shape over all its rounds.
#[derive(Debug, Clone)]
pub struct Aggregate {
    /// The shape's first record with every figure replaced by its median over
    /// rounds (requests and errors summed), so the single-round checks apply.
    pub median: Record,
    pub rounds: usize,
    pub hit: Spread,
    pub ttft_p50: Spread,
    pub ttft_p99: Spread,
}

fn same_shape(a: &Record, b: &Record) -> bool {
    a.engine == b.engine
        && a.workload == b.workload
        && a.workers == b.workers
        && a.policy == b.policy
        && a.routers == b.routers
        && a.sidecars == b.sidecars
        && a.router_config == b.router_config
}

/// Groups `records` by shape, in the order each shape first appears.
pub fn aggregate(records: &[&Record]) -> Vec<Aggregate> {
    let mut groups: Vec<Vec<&Record>> = Vec::new();
    for &r in records {
        match groups.iter_mut().find(|g| same_shape(g[0], r)) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups
        .into_iter()
        .map(|g| {
            let spread = |f: fn(&Record) -> f64| Spread::of(g.iter().map(|r| f(r))).expect("a group has a record");
            let mut median = g[0].clone();
            median.hit_rate = spread(|r| r.hit_rate).median;
            median.ttft_p50_ms = spread(|r| r.ttft_p50_ms).median;
            median.ttft_p90_ms = spread(|r| r.ttft_p90_ms).median;
            median.ttft_p99_ms = spread(|r| r.ttft_p99_ms).median;
            median.ttft_mean_ms = spread(|r| r.ttft_mean_ms).median;
            median.latency_p50_ms = spread(|r| r.latency_p50_ms).median;
            median.throughput_rps = spread(|r| r.throughput_rps).median;
            median.max_mean_load = spread(|r| r.max_mean_load).median;
            median.wall_s = spread(|r| r.wall_s).median;
            median.requests = g.iter().map(|r| r.requests).sum();
            median.errors = g.iter().map(|r| r.errors).sum();
            Aggregate {
                rounds: g.len(),
                hit: spread(|r| r.hit_rate),
                ttft_p50: spread(|r| r.ttft_p50_ms),
                ttft_p99: spread(|r| r.ttft_p99_ms),
                median,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::summary::tests::rec;

    #[test]
    fn median_and_range_over_odd_and_even_counts() {
        let s = Spread::of([30.0, 10.0, 20.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (10.0, 20.0, 30.0));
        assert_eq!(s.relative_range(), 1.0);
        let s = Spread::of([4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 2.5, 4.0));
        assert_eq!(Spread::of([]), None);
        assert_eq!(Spread::of([0.0, 0.0]).unwrap().relative_range(), 0.0);
    }

    #[test]
    fn overlapping_ranges_are_told_from_separated_ones() {
        let a = Spread { min: 10.0, median: 11.0, max: 12.0 };
        assert!(a.overlaps(&Spread { min: 12.0, median: 13.0, max: 14.0 }));
        assert!(!a.overlaps(&Spread { min: 12.5, median: 13.0, max: 14.0 }));
        assert!(!Spread { min: 12.5, median: 13.0, max: 14.0 }.overlaps(&a));
    }

    #[test]
    fn rounds_of_one_shape_are_summarised_together() {
        let mut runs = Vec::new();
        for (round, (hit, p50)) in [(0.70, 12.0), (0.74, 10.0), (0.72, 30.0)].into_iter().enumerate() {
            let mut a = rec("predicted_ttft", hit, p50);
            a.round = round + 1;
            a.ttft_p99_ms = p50 * 2.0;
            runs.push(a);
            let mut b = rec("round_robin", 0.2, 40.0 + round as f64);
            b.round = round + 1;
            runs.push(b);
        }
        let mut no_sidecars = rec("predicted_ttft", 0.5, 50.0);
        no_sidecars.sidecars = false;
        runs.push(no_sidecars);
        let refs: Vec<&Record> = runs.iter().collect();
        let agg = aggregate(&refs);
        assert_eq!(agg.len(), 3, "the no-sidecars variant is a shape of its own");
        let a = &agg[0];
        assert_eq!((a.median.policy.as_str(), a.rounds), ("predicted_ttft", 3));
        assert_eq!((a.hit.min, a.hit.median, a.hit.max), (0.70, 0.72, 0.74));
        assert_eq!((a.ttft_p50.min, a.ttft_p50.median, a.ttft_p50.max), (10.0, 12.0, 30.0));
        assert_eq!(a.ttft_p99.median, 24.0);
        assert_eq!((a.median.hit_rate, a.median.ttft_p50_ms, a.median.requests), (0.72, 12.0, 30));
        let b = &agg[1];
        assert_eq!((b.rounds, b.ttft_p50.median), (3, 41.0));
        assert!(!a.ttft_p50.overlaps(&b.ttft_p50), "10–30 ms against 40–42 ms");
        assert_eq!(agg[2].rounds, 1);
    }
}
