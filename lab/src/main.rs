//! `kvroute-lab`: run one lab scenario, or a matrix of them, from the command line.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_lab::cluster::{EngineCosts, SidecarModel, SlowWorkers, run};
use kvroute_lab::matrix::{GoodputSpec, MatrixSpec, markdown, run_matrix, scenario_for, workload_for};
use kvroute_lab::policies::{all, default_policy, factory};
use kvroute_lab::workload::{WorkloadKind, default_trace_path};

#[derive(Parser, Debug)]
#[command(name = "kvroute-lab", about = "Virtual-time cluster lab: routing policies on simulated vLLM engines")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug)]
struct Common {
    #[arg(long, default_value_t = 2_000)]
    requests: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Fraction of sidecar pushes lost.
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Mooncake-format trace for the `trace` workload.
    #[arg(long, default_value_os_t = default_trace_path())]
    trace: PathBuf,
    /// Share of the engines that are slow (a mixed or throttled fleet).
    #[arg(long, default_value_t = 0.0)]
    slow_share: f64,
    /// How many times slower those engines are than the timing model
    /// (below 1: faster).
    #[arg(long, default_value_t = 2.0)]
    slow_factor: f64,
    /// The engines' prefill cost, µs per token (default: kvroute-sim's 70,
    /// which predicted_ttft's timing model assumes).
    #[arg(long)]
    engine_prefill_us_per_token: Option<f64>,
    /// The engines' fixed cost per step, µs (default 5,000).
    #[arg(long)]
    engine_step_overhead_us: Option<f64>,
    /// The engines' decode cost per running sequence per step, µs (default 40).
    #[arg(long)]
    engine_decode_us_per_seq: Option<f64>,
    /// The engines' chunked-prefill budget, tokens per step (default 8,192).
    #[arg(long)]
    engine_max_batched_tokens: Option<usize>,
    /// chat, long_conv, agent: send each turn its think time after the
    /// previous answer ends, with think times as generated; load levels
    /// scale only when sessions start, and sessions are never cut short.
    #[arg(long)]
    closed_loop: bool,
    /// What-if: every router replica knows every replica's pending prefill
    /// on each worker (not deployable today; measures what the replicas'
    /// missing information costs).
    #[arg(long)]
    shared_pending: bool,
    /// Router replicas exchange in-flight reports every this many ms, as
    /// `kvroute-router --replica` does (100 ms there): pending prefill and
    /// in-flight requests per worker, and their recent requests' prefixes.
    #[arg(long)]
    peer_exchange_ms: Option<u64>,
    /// With `--peer-exchange-ms`: between full reports, a replica that
    /// routes a request tells the others its new per-worker figures this
    /// many ms after its last report at the soonest, as `kvroute-router`'s
    /// `replica_news_interval` does (10 ms there); 0: full reports only.
    #[arg(long, default_value_t = 10)]
    peer_news_ms: u64,
}

impl Common {
    fn peer_news(&self) -> Option<kvroute_lab::time::Micros> {
        (self.peer_news_ms > 0).then(|| kvroute_lab::time::Micros::from_ms(self.peer_news_ms))
    }

    fn slow(&self) -> anyhow::Result<SlowWorkers> {
        anyhow::ensure!((0.0..=1.0).contains(&self.slow_share), "--slow-share must be within 0..=1");
        anyhow::ensure!(
            self.slow_factor.is_finite() && self.slow_factor > 0.0,
            "--slow-factor must be a finite number above 0"
        );
        Ok(SlowWorkers { share: self.slow_share, factor: self.slow_factor })
    }

