//! The CI gate's check, shared by `tests/gate.rs` and `kvroute-lab gate`: a
//! small run per workload, the default policy against every other registered
//! policy, failing when the default is more than 3 % behind the best on TTFT
//! p50 or p99.

use crate::cluster::SidecarModel;
use crate::matrix::{MatrixError, MatrixSpec, gap_pct, run_matrix};
use crate::policies::{all, default_policy};
use crate::workload::{WorkloadKind, default_trace_path};

/// How far behind the best the default may be, in percent.
pub const TOLERANCE_PCT: f64 = 3.0;

/// The gate's scenario: small enough for a debug build in seconds.
pub fn spec(kind: WorkloadKind) -> MatrixSpec {
    MatrixSpec {
        workloads: vec![kind],
        loads: vec![0.7],
        workers: vec![4],
        routers: vec![1],
        policies: all().iter().map(|s| (*s).to_owned()).collect(),
        requests: 300,
        seed: 12,
        sidecar: SidecarModel::default(),
        trace_path: default_trace_path(),
        goodput: None,
    }
}

/// The default's distance from the best policy in one gate run.
#[derive(Clone, Debug)]
pub struct Gap {
    /// How much slower the default's TTFT p50 is than the best p50, percent.
    pub p50_pct: f64,
    /// The same for p99.
    pub p99_pct: f64,
    /// The figures, for humans.
    pub report: String,
}

impl Gap {
    /// Within [`TOLERANCE_PCT`] of the best on both p50 and p99.
    pub fn passes(&self) -> bool {
        self.p50_pct <= TOLERANCE_PCT && self.p99_pct <= TOLERANCE_PCT
    }
}

/// Runs the gate's scenario and measures the default against the best.
pub fn measure(kind: WorkloadKind) -> Result<Gap, MatrixError> {
    let result = run_matrix(&spec(kind), |_| {})?;
    let default = default_policy();
    let rows = &result.rows;
    let Some(d) = rows.iter().find(|r| r.policy == default) else {
        return Ok(Gap {
            p50_pct: f64::INFINITY,
            p99_pct: f64::INFINITY,
            report: format!("{}: the default policy {default} did not run", kind.as_str()),
        });
    };
    let best = |f: fn(&crate::measure::Summary) -> f64| {
        rows.iter()
            .min_by(|a, b| f(&a.summary).total_cmp(&f(&b.summary)))
            .map(|r| (f(&r.summary), r.policy.clone()))
            .unwrap_or((f64::NAN, String::new()))
    };
    let ((b50, p50), (b99, p99)) = (best(|s| s.ttft_p50_ms), best(|s| s.ttft_p99_ms));
    let (g50, g99) = (gap_pct(d.summary.ttft_p50_ms, b50), gap_pct(d.summary.ttft_p99_ms, b99));
    let report = format!(
        "{}: {default} TTFT p50 {:.0} ms vs best {b50:.0} ms ({p50}), {g50:+.1} %; p99 {:.0} ms vs best {b99:.0} ms ({p99}), {g99:+.1} %",
        kind.as_str(),
        d.summary.ttft_p50_ms,
        d.summary.ttft_p99_ms,
    );
    Ok(Gap { p50_pct: g50, p99_pct: g99, report })
}

/// `Ok(report)` when the default is within tolerance, `Err(report)` when not;
/// the report names the figures either way.
pub fn check(kind: WorkloadKind) -> Result<Result<String, String>, MatrixError> {
    let gap = measure(kind)?;
    Ok(if gap.passes() { Ok(gap.report) } else { Err(gap.report) })
}
