//! The lab checked against the process-level bench (issue 12): a
//! `kvroute-bench compare --trace` run replayed in virtual time, request for
//! request, and the two tools' hit rate and TTFT side by side.
//!
//! The Mooncake trace is the one workload both tools read from the same file
//! with the same meaning (each hash id a 512-token block, the last one cut to
//! `input_length`), so the same lines give the same prompts' sharing
//! structure, block for block. What the bench does to it is done here too:
//! `requests` lines after the first `--skip`, timestamps (from the first
//! replayed line's) divided by `--speedup`, outputs
//! capped (16 tokens by default), engines at the bench's KV block count and
//! `max_model_len`, their modelled step times divided by the bench's
//! `--time-scale`. The lab then runs in the bench's wall-clock units, so the
//! sidecars' 100 ms batches and 1 s load scrapes, which are wall-clock
//! intervals in the real processes, stay what they are.
//!
//! Both hit rates are vLLM's counters (hits over queries summed over
//! engines); both TTFTs run from a request's arrival to its first token (the
//! bench's client starts its clock when it sends, at the arrival time unless
//! its concurrency cap of 64 holds the request back, which the lab's
//! in-flight maximum shows). The bench's request logs give each request's
//! arrival time and prompt length, which are checked against the lab's.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::cluster::{PathModel, Scenario, run};
use crate::policies::{UnknownPolicy, factory};
use crate::time::Micros;
use crate::workload::{Shape, Workload, WorkloadError, WorkloadKind};

/// Issue 12's targets: hit rate within this, absolute.
pub const HIT_TOLERANCE: f64 = 0.02;
/// TTFT p50 within this fraction of the bench's.
pub const TTFT_TOLERANCE: f64 = 0.15;

/// What the bench did to the trace that its results.json does not record.
#[derive(Clone, Debug)]
pub struct Replay {
    pub trace: PathBuf,
    /// The bench's `--speedup` (its default for the trace is 20).
    pub speedup: f64,
    /// The bench's `--skip`: trace lines before the replayed stretch.
    pub skip: usize,
    /// The bench's cap on output tokens (`trace::Params::max_output`, 16).
    pub max_output: u32,
    pub seed: u64,
    /// The request path's latency ahead of the engine, which the bench's
    /// processes have and the lab by default leaves out.
    pub path: PathModel,
}

impl Replay {
    /// `requests` lines of the trace after the first `skip`, as the bench
    /// replays them.
    pub fn workload(&self, requests: usize) -> Result<Workload, WorkloadError> {
        let shape = Shape {
            requests: self.skip + requests,
            seed: self.seed,
            cluster_kv_tokens: 0,
            trace_path: self.trace.clone(),
            closed_loop: false,
        };
        let mut w = Workload::generate(WorkloadKind::Trace, &shape)?;
        w.requests.drain(..self.skip.min(w.requests.len()));
        let t0 = w.requests.first().map_or(0, |r| r.at.0);
        for r in &mut w.requests {
            r.at = Micros(((r.at.0 - t0) as f64 / self.speedup).round() as u64);
            r.max_tokens = r.max_tokens.clamp(1, self.max_output.max(1));
        }
        Ok(w)
    }

    /// kvroute-sim's engine as the bench starts it for `w`: `num_blocks`
    /// blocks of 16 tokens, `--max-model-len` as the bench computes it, and
    /// step costs divided by `time_scale` (what `--time-scale` does).
    pub fn scenario(&self, w: &Workload, workers: usize, num_blocks: u32, time_scale: f64) -> Scenario {
        let mut s = Scenario::new(workers, 1, self.seed);
        s.engine.num_blocks = num_blocks;
        let longest = w.requests.iter().map(|r| r.prompt.len() + r.max_tokens as usize).max().unwrap_or(0);
        s.engine.max_model_len = (longest + 16).max(32_768);
        s.engine.cost.overhead_us /= time_scale;
        s.engine.cost.prefill_us_per_token /= time_scale;
        s.engine.cost.decode_us_per_seq /= time_scale;
        s.path = self.path;
        s
    }
}