    fn engine_costs(&self) -> anyhow::Result<EngineCosts> {
        for (flag, v) in [
            ("--engine-prefill-us-per-token", self.engine_prefill_us_per_token),
            ("--engine-step-overhead-us", self.engine_step_overhead_us),
            ("--engine-decode-us-per-seq", self.engine_decode_us_per_seq),
        ] {
            anyhow::ensure!(v.is_none_or(|v| v.is_finite() && v >= 0.0), "{flag} must be a finite number ≥ 0");
        }
        anyhow::ensure!(self.engine_max_batched_tokens != Some(0), "--engine-max-batched-tokens must be above 0");
        Ok(EngineCosts {
            prefill_us_per_token: self.engine_prefill_us_per_token,
            step_overhead_us: self.engine_step_overhead_us,
            decode_us_per_seq: self.engine_decode_us_per_seq,
            max_batched_tokens: self.engine_max_batched_tokens,
        })
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// One run: prints its summary as JSON.
    Run {
        #[arg(long, value_enum)]
        workload: WorkloadKind,
        #[arg(long, default_value_t = 16)]
        workers: usize,
        #[arg(long, default_value_t = 1)]
        routers: usize,
        /// A policy, or a variant `name:param=value+…` [default: the router's default]
        #[arg(long, default_value = kvroute_router::policy::DEFAULT_POLICY)]
        policy: String,
        /// Load level (1 = saturation for a perfect router).
        #[arg(long, default_value_t = 0.6)]
        load: f64,
        /// Also write one CSV row per request here (arrival, TTFT, tokens,
        /// worker, router replica, the decision's reason, the tokens the
        /// router believed that worker held), to read a policy's decisions
        /// one request at a time.
        #[arg(long)]
        records: Option<PathBuf>,
        #[command(flatten)]
        common: Common,
    },
    /// Workloads × loads × workers × routers × policies: writes report.md and results.json.
    Matrix {
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = WorkloadKind::ALL)]
        workloads: Vec<WorkloadKind>,
        #[arg(long, value_delimiter = ',', default_values_t = [0.3, 0.6, 0.9])]
        loads: Vec<f64>,
        #[arg(long, value_delimiter = ',', default_values_t = [4, 16, 64, 256])]
        workers: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_values_t = [1, 3])]
        routers: Vec<usize>,
        /// Policies (default: every policy the router knows).
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Goodput search: TTFT p90 SLO in ms (off if absent).
        #[arg(long)]
        goodput_slo_ms: Option<f64>,
        #[arg(long, default_value_t = 16)]
        goodput_workers: usize,
        #[arg(long, default_value_t = 1_000)]
        goodput_requests: usize,
        #[arg(long, default_value = "lab-results")]
        out: PathBuf,
        /// Run each case with this many seeds (`--seed`, `--seed` + 1, …),
        /// each its own workload, and pool their requests: one 1,000-request
        /// run's p99 is its tenth-slowest request, and which policy wins by
        /// 3 % there often changes with the seed.
        #[arg(long, default_value_t = 1)]
        seeds: usize,
        /// Lab runs at once (threads); the results do not depend on it.
        #[arg(long, default_value_t = 1)]
        jobs: usize,
        #[command(flatten)]
        common: Common,
    },
    /// Goodput curves (TTFT p90 against rate, per policy, PNG) from a
    /// matrix's results.json; `matrix` draws them too when it runs ≥ 2 loads.
    Plot {
        /// The matrix's output folder (holds results.json; the PNGs go there).
        dir: PathBuf,
        /// The SLO drawn as a rule: TTFT p90 in ms.
        #[arg(long, default_value_t = 1_000.0)]
        slo_ms: f64,
    },
    /// The lab against a `kvroute-bench compare --trace` run: the same
    /// requests, arrival times, engine timing and KV size, per policy and
    /// worker count; prints the comparison table (Markdown).
    Crosscheck {
        /// The bench run's output folder (its --out, holding results.json).
        bench: PathBuf,
        /// The bench's --speedup (trace timestamps divided by it). This and
        /// --skip, --max-output and --trace matter only for bench runs from
        /// before the bench exported its workloads (requests/*_prompts.jsonl).
        #[arg(long, default_value_t = 20.0)]
        speedup: f64,
        /// The bench's --skip (trace lines before the replayed stretch).
        #[arg(long, default_value_t = 0)]
        skip: usize,
        /// The bench's cap on output tokens per request.
        #[arg(long, default_value_t = 16)]
        max_output: u32,
        /// The trace the bench replayed.
        #[arg(long, default_value_os_t = default_trace_path())]
        trace: PathBuf,
        /// Also write the rows as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Request-path latency per request ahead of the engine, µs (the
        /// bench's HTTP and JSON path; the lab leaves it out by default).
        #[arg(long, default_value_t = 0)]
        path_us: u64,
        /// Request-path latency per prompt token, ns.
        #[arg(long, default_value_t = 0)]
        path_ns_per_token: u64,
        /// Write the lab's request logs (the bench's format) into this folder.
        #[arg(long)]
        requests_out: Option<PathBuf>,
        /// Per-request path delays measured by a bench run of the same
        /// workloads with engines that take no time (`kvroute-bench compare
        /// --time-scale 100000 --out DIR`): each request's median TTFT there.
        /// Replaces --path-us and --path-ns-per-token.
        #[arg(long, value_name = "DIR")]
        path_from: Option<PathBuf>,
    },
    /// The CI gate's check, per workload, with its figures.
    Gate {
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = WorkloadKind::ALL)]
        workloads: Vec<WorkloadKind>,
    },
}

