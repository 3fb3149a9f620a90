//! kvroute-bench: whole-system benchmarks of kvroute on a local cluster of
//! simulated vLLM engines, sidecars and routers (started through
//! `kvroute_sim::cluster`). Subcommands: `lifecycle` (a prefix's states in
//! the router's map, checked and timed), `compare` (workloads × policies:
//! hit rate against the infinite-cache ceiling, TTFT, load spread) and
//! `overhead` (router vs direct). Each writes `results.json`, `report.md`
//! and PNG plots to its output folder.
//!
//! Workload generation and the ceiling are pure functions with unit tests;
//! timings are benchmark figures, never test assertions.

pub mod ceiling;
pub mod cli;
pub mod client;
pub mod compare;
pub mod drive;
pub mod error;
pub mod lifecycle;
pub mod overhead;
pub mod probe;
pub mod report;
pub mod setup;
pub mod stats;
pub mod tokens;
pub mod workload;

use cli::Command;
use error::BenchError;

/// Runs one subcommand to completion; its report is on disk when this returns.
pub async fn run(command: Command) -> Result<String, BenchError> {
    match command {
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
            let records = compare::run(args).await?;
            Ok(format!("compare: {} runs; report in {}", records.len(), out.display()))
        }
        Command::Overhead(mut args) => {
            if args.quick {
                args.requests = 400;
                args.seconds = 4.0;
            }
            let out = args.out.clone();
            let r = overhead::run(args).await?;
            Ok(format!(
                "overhead: router adds {:.3} ms p50, {:.3} ms p99 at c=1; {:.0} % of direct throughput at c=64; report in {}",
                r.added_p50_ms,
                r.added_p99_ms,
                r.throughput_ratio * 100.0,
                out.display()
            ))
        }
    }
}