/// The fields of a `kvroute-bench compare` record this check reads.
#[derive(Clone, Debug, Deserialize)]
pub struct BenchRun {
    #[serde(default = "sim")]
    pub engine: String,
    pub workload: String,
    pub policy: String,
    pub workers: usize,
    pub routers: usize,
    pub sidecars: bool,
    pub hit_rate: f64,
    pub ceiling: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub num_blocks: u32,
    pub time_scale: f64,
    pub requests: usize,
    pub errors: usize,
    #[serde(default)]
    pub router_config: Option<String>,
    #[serde(default = "one")]
    pub round: usize,
}

fn sim() -> String {
    "sim".into()
}

fn one() -> usize {
    1
}

#[derive(Debug, thiserror::Error)]
pub enum CrosscheckError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a kvroute-bench compare results.json: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} has no trace run on simulated engines with 1 router and sidecars (run `kvroute-bench compare --trace FILE`)"
    )]
    NoTraceRuns { path: PathBuf },
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
}

/// The trace runs of a bench compare output folder that the lab can replay:
/// simulated engines, one router, sidecars, the router's own configuration.
pub fn read_bench(dir: &Path) -> Result<Vec<BenchRun>, CrosscheckError> {
    let path = dir.join("results.json");
    let text = std::fs::read_to_string(&path).map_err(|source| CrosscheckError::Read { path: path.clone(), source })?;
    let mut json: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| CrosscheckError::Parse { path: path.clone(), source })?;
    // `{"run": …, "results": [...]}`, or a bare list from before the run header.
    let records = json.get_mut("results").map(serde_json::Value::take).unwrap_or(json);
    let runs: Vec<BenchRun> =
        serde_json::from_value(records).map_err(|source| CrosscheckError::Parse { path: path.clone(), source })?;
    let runs: Vec<BenchRun> = runs
        .into_iter()
        .filter(|r| {
            r.engine == "sim" && r.workload == "trace" && r.routers == 1 && r.sidecars && r.router_config.is_none()
        })
        .collect();
    if runs.is_empty() {
        return Err(CrosscheckError::NoTraceRuns { path });
    }
    Ok(runs)
}

/// One policy and worker count: the bench's figures (median over its
/// rounds) against the lab's.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub policy: String,
    pub workers: usize,
    pub requests: usize,
    pub bench_rounds: usize,
    pub bench_errors: usize,
    pub bench_hit: f64,
    pub lab_hit: f64,
    pub bench_ceiling: f64,
    pub lab_ceiling: f64,
    pub bench_p50_ms: f64,
    pub lab_p50_ms: f64,
    pub bench_p99_ms: f64,
    pub lab_p99_ms: f64,
    /// The share of the lab's requests whose TTFT is at most the bench's
    /// p50: near 0.5 when the two distributions agree at their middle, even
    /// where the p50s differ because the median falls in a gap between fast
    /// (cache hit) and slow answers.
    pub lab_share_under_bench_p50: f64,
    /// Most requests in flight at once in the lab (the bench caps it at 64).
    pub lab_max_inflight: usize,
    /// Largest difference between a request's arrival in the bench's request
    /// log and in the lab, ms; `None` when no log was found.
    pub arrival_max_diff_ms: Option<f64>,
    /// Whether every logged prompt length equals the lab's.
    pub prompts_match: Option<bool>,
}

impl Row {
    pub fn hit_diff(&self) -> f64 {
        self.lab_hit - self.bench_hit
    }

    /// Lab TTFT p50 relative to the bench's: +0.1 is 10 % higher.
    pub fn p50_rel(&self) -> f64 {
        if self.bench_p50_ms > 0.0 { self.lab_p50_ms / self.bench_p50_ms - 1.0 } else { f64::INFINITY }
    }

    pub fn hit_ok(&self) -> bool {
        self.hit_diff().abs() <= HIT_TOLERANCE
    }

    pub fn p50_ok(&self) -> bool {
        self.p50_rel().abs() <= TTFT_TOLERANCE
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[mid],
        _ => (v[mid - 1] + v[mid]) / 2.0,
    }
}

