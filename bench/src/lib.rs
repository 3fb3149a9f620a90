//! kvroute-bench: whole-system benchmarks of kvroute on a local cluster of
//! simulated vLLM engines, sidecars and routers (started through
//! `kvroute_sim::cluster`), or of real vLLM engines (`--engine vllm`,
//! lifecycle and compare) with the same sidecars and routers in front. Subcommands: `lifecycle` (a prefix's states in
//! the router's map, checked and timed), `compare` (workloads × policies:
//! hit rate against the infinite-cache ceiling, TTFT, load spread) and
//! `overhead` (router vs direct), `propagation` (engine event → router map
//! latency), `soak` (memory over a long run) and `restarts` (engine, router
//! and sidecar restarts → map true again). Each writes `results.json`, `report.md`
//! and PNG plots to its output folder.
//!
//! Workload generation and the ceiling are pure functions with unit tests;
//! timings are benchmark figures, never test assertions.

pub mod antientropy;
pub mod ceiling;
pub mod cli;
pub mod client;
pub mod compare;
pub mod drive;
pub mod engine;
pub mod error;
pub mod lifecycle;
pub mod overhead;
pub mod peers;
pub mod probe;
pub mod propagation;
pub mod report;
pub mod restarts;
pub mod rig;
pub mod setup;
pub mod soak;
pub mod stats;
pub mod tokens;
pub mod vllm;
pub mod words;
pub mod workload;

use cli::Command;
use error::BenchError;

/// Runs one subcommand to completion; its report is on disk when this
/// returns. Ctrl-C or SIGTERM drops the run, and with it every child: the
/// real vLLM engines run in their own process groups, out of the terminal's
/// reach, and are killed by their handles' `Drop`.
pub async fn run(command: Command) -> Result<String, BenchError> {
    tokio::select! {
        r = run_command(command) => r,
        () = kvroute_sim::cluster::shutdown_signal() => Err(BenchError::Interrupted),
    }
}

async fn run_command(command: Command) -> Result<String, BenchError> {
    match command {
        Command::Plot(args) => {
            let files = report::plot::draw(&args.kind, &args.dir).map_err(BenchError::Usage)?;
            Ok(format!("plot: {} in {}", files.join(", "), args.dir.display()))
        }
        Command::Lifecycle(args) => {
            let out = args.out.clone();
            let steps = lifecycle::run(args).await?;
            let failed = steps.iter().filter(|s| !s.pass).count();
            Ok(format!(
                "lifecycle: {} of {} states PASS; report in {}",
                steps.len() - failed,
                steps.len(),
                out.display()
            ))
        }
        Command::Compare(args) => {
            let out = args.out.clone();
            let records = compare::run(*args).await?;
            Ok(format!("compare: {} runs; report in {}", records.len(), out.display()))
        }
        Command::Antientropy(args) => {
            let out = args.out.clone();
            let r = antientropy::run(args).await?;
            let line = |f: &antientropy::Figures| {
                format!(
                    "v{}: {:.2} MB/s received, {:.3} router cores, lookup p99 {:.1} µs during syncs, heal p50 {:.0} ms",
                    f.protocol,
                    f.bytes_per_s / 1e6,
                    f.router_cores,
                    f.lookup_p99_during_sync_us,
                    f.heal_p50_ms
                )
            };
            Ok(format!(
                "antientropy: {}; report in {}",
                r.runs.iter().map(line).collect::<Vec<_>>().join("; "),
                out.display()
            ))
        }
        Command::Propagation(args) => {
            let out = args.out.clone();
            let r = propagation::run(args).await?;
            Ok(format!(
                "propagation: event → router map p50 {:.1} ms, p99 {:.1} ms over {} samples; report in {}",
                r.p50_ms,
                r.p99_ms,
                r.samples,
                out.display()
            ))
        }
        Command::Soak(args) => {
            let out = args.out.clone();
            let r = soak::run(args).await?;
            Ok(format!(
                "soak: {:.0} min, error rate {:.3} %, router RSS {:+.1} % over the second half; report in {}",
                r.minutes,
                r.error_rate * 100.0,
                r.router_rss_growth_second_half_pct,
                out.display()
            ))
        }
        Command::Restarts(args) => {
            let out = args.out.clone();
            let r = restarts::run(args).await?;
            Ok(format!("restarts: {}; report in {}", r.summary(), out.display()))
        }
        Command::Overhead(mut args) => {
            if args.quick {
                args.requests = 400;
                args.seconds = 4.0;
            }
            let out = args.out.clone();
            let r = overhead::run(args).await?;
            Ok(format!(
                "overhead: kvroute adds {:.3} ms p50, {:.3} ms p99 at c=1; {:.0} % of direct throughput at c=64; report in {}",
                r.added_p50_ms,
                r.added_p99_ms,
                r.throughput_ratio * 100.0,
                out.display()
            ))
        }
    }
}
