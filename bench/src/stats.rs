//! Summaries of one run's per-request outcomes: latency percentiles and how
//! evenly requests spread over workers.

use std::collections::BTreeMap;
use std::time::Duration;

/// Nearest-rank percentile (`q` in 0..=100) in milliseconds; 0 when empty.
pub fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1e3
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

    #[test]
    fn nearest_rank() {
        let xs: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&xs, 50.0), 50.0);
        assert_eq!(percentile_ms(&xs, 99.0), 99.0);
        assert_eq!(percentile_ms(&xs, 100.0), 100.0);
        assert_eq!(percentile_ms(&xs[..1], 99.0), 1.0);
        assert_eq!(percentile_ms(&[], 50.0), 0.0);
    }

    #[test]
    fn load_spread_counts_idle_workers() {
        let m: BTreeMap<String, u64> = [("w1".to_string(), 8)].into();
        assert_eq!(max_mean_load(&m, 4), 4.0);
        let m: BTreeMap<String, u64> = [("w1".to_string(), 5), ("w2".to_string(), 5)].into();
        assert_eq!(max_mean_load(&m, 2), 1.0);
    }
}