/// The share of requests that had a first token within `ms` of arriving.
fn share_under(records: &[crate::measure::RequestRecord], ms: f64) -> f64 {
    let under = records
        .iter()
        .filter(|r| r.first_token.is_some_and(|t| t.saturating_sub(r.arrival).0 as f64 / 1e3 <= ms))
        .count();
    under as f64 / records.len().max(1) as f64
}

/// Most requests in flight at once (arrival to answer).
fn max_inflight(records: &[crate::measure::RequestRecord]) -> usize {
    let mut edges: Vec<(Micros, i32)> = Vec::with_capacity(records.len() * 2);
    for r in records {
        edges.push((r.arrival, 1));
        edges.push((r.done.unwrap_or(r.arrival), -1));
    }
    // Ends before starts at the same instant.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    most as usize
}

/// Arrival times (ms) and prompt lengths from a bench request log, if any.
fn bench_log(dir: &Path, policy: &str, workers: usize) -> Option<Vec<(f64, usize)>> {
    let names = [format!("trace_{policy}_w{workers}_r1.jsonl"), format!("trace_{policy}_w{workers}_r1_round1.jsonl")];
    let text = names.iter().find_map(|n| std::fs::read_to_string(dir.join("requests").join(n)).ok())?;
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((v["arrival_ms"].as_f64()?, v["prompt_tokens"].as_u64()? as usize))
        })
        .collect()
}

