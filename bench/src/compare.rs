//! `kvroute-bench compare`: workloads × policies × worker counts (× router
//! replicas, × sidecars on/off for the default policy), each run starting with cold
//! caches: on a fresh simulated cluster, or (`--engine vllm`) on real vLLM
//! engines started once per workload and worker count, their prefix caches
//! emptied and routers and sidecars started afresh before every run. Per
//! run: token-level prefix hit rate from the engines' counters, the
//! workload's infinite-cache ceiling, client TTFT percentiles, throughput and
//! the load spread across workers. With `--rounds N` the policies run
//! interleaved, round after round ([`plan`]), and the report gives each
//! figure's median and range over rounds ([`spread`]). With `--peers`, SMG
//! and vllm-router run as more policies of the same plan, in front of the
//! same kind of engines with nothing of kvroute's between ([`peer_runs`]).

pub mod plan;
pub mod spread;
pub mod summary;

use kvroute_router::policy::DEFAULT_POLICY;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use kvroute_sim::cluster::worker_id;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ceiling::{self, Ceiling};
use crate::cli::CompareArgs;
use crate::drive::{DriveOptions, drive};
use crate::engine::EngineKind;
use crate::error::BenchError;
use crate::peers::{self, Peer};
use crate::rig::Rig;
use crate::setup::{self, Shape};
use crate::stats::{max_mean_load, mean_ms, percentile_ms};
use crate::vllm::{self, ServeSpec, VllmEngines};
use crate::words::Words;
use crate::workload::{self, Workload, chat, rag, shared_prefix, trace};
use crate::{probe, report};

/// Every policy the router has.
pub const POLICIES: &[&str] = kvroute_router::policy::POLICY_NAMES;

/// Quick mode's default: the default policy and the simplest baseline.
const QUICK_POLICIES: &[&str] = &[DEFAULT_POLICY, "round_robin"];

/// One run's figures; `results.json` is a list of these.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// What served the requests (absent in records older than `--engine`: sim).
    #[serde(default)]
    pub engine: EngineKind,
    pub workload: String,
    pub policy: String,
    pub workers: usize,
    pub routers: usize,
    pub sidecars: bool,
    pub hit_rate: f64,
    pub ceiling: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    pub latency_p50_ms: f64,
    pub throughput_rps: f64,
    pub max_mean_load: f64,
    pub requests: usize,
    pub errors: usize,
    pub per_worker: BTreeMap<String, u64>,
    pub num_blocks: u32,
    pub time_scale: f64,
    pub wall_s: f64,
    /// The `--router-config` file every router ran with, if any.
    pub router_config: Option<String>,
    /// Which round of `--rounds` this run belongs to, from 1 (records older
    /// than `--rounds` are round 1).
    #[serde(default = "first_round")]
    pub round: usize,
    /// The routers' own queueing (`kvroute_dispatch_delay_seconds`: arrival
    /// to first dispatch), p50 and p99 as bucket upper bounds, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_queue_ms: Option<(f64, f64)>,
    /// `--slow-engines`: the first this many workers ran `slow_factor` ×
    /// slower (0 in records older than the flag).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slow_engines: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_factor: Option<f64>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn first_round() -> usize {
    1
}

/// A workload with what the cluster must be sized for, and how its prompts
/// are sent.
struct Prepared {
    workload: Workload,
    ceiling: Ceiling,
    /// `--text-tokenizer`: prompts go as text in these words.
    words: Option<Arc<Words>>,
}

/// Where the public Mooncake trace lives relative to the repo root or this
/// crate, if it is there.
fn default_trace() -> Option<PathBuf> {
    let rel = "shared/testdata/traces/mooncake_synthetic_trace.jsonl";
    [Path::new("..").join(rel), Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)]
        .into_iter()
        .find(|p| p.is_file())
}

