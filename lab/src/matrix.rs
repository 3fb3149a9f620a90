//! Runs a matrix of lab scenarios (workloads × load levels × worker counts ×
//! router replicas × policies) and renders it as markdown and JSON.
//!
//! A load level ρ sets the arrival rate so that the prefill work the router's
//! default policy actually leaves to the engines (measured by a calibration
//! run, see [`workload_for`]) plus every request's decode is ρ × the cluster's
//! capacity: ρ = 1 is saturation for the default policy.

use std::fmt::Write as _;

use serde::Serialize;

use crate::cluster::{RunResult, Scenario, SidecarModel, SlowWorkers, run};
use crate::goodput::{Goodput, goodput};
use crate::measure::{Summary, pool};
use crate::policies::{UnknownPolicy, default_policy, factory};
use crate::workload::{Shape, Workload, WorkloadError, WorkloadKind};

#[derive(Clone, Debug)]
pub struct MatrixSpec {
    pub workloads: Vec<WorkloadKind>,
    pub loads: Vec<f64>,
    pub workers: Vec<usize>,
    pub routers: Vec<usize>,
    pub policies: Vec<String>,
    pub requests: usize,
    pub seed: u64,
    /// Each case runs with seeds `seed`, `seed + 1`, … (`seeds` of them, at
    /// least 1), each its own workload and calibration, and a policy's
    /// figures pool every seed's requests ([`crate::measure::pool`]).
    pub seeds: usize,
    /// Runs at once (threads); the results do not depend on it.
    pub jobs: usize,
    pub sidecar: SidecarModel,
    /// Slow engines in every scenario (none by default).
    pub slow: SlowWorkers,
    pub engine_costs: crate::cluster::EngineCosts,
    /// [`Scenario::shared_pending`] in every scenario.
    pub shared_pending: bool,
    /// [`Scenario::peer_exchange`] in every scenario.
    pub peer_exchange: Option<crate::time::Micros>,
    /// [`Scenario::peer_news`] in every scenario.
    pub peer_news: Option<crate::time::Micros>,
    pub trace_path: std::path::PathBuf,
    /// Sessions' turns wait for the previous answer (`Shape::closed_loop`).
    pub closed_loop: bool,
    /// Goodput searches (TTFT p90 SLO in ms), at this many workers and 1 router; none if `None`.
    pub goodput: Option<GoodputSpec>,
}

