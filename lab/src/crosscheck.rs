//! The lab checked against the process-level bench (issue 12): a
//! `kvroute-bench compare` run replayed in virtual time, request for
//! request, and the two tools' hit rate and TTFT side by side.
//!
//! Every bench workload is replayed from the export the bench writes beside
//! its request logs (`requests/WORKLOAD_prompts.jsonl`, see the bench's
//! `workload::export`): each request's arrival, the request it follows and
//! its think time (closed loop), its output cap, its prompt length and its
//! prompt's full blocks as ids. The lab gives each block id its own tokens,
//! so its prompts share exactly the blocks the bench's did, and runs the
//! closed loop itself: a turn is sent its think time after the lab's answer.
//!
//! Bench runs from before the export are replayed only for the Mooncake
//! trace, which both tools read from the same file with the same meaning
//! (each hash id a 512-token block, the last one cut to `input_length`), so
//! the same lines give the same prompts' sharing structure, block for
//! block. What the bench does to it is done here too:
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
use crate::prompt::{Prompt, Segment};
use crate::time::Micros;
use crate::workload::{RequestSpec, Shape, Turn, Workload, WorkloadError, WorkloadKind, seg};

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
    /// A bench run of the same workloads with engines that take no time
    /// (`--time-scale 100000`): its TTFTs are the path alone, and each
    /// request's median over that run's policies becomes its path delay
    /// (replacing `path`).
    pub path_from: Option<PathBuf>,
}

impl Default for Replay {
    /// The bench's trace defaults (the public trace, arrivals ×20, outputs
    /// capped at 16 tokens), no request path.
    fn default() -> Self {
        Replay {
            trace: crate::workload::default_trace_path(),
            speedup: 20.0,
            skip: 0,
            max_output: 16,
            seed: 1,
            path: PathModel::default(),
            path_from: None,
        }
    }
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

    /// Tokens per KV block of the lab's engines, which is the bench's
    /// simulated engines' too.
    pub fn block_size(&self) -> usize {
        Scenario::new(1, 1, self.seed).engine.block_size.get()
    }

    /// kvroute-sim's engine as the bench starts it for `w`: `num_blocks`
    /// blocks of 16 tokens, `--max-model-len` as the bench computes it, and
    /// step costs divided by `time_scale` (what `--time-scale` does).
    pub fn scenario(&self, w: &Workload, workers: usize, routers: usize, num_blocks: u32, time_scale: f64) -> Scenario {
        let mut s = Scenario::new(workers, routers, self.seed);
        s.alternate_routers = true;
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
        "{path} has no run the lab can replay: simulated engines, sidecars, and the workload's \
         requests/WORKLOAD_prompts.jsonl (written by kvroute-bench compare) or the Mooncake trace"
    )]
    NoRuns { path: PathBuf },
    #[error("{path} line {line}: {detail}")]
    Export { path: PathBuf, line: usize, detail: String },
    #[error("--path-from {dir}: {detail}")]
    PathFrom { dir: PathBuf, detail: String },
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
}

/// The runs of a bench compare output folder that the lab can replay:
/// simulated engines, at least one router replica, sidecars, the router's
/// own configuration, and a workload the bench exported (or the trace).
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
            r.engine == "sim"
                && (r.workload == "trace" || export_path(dir, &r.workload).is_file())
                && r.routers > 0
                && r.sidecars
                && r.router_config.is_none()
        })
        .collect();
    if runs.is_empty() {
        return Err(CrosscheckError::NoRuns { path });
    }
    Ok(runs)
}

fn export_path(dir: &Path, workload: &str) -> PathBuf {
    dir.join("requests").join(format!("{workload}_prompts.jsonl"))
}

/// One line of the bench's workload export (the bench's
/// `workload::export::ExportedRequest`).
#[derive(Deserialize)]
struct Exported {
    arrival_ms: f64,
    after: Option<usize>,
    think_ms: f64,
    max_tokens: u32,
    prompt_tokens: usize,
    blocks: Vec<u32>,
}

const EXPORT_BLOCK: u64 = 0x6578_706f_7274_0000;
const EXPORT_TAIL: u64 = 0x6578_706f_7274_0001;