fn workloads(args: &CompareArgs) -> Result<Vec<Workload>, BenchError> {
    if args.engine.engine == EngineKind::Vllm {
        return vllm_workloads(args);
    }
    let q = args.quick;
    let trace_params = || {
        let mut p = if q { trace::Params::quick() } else { trace::Params::full() };
        if let Some(s) = args.speedup {
            p.speedup = s;
        }
        if args.limit.is_some() {
            p.limit = args.limit;
        }
        p.skip = args.skip;
        p
    };
    let named = |name: &str| -> Result<Option<Workload>, BenchError> {
        Ok(Some(match name {
            "shared_prefix" => {
                shared_prefix::generate(&if q { shared_prefix::Params::quick() } else { shared_prefix::Params::full() })
            }
            "chat" => chat::generate(&if q { chat::Params::quick() } else { chat::Params::full() }),
            "rag" => rag::generate(&if q { rag::Params::quick() } else { rag::Params::full() }),
            "trace" => match args.trace.clone().or_else(default_trace) {
                Some(path) => trace::load(&path, &trace_params())?,
                None => {
                    eprintln!("no trace file found (pass --trace FILE); skipping the trace workload");
                    return Ok(None);
                }
            },
            other => return Err(BenchError::UnknownWorkload(other.into())),
        }))
    };
    let mut out = Vec::new();
    if let Some(path) = &args.trace {
        out.push(trace::load(path, &trace_params())?);
    } else if let Some(name) = &args.workload {
        out.extend(named(name)?);
    } else {
        for name in workload::NAMES {
            out.extend(named(name)?);
        }
    }
    if let Some(ts) = args.time_scale {
        for w in &mut out {
            w.time_scale = ts;
        }
    }
    Ok(out)
}

/// The workloads sized for real vLLM on CPU (each workload's `vllm()`
/// preset); the Mooncake trace's prompts do not fit the tiny model's context.
fn vllm_workloads(args: &CompareArgs) -> Result<Vec<Workload>, BenchError> {
    if args.trace.is_some() || args.workload.as_deref() == Some("trace") {
        return Err(BenchError::Usage(
            "--engine vllm: the Mooncake trace's prompts exceed the tiny model's 4096-token context".into(),
        ));
    }
    let mut out = Vec::new();
    for name in workload::NAMES.iter().filter(|n| args.workload.as_deref().is_none_or(|w| w == **n)) {
        match *name {
            "shared_prefix" => out.push(shared_prefix::generate(&shared_prefix::Params::vllm())),
            "chat" => out.push(chat::generate(&chat::Params::vllm())),
            "rag" => out.push(rag::generate(&rag::Params::vllm())),
            _ => {}
        }
    }
    if let Some(w) = &args.workload
        && out.is_empty()
    {
        return Err(BenchError::UnknownWorkload(w.clone()));
    }
    // Real engines run in real time.
    for w in &mut out {
        w.time_scale = 1.0;
    }
    Ok(out)
}

/// KV blocks per engine: the cluster holds 1.5 × the working set, so one
/// worker alone (with 3+ workers) cannot, and routing decides the hit rate;
/// never fewer than what a handful of the longest prompts need at once.
pub fn blocks_per_worker(c: &Ceiling, workers: usize, max_output: u32, block_size: u32) -> u32 {
    let share = (c.unique_blocks as f64 * 1.5 / workers.max(1) as f64).ceil() as u64;
    let floor = 4 * (c.max_prompt_blocks + u64::from(max_output).div_ceil(u64::from(block_size.max(1))) + 1) + 256;
    share.max(floor).min(u64::from(u32::MAX - 2)) as u32
}

fn sim_args(w: &Workload) -> Vec<String> {
    let max_len = (w.max_prompt_len() + w.max_output() as usize + 16).max(32_768);
    vec!["--time-scale".into(), w.time_scale.to_string(), "--max-model-len".into(), max_len.to_string()]
}

/// The runs for one workload and worker count: every policy at every
/// requested replica count, plus the default policy with 2 replicas and without
/// sidecars unless those are off or already covered.
fn shapes(args: &CompareArgs, peers: &[(Peer, PathBuf)]) -> Vec<(String, usize, bool)> {
    let short = args.quick || args.engine.engine == EngineKind::Vllm;
    let policies: Vec<String> = match &args.policies {
        Some(p) => p.clone(),
        None => (if short { QUICK_POLICIES } else { POLICIES }).iter().map(|s| s.to_string()).collect(),
    };
    let routers: &[usize] = if args.routers.is_empty() { &[1] } else { &args.routers };
    let mut out: Vec<(String, usize, bool)> =
        routers.iter().flat_map(|&r| policies.iter().map(move |p| (p.clone(), r, true))).collect();
    if !args.no_variants && policies.iter().any(|p| p == DEFAULT_POLICY) {
        if !routers.contains(&2) {
            out.push((DEFAULT_POLICY.into(), 2, true));
        }
        out.push((DEFAULT_POLICY.into(), routers[0], false));
    }
    out.extend(peers.iter().map(|(peer, _)| (peer_policy(*peer), 1, false)));
    out
}