#[derive(Clone, Copy, Debug)]
pub struct GoodputSpec {
    pub slo_p90_ms: f64,
    pub workers: usize,
    pub requests: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub workload: WorkloadKind,
    pub workers: usize,
    pub routers: usize,
    pub load: f64,
    /// Requests/s (the mean over seeds: each seed calibrates its own).
    pub rate: f64,
    pub policy: String,
    /// Pooled over `per_seed`'s runs.
    pub summary: Summary,
    /// Each seed's own summary, in seed order (empty with one seed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_seed: Vec<Summary>,
    pub reasons: std::collections::BTreeMap<&'static str, u64>,
    pub wall_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GoodputRow {
    pub workload: WorkloadKind,
    pub workers: usize,
    pub policy: String,
    pub slo_p90_ms: f64,
    pub goodput: Goodput,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct MatrixResult {
    pub rows: Vec<Row>,
    pub goodput: Vec<GoodputRow>,
}

#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
}

/// Engine KV blocks for a workload: `eviction` runs small engines (2,048
/// blocks, 32k tokens) so that its working set overflows them within a run.
pub fn scenario_for(kind: WorkloadKind, workers: usize, routers: usize, seed: u64, sidecar: SidecarModel) -> Scenario {
    let mut s = Scenario::new(workers, routers, seed);
    s.sidecar = sidecar;
    if kind == WorkloadKind::Eviction {
        s.engine.num_blocks = 2_048;
    }
    s
}

/// The workload shaped for a scenario, and its rate at load level 1: the rate
/// at which the default policy's measured prefill work (and every request's
/// decode) equals the cluster's capacity. It is measured by one calibration
/// run of the default policy at the rate a perfect cache would saturate
/// (`Workload::ideal_work_us`), whose hit rate then sets the work per request.
pub fn workload_for(
    kind: WorkloadKind,
    s: &Scenario,
    requests: usize,
    trace: &std::path::Path,
    closed_loop: bool,
) -> Result<(Workload, f64), MatrixError> {
    let shape =
        Shape { requests, seed: s.seed, cluster_kv_tokens: s.kv_tokens(), trace_path: trace.to_owned(), closed_loop };
    let w = Workload::generate(kind, &shape)?;
    let cost = s.engine.cost;
    let ideal_rate = s.capacity() * 1e6 / w.ideal_work_us(cost.prefill_us_per_token, cost.decode_us_per_seq);
    let calibration = run(s, &w.at_rate(ideal_rate), &factory(&default_policy())?);
    let miss = 1.0 - calibration.summary.hit_rate;
    let n = w.requests.len().max(1) as f64;
    let work: f64 = w
        .requests
        .iter()
        .map(|r| {
            r.prompt.len() as f64 * miss * cost.prefill_us_per_token + f64::from(r.max_tokens) * cost.decode_us_per_seq
        })
        .sum::<f64>()
        / n;
    Ok((w, s.capacity() * 1e6 / work))
}

/// Runs the matrix; `progress` hears about each finished row.
pub fn run_matrix(spec: &MatrixSpec, mut progress: impl FnMut(&Row)) -> Result<MatrixResult, MatrixError> {
    let factories = spec.policies.iter().map(|p| factory(p)).collect::<Result<Vec<_>, _>>()?;
    let seeds: Vec<u64> = (0..spec.seeds.max(1) as u64).map(|i| spec.seed + i).collect();
    let mut out = MatrixResult::default();
    for &kind in &spec.workloads {
        for &workers in &spec.workers {
            for &routers in &spec.routers {
                let calibrated = par_map(&seeds, spec.jobs, |&seed| {
                    let mut s = scenario_for(kind, workers, routers, seed, spec.sidecar);
                    s.slow = spec.slow;
                    spec.engine_costs.apply(&mut s.engine);
                    // Calibrated as deployed, so a what-if runs at the same rates.
                    let (w, u) = workload_for(kind, &s, spec.requests, &spec.trace_path, spec.closed_loop)?;
                    s.shared_pending = spec.shared_pending;
                    s.peer_exchange = spec.peer_exchange;
                    s.peer_news = spec.peer_news;
                    Ok::<_, MatrixError>((s, w, u))
                })
                .into_iter()
                .collect::<Result<Vec<_>, _>>()?;
                for &load in &spec.loads {
                    let at: Vec<Workload> = calibrated.iter().map(|(_, w, unit)| w.at_rate(load * unit)).collect();
                    let runs: Vec<(usize, usize)> =
                        (0..factories.len()).flat_map(|p| (0..seeds.len()).map(move |k| (p, k))).collect();
                    let results: Vec<RunResult> =
                        par_map(&runs, spec.jobs, |&(p, k)| run(&calibrated[k].0, &at[k], &factories[p]));
                    for (p, name) in spec.policies.iter().enumerate() {
                        let mine = &results[p * seeds.len()..(p + 1) * seeds.len()];
                        let parts: Vec<_> = mine.iter().map(|r| (&r.summary, r.records.as_slice())).collect();
                        let mut reasons = std::collections::BTreeMap::new();
                        for (k, v) in mine.iter().flat_map(|r| &r.reasons) {
                            *reasons.entry(*k).or_insert(0) += v;
                        }
                        let row = Row {
                            workload: kind,
                            workers,
                            routers,
                            load,
                            rate: calibrated.iter().map(|(_, _, unit)| load * unit).sum::<f64>() / seeds.len() as f64,
                            policy: name.clone(),
                            summary: pool(&parts, calibrated[0].0.step_model()),
                            per_seed: if seeds.len() > 1 {
                                mine.iter().map(|r| r.summary.clone()).collect()
                            } else {
                                vec![]
                            },
                            reasons,
                            wall_s: mine.iter().map(|r| r.wall_s).sum(),
                        };
                        progress(&row);
                        out.rows.push(row);
                    }
                }
            }
        }
        if let Some(g) = spec.goodput {
            let mut s = scenario_for(kind, g.workers, 1, spec.seed, spec.sidecar);
            s.slow = spec.slow;
            spec.engine_costs.apply(&mut s.engine);
            let (w, unit_rate) = workload_for(kind, &s, g.requests, &spec.trace_path, spec.closed_loop)?;
            s.shared_pending = spec.shared_pending;
            s.peer_exchange = spec.peer_exchange;
            s.peer_news = spec.peer_news;
            for (name, f) in spec.policies.iter().zip(&factories) {
                let gp = goodput(&s, &w, f, g.slo_p90_ms, 0.5 * unit_rate, 4);
                out.goodput.push(GoodputRow {
                    workload: kind,
                    workers: g.workers,
                    policy: name.clone(),
                    slo_p90_ms: g.slo_p90_ms,
                    goodput: gp,
                });
            }
        }
    }
    Ok(out)
}

/// `f` over `items` on up to `jobs` threads, in order. Every lab run is
/// deterministic and independent, so the results are the same as one
/// thread's.
fn par_map<T: Sync, R: Send>(items: &[T], jobs: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    if jobs <= 1 || items.len() <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(items.len()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let r = f(item);
                    done.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[i] = Some(r);
                }
            });
        }
    });
    done.into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .into_iter()
        .map(|r| r.expect("every item ran"))
        .collect()
}