/// One JSON line per request in the bench's request-log format (worker,
/// TTFT, latency), plus what the engine served from its cache, for looking
/// behind the percentiles request by request.
fn lab_log(records: &[crate::measure::RequestRecord]) -> String {
    let ms = |t: Option<Micros>, from: Micros| t.map(|t| t.saturating_sub(from).0 as f64 / 1e3);
    let mut text = String::new();
    for (i, r) in records.iter().enumerate() {
        let line = serde_json::json!({
            "i": i,
            "arrival_ms": r.arrival.0 as f64 / 1e3,
            "prompt_tokens": r.prompt_tokens,
            "worker": format!("w{}", r.worker + 1),
            "ttft_ms": ms(r.first_token, r.arrival),
            "latency_ms": ms(r.done, r.arrival),
            "cached_tokens": r.cached_tokens,
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    text
}

/// Replays every (policy, worker count) of the bench run in `dir` in the
/// lab; with `requests_out`, writes each replay's request log there.
pub fn check(
    dir: &Path,
    replay: &Replay,
    requests_out: Option<&Path>,
    mut progress: impl FnMut(&Row),
) -> Result<Vec<Row>, CrosscheckError> {
    let runs = read_bench(dir)?;
    let mut keys: Vec<(String, usize)> = Vec::new();
    for r in &runs {
        if !keys.iter().any(|(p, w)| *p == r.policy && *w == r.workers) {
            keys.push((r.policy.clone(), r.workers));
        }
    }
    let mut rows = Vec::new();
    for (policy, workers) in keys {
        let rs: Vec<&BenchRun> = runs.iter().filter(|r| r.policy == policy && r.workers == workers).collect();
        let first = rs[0];
        let w = replay.workload(first.requests)?;
        let s = replay.scenario(&w, workers, first.num_blocks, first.time_scale);
        let lab = run(&s, &w, &factory(&policy)?);
        let log = bench_log(dir, &policy, workers);
        if let Some(out) = requests_out {
            let path = out.join(format!("lab_trace_{policy}_w{workers}.jsonl"));
            std::fs::create_dir_all(out)
                .and_then(|()| std::fs::write(&path, lab_log(&lab.records)))
                .map_err(|source| CrosscheckError::Write { path, source })?;
        }
        let row = Row {
            policy: policy.clone(),
            workers,
            requests: first.requests,
            bench_rounds: rs.len(),
            bench_errors: rs.iter().map(|r| r.errors).sum(),
            bench_hit: median(rs.iter().map(|r| r.hit_rate).collect()),
            lab_hit: lab.engine_hit_rate,
            bench_ceiling: first.ceiling,
            lab_ceiling: lab.summary.ceiling,
            bench_p50_ms: median(rs.iter().map(|r| r.ttft_p50_ms).collect()),
            lab_p50_ms: lab.summary.ttft_p50_ms,
            bench_p99_ms: median(rs.iter().map(|r| r.ttft_p99_ms).collect()),
            lab_p99_ms: lab.summary.ttft_p99_ms,
            lab_max_inflight: max_inflight(&lab.records),
            lab_share_under_bench_p50: share_under(&lab.records, median(rs.iter().map(|r| r.ttft_p50_ms).collect())),
            arrival_max_diff_ms: log
                .as_ref()
                .map(|l| l.iter().zip(&w.requests).map(|(b, r)| (b.0 - r.at.0 as f64 / 1e3).abs()).fold(0.0, f64::max)),
            prompts_match: log
                .as_ref()
                .map(|l| l.len() == w.requests.len() && l.iter().zip(&w.requests).all(|(b, r)| b.1 == r.prompt.len())),
        };
        progress(&row);
        rows.push(row);
    }
    Ok(rows)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "pass" } else { "**FAIL**" }
}

/// The comparison as a Markdown table.
pub fn markdown(rows: &[Row], replay: &Replay) -> String {
    let mut md = format!(
        "Lab request path: {}.\n\n",
        if replay.path == PathModel::default() {
            "none (requests reach their engine as they are routed)".to_owned()
        } else {
            format!(
                "{} µs + {} ns per prompt token ahead of the engine",
                replay.path.fixed_us, replay.path.ns_per_token
            )
        }
    );
    md.push_str(
        "| policy | workers | requests | hit rate bench | lab | Δ | ≤ 0.02 | TTFT p50 bench ms | lab ms | Δ | ≤ 15 % | \
         lab share ≤ bench p50 | TTFT p99 bench ms | lab ms | ceiling bench / lab |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:+.3} | {} | {:.1} | {:.1} | {:+.1} % | {} | {:.3} | {:.1} | {:.1} | {:.3} / {:.3} |\n",
            r.policy,
            r.workers,
            r.requests,
            r.bench_hit,
            r.lab_hit,
            r.hit_diff(),
            verdict(r.hit_ok()),
            r.bench_p50_ms,
            r.lab_p50_ms,
            r.p50_rel() * 100.0,
            verdict(r.p50_ok()),
            r.lab_share_under_bench_p50,
            r.bench_p99_ms,
            r.lab_p99_ms,
            r.bench_ceiling,
            r.lab_ceiling,
        ));
    }
    md.push('\n');
    for r in rows {
        let same = match (r.arrival_max_diff_ms, r.prompts_match) {
            (Some(d), Some(p)) => format!(
                "arrivals within {d:.2} ms of the bench's request log, prompt lengths {}",
                if p { "all equal" } else { "**differ**" }
            ),
            _ => "no bench request log to check arrivals against".into(),
        };
        md.push_str(&format!(
            "- {} w{}: bench {} round(s), {} errors; lab at most {} in flight; {same}.\n",
            r.policy, r.workers, r.bench_rounds, r.bench_errors, r.lab_max_inflight
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::default_trace_path;

    fn replay() -> Replay {
        Replay {
            trace: default_trace_path(),
            speedup: 20.0,
            skip: 0,
            max_output: 16,
            seed: 1,
            path: PathModel::default(),
        }
    }

    #[test]
    fn the_replay_squeezes_time_and_caps_outputs_as_the_bench_does() {
        let w = replay().workload(50).unwrap();
        let full = Workload::generate(
            WorkloadKind::Trace,
            &Shape {
                requests: 50,
                seed: 1,
                cluster_kv_tokens: 0,
                trace_path: default_trace_path(),
                closed_loop: false,
            },
        )
        .unwrap();
        assert_eq!(w.requests.len(), 50);
        for (a, b) in w.requests.iter().zip(&full.requests) {
            assert_eq!(a.prompt, b.prompt);
            assert_eq!(a.max_tokens, b.max_tokens.min(16));
            assert!((a.at.0 as f64 - b.at.0 as f64 / 20.0).abs() <= 1.0);
        }
        let later = Replay { skip: 30, ..replay() }.workload(20).unwrap();
        assert_eq!(later.requests[0].at, Micros::ZERO);
        assert_eq!(later.requests[0].prompt, full.requests[30].prompt);
        assert_eq!(later.requests[19].prompt, full.requests[49].prompt);
        let s = replay().scenario(&w, 4, 1_000, 20.0);
        assert_eq!((s.workers, s.routers, s.engine.num_blocks), (4, 1, 1_000));
        assert_eq!(s.engine.cost.prefill_us_per_token, 70.0 / 20.0);
        assert!(s.engine.max_model_len >= w.requests.iter().map(|r| r.prompt.len()).max().unwrap());
        assert_eq!(s.path, PathModel::default(), "no request-path delay unless asked");
    }

    #[test]
    fn reads_the_bench_and_replays_its_runs() {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-crosscheck-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("requests")).unwrap();
        let w = replay().workload(60).unwrap();
        let rec = |policy: &str, round: usize, p50: f64| {
            serde_json::json!({"engine": "sim", "workload": "trace", "policy": policy, "workers": 2, "routers": 1,
                "sidecars": true, "hit_rate": 0.4, "ceiling": 0.5, "ttft_p50_ms": p50, "ttft_p90_ms": 1.0,
                "ttft_p99_ms": 1.0, "ttft_mean_ms": 1.0, "latency_p50_ms": 1.0, "throughput_rps": 1.0,
                "max_mean_load": 1.0, "requests": 60, "errors": 0, "per_worker": {}, "num_blocks": 20_000,
                "time_scale": 20.0, "wall_s": 1.0, "router_config": null, "round": round})
        };
        let other = serde_json::json!({"workload": "chat", "policy": "round_robin", "workers": 2, "routers": 1,
            "sidecars": true, "hit_rate": 0.4, "ceiling": 0.5, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0,
            "num_blocks": 1, "time_scale": 1.0, "requests": 1, "errors": 0});
        let results = serde_json::json!({"run": {}, "results": [
            rec("round_robin", 1, 10.0), rec("round_robin", 2, 30.0), rec("round_robin", 3, 20.0), other]});
        std::fs::write(dir.join("results.json"), results.to_string()).unwrap();
        let log: String = w
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                format!(
                    "{}\n",
                    serde_json::json!({"i": i, "arrival_ms": r.at.0 as f64 / 1e3, "prompt_tokens": r.prompt.len()})
                )
            })
            .collect();
        std::fs::write(dir.join("requests/trace_round_robin_w2_r1_round1.jsonl"), log).unwrap();
        let rows = check(&dir, &replay(), Some(&dir.join("lab")), |_| {}).unwrap();
        let lab_log = std::fs::read_to_string(dir.join("lab/lab_trace_round_robin_w2.jsonl")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(lab_log.lines().count(), 60);
        assert_eq!(rows.len(), 1, "the chat run is not replayed");
        let r = &rows[0];
        assert_eq!((r.bench_rounds, r.bench_p50_ms), (3, 20.0), "the median of the bench's rounds");
        assert_eq!((r.arrival_max_diff_ms, r.prompts_match), (Some(0.0), Some(true)));
        assert!(r.lab_p50_ms > 0.0 && r.lab_hit >= 0.0 && r.lab_max_inflight >= 1);
        assert!(r.lab_ceiling > 0.0, "line 50 of the trace shares blocks with an earlier line");
        assert!(markdown(&rows, &replay()).contains("| round_robin | 2 | 60 | 0.400 |"));
        assert!((0.0..=1.0).contains(&r.lab_share_under_bench_p50));
    }

    #[test]
    fn tolerances_are_the_issues() {
        let mut r = Row {
            policy: "p".into(),
            workers: 4,
            requests: 1,
            bench_rounds: 1,
            bench_errors: 0,
            bench_hit: 0.50,
            lab_hit: 0.515,
            bench_ceiling: 0.6,
            lab_ceiling: 0.6,
            bench_p50_ms: 100.0,
            lab_p50_ms: 114.0,
            bench_p99_ms: 1.0,
            lab_p99_ms: 1.0,
            lab_share_under_bench_p50: 0.5,
            lab_max_inflight: 1,
            arrival_max_diff_ms: None,
            prompts_match: None,
        };
        assert!(r.hit_ok() && r.p50_ok());
        r.lab_hit = 0.475;
        r.lab_p50_ms = 84.0;
        assert!(!r.hit_ok() && !r.p50_ok());
    }
}