/// A peer's runs are recorded under this policy name.
fn peer_policy(peer: Peer) -> String {
    format!("{PEER_PREFIX}{}", peer.slug())
}

/// How the runs of other routers (`--peers`) are named: `peer:` and the peer.
pub const PEER_PREFIX: &str = "peer:";

/// A run of another router (`--peers`), not of a kvroute policy.
pub fn is_peer(policy: &str) -> bool {
    policy.starts_with(PEER_PREFIX)
}

/// `--peers`, checked before any run: each peer with its executable. Peers
/// route on text (SMG's cache-aware tree holds characters), so every policy
/// of such a run gets the same text prompts: on simulated engines in the
/// words of `--text-tokenizer` (required), on real vLLM in the tiny model's
/// own. One router each. A peer not installed is refused with how to
/// install it.
fn peer_runs(args: &CompareArgs, bin_dir: &Path) -> Result<Vec<(Peer, PathBuf)>, BenchError> {
    if args.peers.is_empty() {
        return Ok(Vec::new());
    }
    if args.engine.engine == EngineKind::Sim && args.text_tokenizer.is_none() {
        return Err(BenchError::Usage(
            "--peers route on prompt text: on simulated engines, pass --text-tokenizer DIR".into(),
        ));
    }
    let mut out: Vec<(Peer, PathBuf)> = Vec::new();
    for name in &args.peers {
        let chosen = match name.as_str() {
            "all" => peers::ALL.to_vec(),
            slug => vec![Peer::from_slug(slug).map_err(BenchError::Usage)?],
        };
        for peer in chosen {
            if out.iter().any(|(p, _)| *p == peer) {
                continue;
            }
            let flag = args.peer_bins.given(peer.exe());
            let bin = peers::find(flag, peer.exe(), bin_dir).ok_or_else(|| {
                BenchError::Usage(format!(
                    "{}: no `{}` {}; install it: python3 -m venv target/peers-venv && target/peers-venv/bin/pip install smg vllm-router",
                    peer.name(),
                    peer.exe(),
                    flag.map_or("on PATH or in target/peers-venv/bin".to_owned(), |f| format!("at {}", f.display())),
                ))
            })?;
            out.push((peer, bin));
        }
    }
    Ok(out)
}

/// Real engines shared by the runs of one (workload, worker count).
#[derive(Debug)]
struct Pool {
    key: (usize, usize),
    engines: VllmEngines,
    tokenizer: std::path::PathBuf,
}