/// How far `x` is above `best`, in percent (0 when it is the best).
pub fn gap_pct(x: f64, best: f64) -> f64 {
    if best <= 0.0 { if x <= 0.0 { 0.0 } else { f64::INFINITY } } else { (x / best - 1.0) * 100.0 }
}

/// The markdown report: a headline (where the default stands per case),
/// then every case's table.
pub fn markdown(result: &MatrixResult) -> String {
    let default = default_policy();
    let mut md = String::new();
    let mut cases: Vec<(WorkloadKind, usize, usize, u64)> =
        result.rows.iter().map(|r| (r.workload, r.workers, r.routers, (r.load * 1000.0) as u64)).collect();
    cases.dedup();
    let rows_of = |c: &(WorkloadKind, usize, usize, u64)| -> Vec<&Row> {
        result.rows.iter().filter(|r| (r.workload, r.workers, r.routers, (r.load * 1000.0) as u64) == *c).collect()
    };
    if let Some(n) = result.rows.iter().map(|r| r.per_seed.len()).max().filter(|n| *n > 1) {
        let _ = writeln!(
            md,
            "Each case ran with {n} seeds, each its own workload; a policy's figures pool every seed's requests \
             (per-worker balance: the mean of the seeds').\n"
        );
    }
    let _ = writeln!(
        md,
        "### Headline: the default (`{default}`) against the best policy per case\n\n\
         TTFT in ms; gap = how much slower the default is than the best policy (≤ 3 % passes).\n\n\
         | workload | workers | routers | load | best p50 (policy) | default p50 (gap) | best p99 (policy) | default p99 (gap) | within 3 % |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for c in &cases {
        let rows = rows_of(c);
        let best = |f: fn(&Summary) -> f64| {
            rows.iter()
                .min_by(|a, b| f(&a.summary).total_cmp(&f(&b.summary)))
                .map(|r| (f(&r.summary), r.policy.as_str()))
        };
        let (Some((b50, p50)), Some((b99, p99))) = (best(|s| s.ttft_p50_ms), best(|s| s.ttft_p99_ms)) else { continue };
        let Some(d) = rows.iter().find(|r| r.policy == default) else { continue };
        let (g50, g99) = (gap_pct(d.summary.ttft_p50_ms, b50), gap_pct(d.summary.ttft_p99_ms, b99));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2} | {b50:.0} ({p50}) | {:.0} ({g50:+.1} %) | {b99:.0} ({p99}) | {:.0} ({g99:+.1} %) | {} |",
            c.0.as_str(),
            c.1,
            c.2,
            c.3 as f64 / 1000.0,
            d.summary.ttft_p50_ms,
            d.summary.ttft_p99_ms,
            if g50 <= 3.0 && g99 <= 3.0 { "yes" } else { "**no**" },
        );
    }
    if !result.goodput.is_empty() {
        let _ = writeln!(
            md,
            "\n### Goodput (requests/s with TTFT p90 under the SLO)\n\n| workload | workers | SLO p90 | policy | goodput | × round_robin |\n|---|---|---|---|---|---|"
        );
        for g in &result.goodput {
            let rr = result
                .goodput
                .iter()
                .find(|x| x.workload == g.workload && x.policy == "round_robin")
                .map(|x| x.goodput.rate);
            let ratio = rr.filter(|r| *r > 0.0).map_or("–".to_owned(), |r| format!("{:.2}", g.goodput.rate / r));
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} ms | {} | {:.2} | {ratio} |",
                g.workload.as_str(),
                g.workers,
                g.slo_p90_ms,
                g.policy,
                g.goodput.rate
            );
        }
    }
    let _ = writeln!(md, "\n### Every case\n");
    for c in &cases {
        let rows = rows_of(c);
        let rate = rows.first().map_or(0.0, |r| r.rate);
        let _ = writeln!(
            md,
            "#### {} · {} workers · {} router(s) · load {:.2} ({rate:.2} req/s)\n\n\
             | policy | hit / ceiling | TTFT p50 | p90 | p99 | queue mean | prefill max/mean | req max/mean |\n\
             |---|---|---|---|---|---|---|---|",
            c.0.as_str(),
            c.1,
            c.2,
            c.3 as f64 / 1000.0
        );
        for r in rows {
            let s = &r.summary;
            let _ = writeln!(
                md,
                "| {} | {:.3} / {:.3} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
                r.policy,
                s.hit_rate,
                s.ceiling,
                s.ttft_p50_ms,
                s.ttft_p90_ms,
                s.ttft_p99_ms,
                s.queue_mean_ms,
                s.prefill_max_over_mean,
                s.requests_max_over_mean
            );
        }
        let _ = writeln!(md);
    }
    md
}
