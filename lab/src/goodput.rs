//! Goodput: the highest request rate at which TTFT p90 stays under an SLO,
//! found by bracketing (doubling or halving the rate) and then bisecting on a
//! log scale. Each probe is a full lab run of the workload at that rate.

use serde::Serialize;

use kvroute_router::policy::Policy;

use crate::cluster::{Scenario, run};
use crate::workload::Workload;

#[derive(Clone, Debug, Serialize)]
pub struct Goodput {
    /// Requests per second; 0 when even the lowest probe missed the SLO.
    pub rate: f64,
    /// Every probe: (rate, TTFT p90 ms).
    pub probes: Vec<(f64, f64)>,
}

/// Searches from `start` (requests per second) with `bisections` refinement steps.
pub fn goodput(
    scenario: &Scenario,
    workload: &Workload,
    policy: &dyn Fn() -> Box<dyn Policy>,
    slo_p90_ms: f64,
    start: f64,
    bisections: usize,
) -> Goodput {
    let mut probes = Vec::new();
    let mut probe = |rate: f64| {
        let p90 = run(scenario, &workload.at_rate(rate), policy).summary.ttft_p90_ms;
        probes.push((rate, p90));
        p90 <= slo_p90_ms
    };
    let (mut lo, mut hi) = if probe(start) {
        let mut lo = start;
        let mut hi = start * 2.0;
        for _ in 0..6 {
            if !probe(hi) {
                break;
            }
            lo = hi;
            hi *= 2.0;
        }
        (lo, hi)
    } else {
        let mut hi = start;
        let mut lo = start / 2.0;
        let mut found = false;
        for _ in 0..6 {
            if probe(lo) {
                found = true;
                break;
            }
            hi = lo;
            lo /= 2.0;
        }
        if !found {
            return Goodput { rate: 0.0, probes };
        }
        (lo, hi)
    };
    for _ in 0..bisections {
        let mid = (lo * hi).sqrt();
        if probe(mid) { lo = mid } else { hi = mid }
    }
    Goodput { rate: lo, probes }
}