/// The bench's exported workload `name` from `dir`, as lab requests of
/// `block`-token blocks: one segment per block id (equal ids, equal tokens)
/// and one for the partial block at the end, which no engine caches. A turn
/// that follows another waits for its answer, as in the bench.
pub fn exported_workload(dir: &Path, name: &str, block: usize) -> Result<Workload, CrosscheckError> {
    let path = export_path(dir, name);
    let text = std::fs::read_to_string(&path).map_err(|source| CrosscheckError::Read { path: path.clone(), source })?;
    let bad = |line: usize, detail: String| CrosscheckError::Export { path: path.clone(), line, detail };
    let mut requests: Vec<RequestSpec> = Vec::new();
    let mut followed = std::collections::HashSet::new();
    let mut last_open = Micros::ZERO;
    for (i, l) in text.lines().enumerate() {
        let e: Exported = serde_json::from_str(l).map_err(|err| bad(i + 1, err.to_string()))?;
        let full = e.blocks.len() * block;
        if e.prompt_tokens == 0 {
            return Err(bad(i + 1, "an empty prompt".into()));
        }
        if full > e.prompt_tokens || e.prompt_tokens >= full + block {
            return Err(bad(
                i + 1,
                format!("{} blocks do not fit {} tokens in {block}-token blocks", e.blocks.len(), e.prompt_tokens),
            ));
        }
        if !(e.arrival_ms.is_finite() && e.arrival_ms >= 0.0 && e.think_ms.is_finite() && e.think_ms >= 0.0) {
            return Err(bad(i + 1, "arrival and think times must be finite and ≥ 0".into()));
        }
        let mut segments: Vec<Segment> =
            e.blocks.iter().map(|&b| seg(0, EXPORT_BLOCK, u64::from(b), block as u64)).collect();
        if e.prompt_tokens > full {
            segments.push(seg(0, EXPORT_TAIL, i as u64, (e.prompt_tokens - full) as u64));
        }
        let think = Micros((e.think_ms * 1e3).round() as u64);
        let mut spec =
            RequestSpec::new(Micros((e.arrival_ms * 1e3).round() as u64), Prompt(segments), e.max_tokens.max(1));
        match e.after {
            Some(prev) => {
                let before = requests
                    .get(prev)
                    .filter(|_| prev < i)
                    .ok_or_else(|| bad(i + 1, format!("follows request {prev}, which does not come before it")))?;
                // A session is a chain: the lab sends one next turn per answer.
                if !followed.insert(prev) {
                    return Err(bad(i + 1, format!("request {prev} already has a next turn")));
                }
                let (session, index) = before.turn.map_or((prev as u64, 1), |t| (t.session, t.index + 1));
                spec.at = before.at + think;
                spec.turn = Some(Turn { session, index, think });
                spec.after = Some(prev as u32);
            }
            None => {
                if spec.at < last_open {
                    return Err(bad(i + 1, "arrivals out of order".into()));
                }
                last_open = spec.at;
                spec.turn = Some(Turn { session: i as u64, index: 0, think: Micros::ZERO });
            }
        }
        requests.push(spec);
    }
    if requests.is_empty() {
        return Err(bad(0, "no requests".into()));
    }
    let kind = match name {
        "trace" => WorkloadKind::Trace,
        "chat" => WorkloadKind::Chat,
        // rag and shared_prefix: a few shared documents, many questions.
        _ => WorkloadKind::Rag,
    };
    Ok(Workload { kind, requests })
}

/// One workload, policy, worker count and router count: the bench's
/// figures (median over its rounds) against the lab's.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub workload: String,
    pub policy: String,
    pub workers: usize,
    /// Router replicas; request `i` goes to replica `i mod routers` in both
    /// tools.
    pub routers: usize,
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
    /// Largest difference between when the bench sent a request (its
    /// request log) and when it arrived in the lab, ms, over the requests
    /// that follow no other (a closed loop's later turns wait for each
    /// tool's own answers); `None` when no log was found.
    pub arrival_max_diff_ms: Option<f64>,
    /// Whether every logged prompt length equals the lab's.
    pub prompts_match: Option<bool>,
    /// Median over requests of the bench's TTFT minus the lab's for the same
    /// request (every round of the bench's logs); `None` without logs.
    pub per_request_offset_ms: Option<f64>,
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

