//! The CI gate's check, shared by `tests/gate.rs` and `kvroute-lab gate`: a
//! small run per workload and seed, the default policy against every other
//! registered policy, failing when the default is more than 3 % behind the
//! best on TTFT p50 or p99.
//!
//! Each policy's figure is the geometric mean of its percentiles over
//! [`SEEDS`]: one 300-request run is mostly its warm-up, and its p50 swings
//! with the seed (RAG, the default policy as of 2026-11-22, seeds 1–5:
//! 291, 97, 166, 24 and 36 ms), so a single seed ranks policies by luck.

use std::collections::BTreeMap;

use crate::cluster::SidecarModel;
use crate::matrix::{MatrixError, MatrixSpec, gap_pct, run_matrix};
use crate::policies::{all, default_policy};
use crate::workload::{WorkloadKind, default_trace_path};

/// How far behind the best the default may be, in percent.
pub const TOLERANCE_PCT: f64 = 3.0;

/// The seeds every gate case runs.
pub const SEEDS: [u64; 3] = [12, 13, 14];

/// Requests per gate run: 300, small enough for a debug build in seconds;
/// RAG 1,000. Its first 300 requests are 3.5 s of traffic, the documents'
/// first prefills: its p50 over them swung from 29 to 176 ms with the seed
/// for one policy (llm-d's, 2026-11-26), and by 2.5 × for the default when
/// a 4.6 % higher capacity moved the gate's rate; over 1,000, on the gate's
/// seeds, the default's and llm-d's lie within 26–39 ms.
pub fn requests(kind: WorkloadKind) -> usize {
    if kind == WorkloadKind::Rag { 1_000 } else { 300 }
}

/// The gate's scenario for one seed: small enough for a debug build in
/// seconds.
pub fn spec(kind: WorkloadKind, seed: u64) -> MatrixSpec {
    MatrixSpec {
        workloads: vec![kind],
        loads: vec![0.7],
        workers: vec![4],
        routers: vec![1],
        policies: all().iter().map(|s| (*s).to_owned()).collect(),
        requests: requests(kind),
        seed,
        seeds: 1,
        jobs: 1,
        sidecar: SidecarModel::default(),
        slow: Default::default(),
        engine_costs: Default::default(),
        shared_pending: false,
        peer_exchange: None,
        peer_news: None,
        trace_path: default_trace_path(),
        closed_loop: false,
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

/// Runs the gate's scenario on every seed and measures the default against
/// the best.
pub fn measure(kind: WorkloadKind) -> Result<Gap, MatrixError> {
    // Per policy: (sum of ln p50, sum of ln p99, runs).
    let mut logs: BTreeMap<String, (f64, f64, usize)> = BTreeMap::new();
    for seed in SEEDS {
        for row in run_matrix(&spec(kind, seed), |_| {})?.rows {
            let e = logs.entry(row.policy).or_default();
            e.0 += row.summary.ttft_p50_ms.max(1e-3).ln();
            e.1 += row.summary.ttft_p99_ms.max(1e-3).ln();
            e.2 += 1;
        }
    }
    let means: Vec<(String, f64, f64)> =
        logs.into_iter().map(|(p, (l50, l99, n))| (p, (l50 / n as f64).exp(), (l99 / n as f64).exp())).collect();
    let default = default_policy();
    let Some(&(_, d50, d99)) = means.iter().find(|m| m.0 == default) else {
        return Ok(Gap {
            p50_pct: f64::INFINITY,
            p99_pct: f64::INFINITY,
            report: format!("{}: the default policy {default} did not run", kind.as_str()),
        });
    };
    let best = |f: fn(&(String, f64, f64)) -> f64| {
        means
            .iter()
            .min_by(|a, b| f(a).total_cmp(&f(b)))
            .map(|m| (f(m), m.0.clone()))
            .unwrap_or((f64::NAN, String::new()))
    };
    let ((b50, p50), (b99, p99)) = (best(|m| m.1), best(|m| m.2));
    let (g50, g99) = (gap_pct(d50, b50), gap_pct(d99, b99));
    let report = format!(
        "{}: {default} TTFT p50 {d50:.0} ms vs best {b50:.0} ms ({p50}), {g50:+.1} %; p99 {d99:.0} ms vs best {b99:.0} ms ({p99}), {g99:+.1} % (geometric means over seeds {SEEDS:?})",
        kind.as_str(),
    );
    Ok(Gap { p50_pct: g50, p99_pct: g99, report })
}

/// `Ok(report)` when the default is within tolerance, `Err(report)` when not;
/// the report names the figures either way.
pub fn check(kind: WorkloadKind) -> Result<Result<String, String>, MatrixError> {
    let gap = measure(kind)?;
    Ok(if gap.passes() { Ok(gap.report) } else { Err(gap.report) })
}
