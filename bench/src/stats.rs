//! Summaries of one run's per-request outcomes: latency percentiles (an
//! HdrHistogram) and how evenly requests spread over workers.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;

/// Significant decimal digits the latency histograms keep: a percentile is
/// within 0.1 % of the recorded value, far below run-to-run noise.
const SIGNIFICANT_DIGITS: u8 = 3;

/// The longest latency recorded as itself; longer ones count as this.
const HIGHEST_NS: u64 = 24 * 3600 * 1_000_000_000;

/// Latencies in nanoseconds in an HdrHistogram (1 ns to a day).
pub fn histogram(xs: &[Duration]) -> Histogram<u64> {
    let mut h = Histogram::new_with_bounds(1, HIGHEST_NS, SIGNIFICANT_DIGITS).expect("valid bounds and precision");
    for d in xs {
        h.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }
    h
}

/// Nearest-rank percentile (`q` in 0..=100) in milliseconds, within 0.1 %
/// (HdrHistogram's highest equivalent value at that rank); 0 when empty.
/// The input need not be sorted.
pub fn percentile_ms(xs: &[Duration], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    histogram(xs).value_at_quantile(q / 100.0) as f64 / 1e6
}

pub fn mean_ms(xs: &[Duration]) -> f64 {
    if xs.is_empty() { 0.0 } else { xs.iter().map(Duration::as_secs_f64).sum::<f64>() / xs.len() as f64 * 1e3 }
}

/// Max over mean of requests served per worker, counting workers that served
/// nothing (so one worker taking everything out of four gives 4.0).
pub fn max_mean_load(per_worker: &BTreeMap<String, u64>, workers: usize) -> f64 {
    let total: u64 = per_worker.values().sum();
    if total == 0 || workers == 0 {
        return 0.0;
    }
    let max = per_worker.values().max().copied().unwrap_or(0) as f64;
    max / (total as f64 / workers as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within HdrHistogram's 0.1 % of `want` (and never below it).
    fn near(got: f64, want: f64) {
        assert!(got >= want && got <= want * 1.001, "{got} is not within 0.1 % above {want}");
    }

    #[test]
    fn nearest_rank() {
        let mut xs: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        xs.reverse();
        near(percentile_ms(&xs, 50.0), 50.0);
        near(percentile_ms(&xs, 90.0), 90.0);
        near(percentile_ms(&xs, 99.0), 99.0);
        near(percentile_ms(&xs, 100.0), 100.0);
        near(percentile_ms(&xs[..1], 99.0), 100.0);
        assert_eq!(percentile_ms(&[], 50.0), 0.0);
        // Sub-millisecond router overheads keep their microseconds.
        let small = [Duration::from_micros(125), Duration::from_micros(250)];
        near(percentile_ms(&small, 50.0), 0.125);
        // A 10-minute outlier does not overflow or lose the rest.
        let wide = [Duration::from_micros(1), Duration::from_secs(600)];
        near(percentile_ms(&wide, 50.0), 0.001);
        near(percentile_ms(&wide, 100.0), 600_000.0);
    }

    #[test]
    fn load_spread_counts_idle_workers() {
        let m: BTreeMap<String, u64> = [("w1".to_string(), 8)].into();
        assert_eq!(max_mean_load(&m, 4), 4.0);
        let m: BTreeMap<String, u64> = [("w1".to_string(), 5), ("w2".to_string(), 5)].into();
        assert_eq!(max_mean_load(&m, 2), 1.0);
    }
}