pub async fn run(args: CompareArgs) -> Result<Vec<Record>, BenchError> {
    let engine = args.engine.engine;
    let dir = setup::bin_dir();
    let tokenizer = match engine {
        EngineKind::Sim => {
            setup::ensure_all(&dir)?;
            None
        }
        EngineKind::Vllm => {
            kvroute_sim::cluster::ensure_binaries(&dir)?;
            Some(crate::engine::tiny_model_dir(&args.engine.vllm_serve)?)
        }
    };
    let block_size = engine.block_size();
    let http = crate::client::http_client();
    let words = match (&args.text_tokenizer, &tokenizer) {
        (Some(_), Some(_)) => {
            return Err(BenchError::Usage(
                "--text-tokenizer is for simulated engines (with --peers, vLLM runs send text in the model's own words)"
                    .into(),
            ));
        }
        (Some(dir), None) => Some(Arc::new(Words::load(dir)?)),
        (None, Some(dir)) if !args.peers.is_empty() => Some(Arc::new(Words::load(dir)?)),
        (None, _) => None,
    };
    let prepared: Vec<Prepared> = workloads(&args)?
        .into_iter()
        .map(|workload| {
            let ceiling = ceiling::compute(workload.requests.iter().map(|r| r.prompt.tokens()), block_size as usize);
            Prepared { workload, ceiling, words: words.clone() }
        })
        .collect();
    // Each workload's prompts as block ids, once: what `kvroute-lab
    // crosscheck` replays (the request logs say when each was sent).
    for p in &prepared {
        let path = args.out.join("requests").join(format!("{}_prompts.jsonl", p.workload.name));
        let exported = workload::export::export(&p.workload, block_size as usize);
        report::write(&path, workload::export::jsonl(&exported).as_bytes())?;
    }
    let workers: Vec<usize> = if args.workers.is_empty() {
        vec![match engine {
            EngineKind::Sim => 4,
            EngineKind::Vllm => 2,
        }]
    } else {
        args.workers.clone()
    };
    for &n in &workers {
        engine.check_workers(n)?;
    }
    let slow = slow_fleet(&args, &workers)?;
    let peers = peer_runs(&args, &dir)?;
    let plan = plan::interleaved(&workers, prepared.len(), &shapes(&args, &peers), args.rounds as usize);
    let mp = MultiProgress::new();
    let overall = mp.add(ProgressBar::new(plan.len() as u64));
    overall.set_style(
        ProgressStyle::with_template("runs {bar:30} {pos}/{len} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut records: Vec<Record> = if args.resume { previous(&args.out.join("results.json")) } else { Vec::new() };
    let router_config = args.router_config.as_ref().map(|c| c.display().to_string());
    let mut pool: Option<Pool> = None;
    for run in plan {
        let p = &prepared[run.workload];
        if run.recorded_in(&records, engine, &p.workload.name, router_config.as_deref()) {
            overall.inc(1);
            continue;
        }
        let plan::Planned { workload: wi, workers: n, policy, routers, sidecars, round } = run;
        let rounds = if args.rounds > 1 { format!(" round {round}/{}", args.rounds) } else { String::new() };
        let what = format!(
            "{} {policy} w{n} r{routers}{}{rounds}",
            p.workload.name,
            if sidecars || is_peer(&policy) { "" } else { " no-sidecars" }
        );
        // Bars draw nothing when stderr is a file or a pipe (CI, nohup, tee):
        // there, each run says when it starts (its figures follow when it ends).
        if !std::io::stderr().is_terminal() {
            eprintln!(
                "compare run {}/{}: {what}, {} requests",
                overall.position() + 1,
                overall.length().unwrap_or(0),
                p.workload.requests.len()
            );
        }
        overall.set_message(what);
        let shape = Shape {
            workers: n,
            routers,
            replica_exchange: !args.no_replica_exchange,
            sidecars,
            policy: policy.clone(),
            num_blocks: args
                .num_blocks
                .unwrap_or_else(|| blocks_per_worker(&p.ceiling, n, p.workload.max_output(), block_size)),
            sim_args: sim_args(&p.workload),
            router_args: args.router_config.iter().flat_map(|c| ["--config".into(), c.display().to_string()]).collect(),
            tokenizer: args.text_tokenizer.clone(),
        };
        if let Some(tokenizer) = &tokenizer
            && pool.as_ref().is_none_or(|pl| pl.key != (wi, n))
        {
            if let Some(old) = pool.take() {
                old.engines.shutdown().await;
            }
            let engines = start_engines(&args, p, &shape, &http).await?;
            pool = Some(Pool { key: (wi, n), engines, tokenizer: tokenizer.clone() });
        }
        let log = args.out.join("requests").join(format!(
            "{}_{}_w{n}_r{routers}{}{}.jsonl",
            p.workload.name,
            policy.replace(':', "-"),
            if sidecars { "" } else { "_nosidecars" },
            if args.rounds > 1 { format!("_round{round}") } else { String::new() }
        ));
        let peer = peers.iter().find(|(peer, _)| peer_policy(*peer) == shape.policy);
        let mut rec = run_one(&http, &dir, p, &shape, pool.as_ref(), peer, slow, args.concurrency, &mp, &log).await?;
        rec.round = round;
        overall.suspend(|| eprintln!(
            "{}",
            format_args!(
            "{:<14} {:<20} w{} r{} {:<11}{rounds} hit {:.3} (ceiling {:.3})  TTFT p50 {} ms p99 {} ms  {:.1} req/s  max/mean {:.2}  errors {}{}",
            rec.workload,
            rec.policy,
            rec.workers,
            rec.routers,
            if is_peer(&rec.policy) {
                ""
            } else if rec.sidecars {
                "sidecars"
            } else {
                "no-sidecars"
            },
            rec.hit_rate,
            rec.ceiling,
            report::ms(rec.ttft_p50_ms),
            report::ms(rec.ttft_p99_ms),
            rec.throughput_rps,
            rec.max_mean_load,
            rec.errors,
            rec.router_queue_ms.map_or(String::new(), |(p50, p99)| format!("  router queueing p50 ≤ {p50} ms p99 ≤ {p99} ms"))
        )));
        records.push(rec);
        overall.inc(1);
        // Partial results survive an interrupted long run.
        report::write_results(&args.out, &args, &records)?;
    }
    if let Some(old) = pool.take() {
        old.engines.shutdown().await;
    }
    overall.finish_and_clear();
    let descriptions: Vec<(String, String, Ceiling)> =
        prepared.iter().map(|p| (p.workload.name.clone(), p.workload.description.clone(), p.ceiling)).collect();
    report::write_results(&args.out, &args, &records)?;
    let mut md = summary::markdown(&records, &descriptions, &args);
    md.push_str(&report::plots_section("compare", &args.out));
    report::write(&args.out.join("report.md"), md.as_bytes())?;
    Ok(records)
}

/// `--slow-engines` and `--slow-factor`, checked: how many engines run how
/// many times slower, or `None` for a homogeneous fleet.
fn slow_fleet(args: &CompareArgs, workers: &[usize]) -> Result<Option<(usize, f64)>, BenchError> {
    if args.slow_engines == 0 {
        return Ok(None);
    }
    if args.engine.engine != EngineKind::Sim {
        return Err(BenchError::Usage("--slow-engines is for simulated engines".into()));
    }
    if !(args.slow_factor.is_finite() && args.slow_factor > 0.0) {
        return Err(BenchError::Usage(format!("--slow-factor {}: must be a finite number > 0", args.slow_factor)));
    }
    if let Some(&n) = workers.iter().find(|&&n| n < args.slow_engines) {
        return Err(BenchError::Usage(format!("--slow-engines {} is more than --workers {n}", args.slow_engines)));
    }
    Ok(Some((args.slow_engines, args.slow_factor)))
}

/// Makes the first `count` engines `factor` × slower at every step.
async fn slow_down(http: &reqwest::Client, engines: &[String], count: usize, factor: f64) -> Result<(), BenchError> {
    for url in engines.iter().take(count) {
        probe::post_json(http, &format!("{url}/sim/faults"), &serde_json::json!({ "slowdown": factor })).await?;
    }
    Ok(())
}

/// Starts `shape.workers` real engines sized for `p` and warms them up.
async fn start_engines(
    args: &CompareArgs,
    p: &Prepared,
    shape: &Shape,
    http: &reqwest::Client,
) -> Result<VllmEngines, BenchError> {
    let spec = ServeSpec {
        script: args.engine.vllm_serve.clone(),
        num_blocks: shape.num_blocks,
        block_size: args.engine.engine.block_size(),
        start_timeout: Duration::from_secs(args.engine.vllm_start_timeout),
    };
    let max_len = vllm::max_model_len(spec.num_blocks, spec.block_size) as usize;
    let need = p.workload.max_prompt_len() + p.workload.max_output() as usize;
    if need > max_len {
        return Err(BenchError::Usage(format!(
            "{}: prompts of up to {need} tokens with output do not fit vLLM's context of {max_len}",
            p.workload.name
        )));
    }
    let engines = VllmEngines::start(shape.workers, spec, &args.out.join("logs"), worker_id, http).await?;
    engines.warm_up(http, p.workload.max_prompt_len()).await?;
    Ok(engines)
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    http: &reqwest::Client,
    bin_dir: &Path,
    p: &Prepared,
    shape: &Shape,
    pool: Option<&Pool>,
    peer: Option<&(Peer, PathBuf)>,
    slow: Option<(usize, f64)>,
    concurrency: usize,
    mp: &MultiProgress,
    log: &Path,
) -> Result<Record, BenchError> {
    let (rig, engine) = match (pool, peer) {
        // A peer: the engines alone, the peer in front of them below.
        (None, Some(_)) => {
            let engines_only = Shape { routers: 0, sidecars: false, ..shape.clone() };
            (Rig::start_sim(&engines_only, bin_dir).await?, EngineKind::Sim)
        }
        (None, None) => (Rig::start_sim(shape, bin_dir).await?, EngineKind::Sim),
        (Some(pool), peer) => {
            // A cold start for this run without restarting the engines.
            pool.engines.reset_caches(http).await?;
            let front = match peer {
                Some(_) => Shape { routers: 0, sidecars: false, ..shape.clone() },
                None => shape.clone(),
            };
            (Rig::start_vllm(&pool.engines, &front, pool.tokenizer.clone(), bin_dir).await?, EngineKind::Vllm)
        }
    };
    let mut front: Option<peers::Running> = None;
    let mut result = match slow {
        Some((count, factor)) => slow_down(http, &rig.engine_urls(), count, factor).await,
        None => Ok(()),
    };
    if let (Ok(()), Some((peer, bin))) = (&result, peer) {
        let at = |url: &String, events: &String| peers::EngineAt { url: url.clone(), events: events.clone() };
        let engines: Vec<peers::EngineAt> = match (&rig, pool) {
            (Rig::Sim(cluster), _) => cluster.engines.iter().map(|e| at(&e.url, &e.events)).collect(),
            (Rig::Vllm { .. }, Some(pool)) => pool.engines.engines.iter().map(|e| at(&e.url, &e.events)).collect(),
            (Rig::Vllm { .. }, None) => Vec::new(),
        };
        let fleet = peers::Fleet { engines, model: engine.model().into(), block_size: engine.block_size() };
        match peers::start(*peer, bin, &fleet, http).await {
            Ok(running) => front = Some(running),
            Err(e) => result = Err(e),
        }
    }
    let targets: Vec<String> = match &front {
        Some(running) => vec![running.url.clone()],
        None => (0..shape.routers).map(|i| rig.router_url(i).to_owned()).collect(),
    };
    let result = match result {
        Ok(()) => measure(http, &rig, &targets, engine, p, shape, concurrency, mp, log).await.map(|mut rec| {
            if let Some((count, factor)) = slow {
                rec.slow_engines = count;
                rec.slow_factor = Some(factor);
            }
            rec
        }),
        Err(e) => Err(e),
    };
    if let Some(mut running) = front {
        running.proc.kill().await;
    }
    rig.shutdown().await;
    result
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    http: &reqwest::Client,
    rig: &Rig,
    targets: &[String],
    engine: EngineKind,
    p: &Prepared,
    shape: &Shape,
    concurrency: usize,
    mp: &MultiProgress,
    log: &Path,
) -> Result<Record, BenchError> {
    let engines = rig.engine_urls();
    let before = probe::cache_counters(http, &engines).await?;
    let pb = mp.add(ProgressBar::new(p.workload.requests.len() as u64));
    pb.set_style(
        ProgressStyle::with_template("  requests {bar:30} {pos}/{len} [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let opts = DriveOptions {
        model: engine.model().into(),
        ignore_eos: engine.ignore_eos(),
        concurrency,
        request_timeout: Duration::from_secs(120),
        words: p.words.clone(),
    };
    let out = drive(http, &p.workload, targets, &opts, &pb).await;
    pb.finish_and_clear();
    mp.remove(&pb);
    let after = probe::cache_counters(http, &engines).await?;
    let router_queue_ms = probe::dispatch_delay_ms(http, targets).await;

    let mut ttfts = Vec::new();
    let mut lats = Vec::new();
    let mut per_worker: BTreeMap<String, u64> = (0..shape.workers).map(|i| (worker_id(i), 0)).collect();
    let mut errors = 0;
    let mut first_error = None;
    for r in &out.results {
        match r {
            Ok(o) => {
                ttfts.push(o.ttft);
                lats.push(o.latency);
                if let Some(w) = &o.worker {
                    *per_worker.entry(w.clone()).or_default() += 1;
                }
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| e.clone());
            }
        }
    }
    if let Some(e) = first_error {
        eprintln!("{} / {}: {errors} errors, first: {e}", p.workload.name, shape.policy);
    }
    // A router that does not say where each request went (the peers): the
    // engines' own counts of requests served.
    if per_worker.values().all(|&n| n == 0) {
        for (i, (a, b)) in after.served.iter().zip(&before.served).enumerate() {
            per_worker.insert(worker_id(i), (a - b).max(0.0) as u64);
        }
    }
    write_request_log(log, p, &out.results, &out.sent)?;
    ttfts.sort();
    lats.sort();
    let wall = out.wall.as_secs_f64();
    Ok(Record {
        engine,
        workload: p.workload.name.clone(),
        policy: shape.policy.clone(),
        workers: shape.workers,
        routers: shape.routers,
        sidecars: shape.sidecars,
        hit_rate: after.rate_since(&before),
        ceiling: p.ceiling.rate(),
        ttft_p50_ms: percentile_ms(&ttfts, 50.0),
        ttft_p90_ms: percentile_ms(&ttfts, 90.0),
        ttft_p99_ms: percentile_ms(&ttfts, 99.0),
        ttft_mean_ms: mean_ms(&ttfts),
        latency_p50_ms: percentile_ms(&lats, 50.0),
        throughput_rps: if wall > 0.0 { ttfts.len() as f64 / wall } else { 0.0 },
        max_mean_load: max_mean_load(&per_worker, shape.workers),
        requests: out.results.len(),
        errors,
        per_worker,
        num_blocks: shape.num_blocks,
        time_scale: p.workload.time_scale,
        wall_s: wall,
        router_config: shape.router_args.get(1).cloned(),
        round: 1,
        router_queue_ms,
        slow_engines: 0,
        slow_factor: None,
    })
}

/// The records of an earlier, interrupted run of the same command.
fn previous(path: &Path) -> Vec<Record> {
    let Some(json) = std::fs::read_to_string(path).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) else {
        return Vec::new();
    };
    // `{"run": …, "results": [...]}`, or a bare list from before the run header.
    let records = match json {
        Value::Object(mut o) => o.remove("results").unwrap_or_default(),
        list => list,
    };
    serde_json::from_value(records).unwrap_or_default()
}

/// One JSON line per request (its scheduled arrival and when it was sent,
/// worker, TTFT, prompt length, error), for looking behind a run's
/// percentiles.
fn write_request_log(
    path: &Path,
    p: &Prepared,
    results: &[Result<crate::client::Outcome, String>],
    sent: &[Option<Duration>],
) -> Result<(), BenchError> {
    let mut text = String::new();
    for (i, (req, r)) in p.workload.requests.iter().zip(results).enumerate() {
        let sent_ms = sent.get(i).copied().flatten().map(|d| d.as_secs_f64() * 1e3);
        let line = match r {
            Ok(o) => serde_json::json!({
                "i": i,
                "arrival_ms": req.arrival.as_secs_f64() * 1e3,
                "sent_ms": sent_ms,
                "prompt_tokens": req.prompt.len(),
                "worker": o.worker,
                "ttft_ms": o.ttft.as_secs_f64() * 1e3,
                "latency_ms": o.latency.as_secs_f64() * 1e3,
            }),
            Err(e) => serde_json::json!({"i": i, "prompt_tokens": req.prompt.len(), "error": e}),
        };
        text.push_str(&line.to_string());
        text.push('\n');
    }
    report::write(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        args: CompareArgs,
    }

    fn parse(argv: &[&str]) -> CompareArgs {
        Cmd::parse_from(std::iter::once("compare").chain(argv.iter().copied())).args
    }

    #[test]
    fn resume_reads_results_with_and_without_the_run_header() {
        let dir = std::env::temp_dir().join(format!("kvroute-compare-resume-{}", std::process::id()));
        let record = serde_json::json!({"workload": "chat", "policy": "round_robin", "workers": 4, "routers": 1,
            "sidecars": true, "hit_rate": 0.5, "ceiling": 0.9, "ttft_p50_ms": 1.0, "ttft_p90_ms": 2.0,
            "ttft_p99_ms": 3.0, "ttft_mean_ms": 1.5, "latency_p50_ms": 4.0, "throughput_rps": 10.0,
            "max_mean_load": 1.1, "requests": 100, "errors": 0, "per_worker": {}, "num_blocks": 64,
            "time_scale": 1.0, "wall_s": 2.0, "router_config": null});
        let records: Vec<Record> = vec![serde_json::from_value(record.clone()).unwrap()];
        let args = parse(&["--quick"]);
        report::write_results(&dir, &args, &records).unwrap();
        let path = dir.join("results.json");
        let back = previous(&path);
        assert_eq!((back.len(), back[0].policy.as_str()), (1, "round_robin"));
        std::fs::write(&path, serde_json::json!([record]).to_string()).unwrap();
        assert_eq!(previous(&path).len(), 1);
        std::fs::write(&path, "not json").unwrap();
        assert!(previous(&path).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cluster_holds_the_working_set_but_one_worker_does_not() {
        let c = Ceiling { hit_tokens: 0, query_tokens: 1, unique_blocks: 8_000, max_prompt_blocks: 136 };
        let b = blocks_per_worker(&c, 4, 16, 16);
        assert!(u64::from(b) < c.unique_blocks);
        assert!(u64::from(b) * 4 >= c.unique_blocks);
    }

    #[test]
    fn vllm_presets_fit_the_tiny_models_context() {
        let args = parse(&["--engine", "vllm"]);
        let ws = workloads(&args).unwrap_or_default();
        assert_eq!(ws.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(), ["shared_prefix", "chat", "rag"]);
        for w in &ws {
            let c = ceiling::compute(w.requests.iter().map(|r| r.prompt.tokens()), 32);
            let blocks = blocks_per_worker(&c, 2, w.max_output(), 32);
            let len = vllm::max_model_len(blocks, 32) as usize;
            assert!(w.max_prompt_len() + w.max_output() as usize <= len, "{}", w.name);
        }
        let trace = parse(&["--engine", "vllm", "--workload", "trace"]);
        assert!(workloads(&trace).is_err());
    }

    #[test]
    fn a_slow_fleet_is_checked_before_any_run() {
        assert_eq!(slow_fleet(&parse(&[]), &[4]).unwrap(), None);
        assert_eq!(
            slow_fleet(&parse(&["--slow-engines", "1", "--slow-factor", "3"]), &[4, 8]).unwrap(),
            Some((1, 3.0))
        );
        for bad in [
            &["--slow-engines", "5"][..],
            &["--slow-engines", "1", "--slow-factor", "0"],
            &["--slow-engines", "1", "--slow-factor", "NaN"],
            &["--slow-engines", "1", "--engine", "vllm"],
        ] {
            assert!(matches!(slow_fleet(&parse(bad), &[4]), Err(BenchError::Usage(_))), "{bad:?}");
        }
    }

    #[test]
    fn vllm_runs_two_policies_unless_told_otherwise() {
        let args = parse(&["--engine", "vllm", "--no-variants"]);
        let policies: Vec<String> = shapes(&args, &[]).into_iter().map(|s| s.0).collect();
        assert_eq!(policies, [DEFAULT_POLICY, "round_robin"]);
    }

    #[test]
    fn peers_are_more_policies_of_the_plan_and_need_text_prompts() {
        let dir = std::env::temp_dir().join(format!("kvroute-compare-peers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (smg, vr) = (dir.join("smg"), dir.join("vllm-router"));
        std::fs::write(&smg, "").unwrap();
        std::fs::write(&vr, "").unwrap();
        let (s, v) = (smg.display().to_string(), vr.display().to_string());
        let with = |extra: &[&str]| {
            let mut argv = vec!["--policies", "round_robin", "--no-variants", "--smg", &s, "--vllm-router", &v];
            argv.extend_from_slice(extra);
            parse(&argv)
        };
        let args = with(&["--peers", "smg_cache_aware,all", "--text-tokenizer", "tok"]);
        let peers = peer_runs(&args, &dir).unwrap();
        assert_eq!(peers.len(), 4, "`all` adds the others once");
        assert_eq!(peers[0], (Peer::SmgCacheAware, smg.clone()));
        let runs = shapes(&args, &peers);
        assert_eq!(runs[0], ("round_robin".to_owned(), 1, true));
        assert_eq!(runs[1], ("peer:smg_cache_aware".to_owned(), 1, false));
        assert_eq!(runs.len(), 5);
        for bad in [&["--peers", "smg_cache_aware"][..], &["--peers", "nginx", "--text-tokenizer", "tok"]] {
            assert!(matches!(peer_runs(&with(bad), &dir), Err(BenchError::Usage(_))), "{bad:?}");
        }
        assert_eq!(peer_runs(&with(&["--peers", "vllm_router_kv_aware", "--engine", "vllm"]), &dir).unwrap().len(), 1);
        let missing = parse(&["--peers", "smg_round_robin", "--text-tokenizer", "tok", "--smg", "/nonexistent/smg"]);
        let Err(BenchError::Usage(why)) = peer_runs(&missing, &dir) else { panic!("a missing peer is refused") };
        assert!(why.contains("pip install smg"), "{why}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