/// One request of a bench request log: a line per request, in workload
/// order, so line `i` is request `i` (a failed request's line has no times).
#[derive(Clone, Copy, Debug, Default)]
struct Logged {
    /// When it was sent, ms (the scheduled arrival in logs from before the
    /// bench recorded when it sent); `None` for a request that failed.
    at: Option<f64>,
    prompt_tokens: Option<usize>,
    /// `None` for a request that failed.
    ttft_ms: Option<f64>,
}

/// A bench request log, one entry per line (a line that is not JSON gives
/// an empty entry, so the entries stay aligned with the requests).
fn parse_log(text: &str) -> Vec<Logged> {
    text.lines()
        .map(|l| {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { return Logged::default() };
            Logged {
                at: v["sent_ms"].as_f64().or_else(|| v["arrival_ms"].as_f64()),
                prompt_tokens: v["prompt_tokens"].as_u64().map(|n| n as usize),
                ttft_ms: v["ttft_ms"].as_f64(),
            }
        })
        .collect()
}

/// The bench's request logs of one run, one per round (`None` if there is
/// none).
fn bench_logs(
    dir: &Path,
    workload: &str,
    policy: &str,
    workers: usize,
    routers: usize,
    rounds: usize,
) -> Option<Vec<Vec<Logged>>> {
    let base = format!("{workload}_{policy}_w{workers}_r{routers}");
    let names: Vec<String> = std::iter::once(format!("{base}.jsonl"))
        .chain((1..=rounds.max(1)).map(|k| format!("{base}_round{k}.jsonl")))
        .collect();
    let logs: Vec<Vec<Logged>> = names
        .iter()
        .filter_map(|n| std::fs::read_to_string(dir.join("requests").join(n)).ok())
        .map(|text| parse_log(&text))
        .collect();
    (!logs.is_empty()).then_some(logs)
}

/// The median over requests (and the bench's rounds) of the bench's TTFT
/// minus the lab's for the same request: what the lab leaves out if the two
/// differ by a constant (the request path), where the p50s of a bimodal
/// distribution can differ by far more.
fn per_request_offset_ms(logs: &[Vec<Logged>], records: &[crate::measure::RequestRecord]) -> Option<f64> {
    let mut diffs = Vec::new();
    for log in logs {
        for (b, r) in log.iter().zip(records) {
            if let (Some(bench), Some(first)) = (b.ttft_ms, r.first_token) {
                diffs.push(bench - first.saturating_sub(r.arrival).0 as f64 / 1e3);
            }
        }
    }
    (!diffs.is_empty()).then(|| median(diffs))
}

/// Per request of `w`, the median TTFT over every request log of
/// `workload` on `workers` workers in the bench run `dir` (one router): with
/// engines that take no time, that is the request path alone.
pub fn measured_path(dir: &Path, workload: &str, workers: usize, w: &Workload) -> Result<Vec<Micros>, CrosscheckError> {
    let bad = |detail: String| CrosscheckError::PathFrom { dir: dir.to_owned(), detail };
    let logs = dir.join("requests");
    let prefix = format!("{workload}_");
    let suffix = format!("_w{workers}_r1");
    let mut per_request: Vec<Vec<f64>> = vec![Vec::new(); w.requests.len()];
    let entries = std::fs::read_dir(&logs).map_err(|e| bad(format!("{}: {e}", logs.display())))?;
    let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    let mut read = 0;
    for name in names {
        let Some(stem) = name.strip_suffix(".jsonl") else { continue };
        // `…_r1_round2` is round 2 of `…_r1` (and `round_robin` is a policy).
        let stem = match stem.rsplit_once("_round") {
            Some((run, k)) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) => run,
            _ => stem,
        };
        if !(stem.starts_with(&prefix) && stem.ends_with(&suffix)) || stem.contains("nosidecars") {
            continue;
        }
        let text = std::fs::read_to_string(logs.join(&name)).map_err(|e| bad(format!("{name}: {e}")))?;
        let lines = parse_log(&text);
        let same = lines.len() == w.requests.len()
            && lines.iter().zip(&w.requests).all(|(l, r)| l.prompt_tokens == Some(r.prompt.len()));
        if !same {
            return Err(bad(format!(
                "{name} is not the same {workload} workload (request count or prompt lengths differ)"
            )));
        }
        for (l, samples) in lines.iter().zip(&mut per_request) {
            samples.extend(l.ttft_ms);
        }
        read += 1;
    }
    if read == 0 {
        return Err(bad(format!("no request log of {workload} on {workers} workers with 1 router")));
    }
    // A request that failed in every log gets the median of the others.
    let overall = median(per_request.iter().flatten().copied().collect());
    Ok(per_request
        .into_iter()
        .map(|v| Micros((if v.is_empty() { overall } else { median(v) } * 1e3).round() as u64))
        .collect())
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

