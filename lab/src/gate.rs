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

/// `Ok(report)` when the default is within tolerance, `Err(report)` when not;
/// the report names the figures either way.
pub fn check(kind: WorkloadKind) -> Result<Result<String, String>, MatrixError> {
    let result = run_matrix(&spec(kind), |_| {})?;
    let default = default_policy();
    let rows = &result.rows;
    let Some(d) = rows.iter().find(|r| r.policy == default) else {
        return Ok(Err(format!("{}: the default policy {default} did not run", kind.as_str())));
    };
    let best = |f: fn(&crate::measure::Summary) -> f64| {
        rows.iter().min_by(|a, b| f(&a.summary).total_cmp(&f(&b.summary))).map(|r| (f(&r.summary), r.policy.clone()))
    };
    let (Some((b50, p50)), Some((b99, p99))) = (best(|s| s.ttft_p50_ms), best(|s| s.ttft_p99_ms)) else {
        return Ok(Err("no rows".into()));
    };
    let (g50, g99) = (gap_pct(d.summary.ttft_p50_ms, b50), gap_pct(d.summary.ttft_p99_ms, b99));
    let report = format!(
        "{}: {default} TTFT p50 {:.0} ms vs best {b50:.0} ms ({p50}), {g50:+.1} %; p99 {:.0} ms vs best {b99:.0} ms ({p99}), {g99:+.1} %",
        kind.as_str(),
        d.summary.ttft_p50_ms,
        d.summary.ttft_p99_ms,
    );
    Ok(if g50 <= TOLERANCE_PCT && g99 <= TOLERANCE_PCT { Ok(report) } else { Err(report) })
}