fn sidecar(loss: f64) -> SidecarModel {
    SidecarModel { loss, ..Default::default() }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Run { workload, workers, routers, policy, load, records, common } => {
            let mut s = scenario_for(workload, workers, routers, common.seed, sidecar(common.loss));
            s.slow = common.slow()?;
            common.engine_costs()?.apply(&mut s.engine);
            let (w, unit) = workload_for(workload, &s, common.requests, &common.trace, common.closed_loop)?;
            // Calibrated as deployed, so a what-if runs at the same rate.
            s.shared_pending = common.shared_pending;
            s.peer_exchange = common.peer_exchange_ms.map(kvroute_lab::time::Micros::from_ms);
            s.peer_news = common.peer_news();
            let r = run(&s, &w.at_rate(load * unit), &factory(&policy)?);
            eprintln!(
                "{} requests at {:.1} req/s (load {load} of {unit:.1} req/s) in {:.2} s wall",
                w.requests.len(),
                load * unit,
                r.wall_s
            );
            if let Some(path) = records {
                std::fs::write(&path, records_csv(&r.records))
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
        Cmd::Matrix {
            workloads,
            loads,
            workers,
            routers,
            policies,
            goodput_slo_ms,
            goodput_workers,
            goodput_requests,
            out,
            seeds,
            jobs,
            common,
        } => {
            anyhow::ensure!(seeds >= 1 && jobs >= 1, "--seeds and --jobs must be at least 1");
            let policies = if policies.is_empty() { all().iter().map(|s| (*s).to_owned()).collect() } else { policies };
            let spec = MatrixSpec {
                workloads,
                loads,
                workers,
                routers,
                policies,
                requests: common.requests,
                seed: common.seed,
                seeds,
                jobs,
                sidecar: sidecar(common.loss),
                slow: common.slow()?,
                engine_costs: common.engine_costs()?,
                shared_pending: common.shared_pending,
                peer_exchange: common.peer_exchange_ms.map(kvroute_lab::time::Micros::from_ms),
                peer_news: common.peer_news(),
                trace_path: common.trace,
                closed_loop: common.closed_loop,
                goodput: goodput_slo_ms.map(|slo| GoodputSpec {
                    slo_p90_ms: slo,
                    workers: goodput_workers,
                    requests: goodput_requests,
                }),
            };
            let result = run_matrix(&spec, |r| {
                eprintln!(
                    "{:>9} w={:<3} r={} load={:.2} {:<20} p50 {:>7.0} p99 {:>7.0} hit {:.3}/{:.3} ({:.1} s)",
                    r.workload.as_str(),
                    r.workers,
                    r.routers,
                    r.load,
                    r.policy,
                    r.summary.ttft_p50_ms,
                    r.summary.ttft_p99_ms,
                    r.summary.hit_rate,
                    r.summary.ceiling,
                    r.wall_s
                );
            })?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            std::fs::write(out.join("report.md"), markdown(&result))?;
            std::fs::write(out.join("results.json"), serde_json::to_string_pretty(&result)?)?;
            eprintln!("wrote {}/report.md and results.json", out.display());
            let slo = goodput_slo_ms.unwrap_or(1_000.0);
            let pngs = kvroute_lab::plot::goodput_curves(&out, slo, &default_policy()).map_err(anyhow::Error::msg)?;
            if !pngs.is_empty() {
                eprintln!("drew {} goodput curves (TTFT p90 vs rate, SLO {slo} ms) in {}", pngs.len(), out.display());
            }
        }
        Cmd::Plot { dir, slo_ms } => {
            let pngs =
                kvroute_lab::plot::goodput_curves(&dir, slo_ms, &default_policy()).map_err(anyhow::Error::msg)?;
            for png in &pngs {
                println!("{}", dir.join(png).display());
            }
            if pngs.is_empty() {
                anyhow::bail!("{}: no case with two or more loads to draw a curve through", dir.display());
            }
        }
        Cmd::Crosscheck {
            bench,
            speedup,
            skip,
            max_output,
            trace,
            json,
            path_us,
            path_ns_per_token,
            requests_out,
            path_from,
        } => {
            let path = kvroute_lab::cluster::PathModel { fixed_us: path_us, ns_per_token: path_ns_per_token };
            let replay = kvroute_lab::crosscheck::Replay { trace, speedup, skip, max_output, seed: 1, path, path_from };
            let rows = kvroute_lab::crosscheck::check(&bench, &replay, requests_out.as_deref(), |r| {
                eprintln!(
                    "{:<14} {:<20} w{} r{} bench hit {:.3} p50 {:.1} ms | lab hit {:.3} p50 {:.1} ms",
                    r.workload, r.policy, r.workers, r.routers, r.bench_hit, r.bench_p50_ms, r.lab_hit, r.lab_p50_ms
                );
            })?;
            print!("{}", kvroute_lab::crosscheck::markdown(&rows, &replay));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Cmd::Gate { workloads } => {
            for kind in workloads {
                match kvroute_lab::gate::check(kind)? {
                    Ok(report) => println!("pass  {report}"),
                    Err(report) => println!("FAIL  {report}"),
                }
            }
        }
    }
    Ok(())
}

/// One row per request, in arrival order; times in ms, TTFT empty when the
/// request was rejected.
fn records_csv(records: &[kvroute_lab::measure::RequestRecord]) -> String {
    let mut out = String::from(
        "arrival_ms,ttft_ms,prompt_tokens,cached_tokens,ceiling_tokens,worker,router,reason,matched_tokens\n",
    );
    for r in records {
        let ttft = r.first_token.map_or(String::new(), |t| format!("{:.3}", (t.0 - r.arrival.0) as f64 / 1e3));
        out += &format!(
            "{:.3},{ttft},{},{},{},{},{},{},{}\n",
            r.arrival.0 as f64 / 1e3,
            r.prompt_tokens,
            r.cached_tokens,
            r.ceiling_tokens,
            r.worker,
            r.router,
            r.reason.map_or("", |x| x.as_str()),
            r.matched_tokens
        );
    }
    out
}