/// How `kvroute-bench compare --peers` names the runs of other routers.
const PEER_PREFIX: &str = "peer:";

/// Replays every (policy, worker count) of the bench run in `dir` in the
/// lab; with `requests_out`, writes each replay's request log there.
pub fn check(
    dir: &Path,
    replay: &Replay,
    requests_out: Option<&Path>,
    mut progress: impl FnMut(&Row),
) -> Result<Vec<Row>, CrosscheckError> {
    let mut runs = read_bench(dir)?;
    // Other routers (`compare --peers`): the lab runs only kvroute's policies.
    let before = runs.len();
    runs.retain(|r| !r.policy.starts_with(PEER_PREFIX));
    if runs.len() < before {
        eprintln!(
            "crosscheck: {} runs of other routers (`{PEER_PREFIX}…`) left out: the lab runs kvroute's policies",
            before - runs.len()
        );
    }
    let mut keys: Vec<(String, String, usize, usize)> = Vec::new();
    for r in &runs {
        let key = (r.workload.clone(), r.policy.clone(), r.workers, r.routers);
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let mut rows = Vec::new();
    let mut workloads: std::collections::HashMap<(String, usize), Workload> = std::collections::HashMap::new();
    for (workload, policy, workers, routers) in keys {
        let rs: Vec<&BenchRun> = runs
            .iter()
            .filter(|r| r.workload == workload && r.policy == policy && r.workers == workers && r.routers == routers)
            .collect();
        let first = rs[0];
        // Read once per workload, not once per policy (a trace export is tens of MB).
        let key = (workload.clone(), first.requests);
        if !workloads.contains_key(&key) {
            let w = if export_path(dir, &workload).is_file() {
                exported_workload(dir, &workload, replay.block_size())?
            } else {
                replay.workload(first.requests)?
            };
            workloads.insert(key.clone(), w);
        }
        let w = &workloads[&key];
        let mut s = replay.scenario(w, workers, routers, first.num_blocks, first.time_scale);
        if let Some(from) = &replay.path_from {
            s.measured_path = Some(measured_path(from, &workload, workers, w)?.into());
        }
        let lab = run(&s, w, &factory(&policy)?);
        let logs = bench_logs(dir, &workload, &policy, workers, routers, rs.len());
        let log = logs.as_ref().map(|l| &l[0]);
        if let Some(out) = requests_out {
            let path = out.join(format!("lab_{workload}_{policy}_w{workers}_r{routers}.jsonl"));
            std::fs::create_dir_all(out)
                .and_then(|()| std::fs::write(&path, lab_log(&lab.records)))
                .map_err(|source| CrosscheckError::Write { path, source })?;
        }
        let row = Row {
            workload: workload.clone(),
            policy: policy.clone(),
            workers,
            routers,
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
            arrival_max_diff_ms: log.as_ref().map(|l| {
                l.iter()
                    .zip(w.requests.iter().zip(&lab.records))
                    .filter(|(_, (spec, _))| spec.after.is_none())
                    .filter_map(|(b, (_, rec))| Some((b.at? - rec.arrival.0 as f64 / 1e3).abs()))
                    .fold(0.0, f64::max)
            }),
            prompts_match: log.as_ref().map(|l| {
                l.len() == w.requests.len()
                    && l.iter().zip(&w.requests).all(|(b, r)| b.prompt_tokens == Some(r.prompt.len()))
            }),
            per_request_offset_ms: logs.as_ref().and_then(|l| per_request_offset_ms(l, &lab.records)),
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
        if let Some(from) = &replay.path_from {
            format!(
                "each request's median TTFT in the bench run {} (engines that take no time), ahead of the engine",
                from.display()
            )
        } else if replay.path == PathModel::default() {
            "none (requests reach their engine as they are routed)".to_owned()
        } else {
            format!(
                "{} µs + {} ns per prompt token ahead of the engine",
                replay.path.fixed_us, replay.path.ns_per_token
            )
        }
    );
    md.push_str(
        "| workload | policy | workers | routers | requests | hit rate bench | lab | Δ | ≤ 0.02 | TTFT p50 bench ms | lab ms | Δ | \
         ≤ 15 % | lab share ≤ bench p50 | bench − lab per request, median ms | TTFT p99 bench ms | lab ms | \
         ceiling bench / lab |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:+.3} | {} | {:.1} | {:.1} | {:+.1} % | {} | {:.3} | {} | {:.1} | {:.1} | {:.3} / {:.3} |\n",
            r.workload,
            r.policy,
            r.workers,
            r.routers,
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
            r.per_request_offset_ms.map_or("–".to_owned(), |d| format!("{d:+.2}")),
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
                "arrivals of requests that follow no other within {d:.2} ms of the bench's request log, prompt lengths {}",
                if p { "all equal" } else { "**differ**" }
            ),
            _ => "no bench request log to check arrivals against".into(),
        };
        md.push_str(&format!(
            "- {} {} w{} r{}: bench {} round(s), {} errors; lab at most {} in flight; {same}.\n",
            r.workload, r.policy, r.workers, r.routers, r.bench_rounds, r.bench_errors, r.lab_max_inflight
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::default_trace_path;

    fn replay() -> Replay {
        Replay::default()
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
        let s = replay().scenario(&w, 4, 1, 1_000, 20.0);
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
        let lab_log = std::fs::read_to_string(dir.join("lab/lab_trace_round_robin_w2_r1.jsonl")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(lab_log.lines().count(), 60);
        assert_eq!(rows.len(), 1, "the chat run is not replayed");
        let r = &rows[0];
        assert_eq!((r.bench_rounds, r.bench_p50_ms), (3, 20.0), "the median of the bench's rounds");
        assert_eq!((r.arrival_max_diff_ms, r.prompts_match), (Some(0.0), Some(true)));
        assert!(r.lab_p50_ms > 0.0 && r.lab_hit >= 0.0 && r.lab_max_inflight >= 1);
        assert!(r.lab_ceiling > 0.0, "line 50 of the trace shares blocks with an earlier line");
        assert!(markdown(&rows, &replay()).contains("| trace | round_robin | 2 | 1 | 60 | 0.400 |"));
        assert!((0.0..=1.0).contains(&r.lab_share_under_bench_p50));
    }

    /// A bench folder holding one chat run of `round_robin` on 2 workers
    /// and the workload's export: 2 users sharing a 4-block system prompt,
    /// each with a second turn that extends the first.
    fn chat_bench(dir: &Path, export: &str) {
        std::fs::create_dir_all(dir.join("requests")).unwrap();
        let rec = serde_json::json!({"engine": "sim", "workload": "chat", "policy": "round_robin", "workers": 2,
            "routers": 1, "sidecars": true, "hit_rate": 0.4, "ceiling": 0.5, "ttft_p50_ms": 5.0,
            "ttft_p99_ms": 9.0, "num_blocks": 2_000, "time_scale": 1.0, "requests": 4, "errors": 0});
        std::fs::write(dir.join("results.json"), serde_json::json!({"results": [rec]}).to_string()).unwrap();
        std::fs::write(dir.join("requests/chat_prompts.jsonl"), export).unwrap();
    }

    const CHAT_EXPORT: &str = concat!(
        r#"{"arrival_ms":0.0,"after":null,"think_ms":0.0,"max_tokens":4,"prompt_tokens":70,"blocks":[0,1,2,3]}"#,
        "\n",
        r#"{"arrival_ms":250.0,"after":null,"think_ms":0.0,"max_tokens":4,"prompt_tokens":72,"blocks":[0,1,2,4]}"#,
        "\n",
        r#"{"arrival_ms":0.0,"after":0,"think_ms":300.0,"max_tokens":4,"prompt_tokens":100,"blocks":[0,1,2,3,5,6]}"#,
        "\n",
        r#"{"arrival_ms":0.0,"after":1,"think_ms":50.0,"max_tokens":4,"prompt_tokens":96,"blocks":[0,1,2,4,7,8]}"#,
        "\n",
    );

    #[test]
    fn an_exported_workload_shares_blocks_by_id_and_turns_wait_for_answers() {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-crosscheck-export-{}", std::process::id()));
        chat_bench(&dir, CHAT_EXPORT);
        let w = exported_workload(&dir, "chat", 16).unwrap();
        let tokens: Vec<Vec<u32>> = w.requests.iter().map(|r| r.prompt.tokens()).collect();
        assert_eq!(tokens.iter().map(Vec::len).collect::<Vec<_>>(), vec![70, 72, 100, 96]);
        // Blocks 0–2 are shared by all, block 3 by requests 0 and 2 only.
        assert_eq!(tokens[0][..48], tokens[1][..48]);
        assert_ne!(tokens[0][48..64], tokens[1][48..64]);
        assert_eq!(tokens[0][..64], tokens[2][..64]);
        assert_ne!(tokens[0][64..70], tokens[2][64..70], "partial blocks are never shared");
        assert_eq!((w.requests[2].after, w.requests[3].after), (Some(0), Some(1)));
        assert_eq!(w.requests[3].turn.map(|t| (t.session, t.index, t.think)), Some((1, 1, Micros::from_ms(50))));
        let rows = check(&dir, &replay(), None, |_| {}).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].workload.as_str(), rows[0].requests), ("chat", 4));
        assert!(rows[0].lab_hit > 0.0, "later turns hit the blocks their first turns stored");
        let s = replay().scenario(&w, 2, 1, 2_000, 1.0);
        let lab = run(&s, &w, &factory("round_robin").unwrap());
        for (spec, rec) in w.requests.iter().zip(&lab.records).skip(2) {
            let prev = lab.records[spec.after.unwrap() as usize];
            assert_eq!(rec.arrival, prev.done.unwrap() + spec.turn.unwrap().think, "sent after the previous answer");
        }
    }

    #[test]
    fn runs_of_other_routers_are_left_out() {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-crosscheck-peers-{}", std::process::id()));
        chat_bench(&dir, CHAT_EXPORT);
        let path = dir.join("results.json");
        let mut results: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut peer = results["results"][0].clone();
        peer["policy"] = "peer:smg_cache_aware".into();
        results["results"].as_array_mut().unwrap().push(peer);
        std::fs::write(&path, results.to_string()).unwrap();
        let rows = check(&dir, &replay(), None, |_| {});
        let _ = std::fs::remove_dir_all(&dir);
        let rows = rows.unwrap();
        assert_eq!(rows.iter().map(|r| r.policy.as_str()).collect::<Vec<_>>(), ["round_robin"]);
    }

    #[test]
    fn a_malformed_export_is_refused_with_its_line() {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-crosscheck-bad-{}", std::process::id()));
        let line = |arrival: f64, after: &str, tokens: usize, blocks: &str| {
            format!(
                r#"{{"arrival_ms":{arrival},"after":{after},"think_ms":0.0,"max_tokens":4,"prompt_tokens":{tokens},"blocks":{blocks}}}"#
            )
        };
        let ok = line(0.0, "null", 20, "[0]");
        let cases = [
            (format!("{ok}\n{}", line(1.0, "null", 40, "[0]")), "line 2", "do not fit"),
            (format!("{ok}\n{}", line(1.0, "null", 10, "[0]")), "line 2", "do not fit"),
            (format!("{ok}\n{}", line(1.0, "5", 20, "[0]")), "line 2", "does not come before"),
            (format!("{}\n{ok}", line(9.0, "null", 20, "[0]")), "line 2", "out of order"),
            (
                format!("{ok}\n{}\n{}", line(0.0, "0", 20, "[0]"), line(0.0, "0", 20, "[0]")),
                "line 3",
                "already has a next turn",
            ),
            (line(0.0, "null", 0, "[]"), "line 1", "an empty prompt"),
            ("{\"arrival_ms\": 1}".to_owned(), "line 1", "missing field"),
        ];
        for (export, at, why) in cases {
            chat_bench(&dir, &export);
            let e = exported_workload(&dir, "chat", 16).unwrap_err().to_string();
            assert!(e.contains(at) && e.contains(why), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_per_request_offset_pairs_each_bench_request_with_the_labs() {
        use crate::measure::RequestRecord;
        let record = |arrival_ms: u64, ttft_ms: u64| RequestRecord {
            arrival: Micros::from_ms(arrival_ms),
            first_token: Some(Micros::from_ms(arrival_ms + ttft_ms)),
            ..RequestRecord::default()
        };
        // The lab answers in 1, 2 and 30 ms; the bench 2 ms later each time,
        // except one failure.
        let records = [record(0, 1), record(5, 2), record(9, 30)];
        let logged = |ttft_ms: Option<f64>| Logged { at: Some(0.0), prompt_tokens: Some(1), ttft_ms };
        let round1 = vec![logged(Some(3.0)), logged(Some(4.0)), logged(Some(32.0))];
        let round2 = vec![logged(Some(3.0)), logged(None), logged(Some(32.0))];
        assert_eq!(per_request_offset_ms(&[round1, round2], &records), Some(2.0));
        // A failed request's line (no times) keeps the lines after it on
        // their own requests.
        let log = parse_log(concat!(
            r#"{"i":0,"arrival_ms":0.0,"sent_ms":0.5,"prompt_tokens":10,"ttft_ms":3.0}"#,
            "\n",
            r#"{"i":1,"prompt_tokens":20,"error":"boom"}"#,
            "\n",
            r#"{"i":2,"arrival_ms":9.0,"prompt_tokens":30,"ttft_ms":32.0}"#,
        ));
        assert_eq!(log.len(), 3);
        assert_eq!((log[0].at, log[1].at, log[2].at), (Some(0.5), None, Some(9.0)));
        assert_eq!(log[2].prompt_tokens, Some(30));
        assert_eq!(per_request_offset_ms(&[log], &records), Some(2.0));
        assert_eq!(per_request_offset_ms(&[vec![logged(None)]], &records), None);
    }

    #[test]
    fn a_measured_path_is_each_requests_median_ttft_with_instant_engines() {
        let dir = std::env::temp_dir().join(format!("kvroute-lab-crosscheck-path-{}", std::process::id()));
        chat_bench(&dir, CHAT_EXPORT);
        let w = exported_workload(&dir, "chat", 16).unwrap();
        let log = |ttfts: [Option<f64>; 4], tokens: [usize; 4]| -> String {
            ttfts
                .iter()
                .zip(tokens)
                .map(|(t, n)| format!("{}\n", serde_json::json!({"prompt_tokens": n, "ttft_ms": t})))
                .collect()
        };
        let tokens = [70, 72, 100, 96];
        let requests = dir.join("requests");
        std::fs::write(
            requests.join("chat_round_robin_w2_r1.jsonl"),
            log([Some(1.0), Some(2.0), None, Some(4.0)], tokens),
        )
        .unwrap();
        std::fs::write(
            requests.join("chat_predicted_ttft_w2_r1_round1.jsonl"),
            log([Some(3.0), Some(2.0), None, Some(6.0)], tokens),
        )
        .unwrap();
        // Another worker count and the variant without sidecars are not read.
        std::fs::write(requests.join("chat_round_robin_w4_r1.jsonl"), log([Some(99.0); 4], tokens)).unwrap();
        std::fs::write(requests.join("chat_round_robin_w2_r1_nosidecars.jsonl"), log([Some(99.0); 4], tokens)).unwrap();
        let path = measured_path(&dir, "chat", 2, &w);
        let missing = measured_path(&dir, "chat", 8, &w).map(|_| ()).unwrap_err().to_string();
        std::fs::write(requests.join("chat_cache_aware_w2_r1.jsonl"), log([Some(1.0); 4], [70, 72, 100, 95])).unwrap();
        let other = measured_path(&dir, "chat", 2, &w).map(|_| ()).unwrap_err().to_string();
        let _ = std::fs::remove_dir_all(&dir);
        // Medians 2, 2, (failed everywhere: the median of all, 2.5), 5 ms.
        let ms = [2_000, 2_000, 2_500, 5_000].map(Micros);
        assert_eq!(path.unwrap(), ms.to_vec());
        assert!(missing.contains("no request log of chat on 8 workers"), "{missing}");
        assert!(other.contains("not the same chat workload"), "{other}");
    }

    #[test]
    fn tolerances_are_the_issues() {
        let mut r = Row {
            workload: "trace".into(),
            policy: "p".into(),
            workers: 4,
            routers: 1,
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
            per_request_offset_ms: None,
        };
        assert!(r.hit_ok() && r.p50_ok());
        r.lab_hit = 0.475;
        r.lab_p50_ms = 84.0;
        assert!(!r.hit_ok() && !r.p50_ok());
    }
}
