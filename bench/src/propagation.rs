//! `kvroute-bench propagation`: how long a vLLM KV event takes to reach the
//! router's map — engine publishes `BlockStored`, the sidecar decodes,
//! translates and pushes it on its next fast-path tick, the router applies it.
//!
//! Each sample sends a fresh prompt straight to an `--instant` engine (no
//! router involved, so no speculative entry exists) and polls the router's
//! `/debug/route` every millisecond until the prompt's blocks show up on that
//! worker. Prefill in `--instant` mode takes microseconds, so the figure is the
//! event path itself, dominated by the sidecar's 100 ms fast-path window.

use std::time::{Duration, Instant};

use kvroute_sim::cluster::Cluster;
use serde::Serialize;

use crate::client;
use crate::error::BenchError;
use crate::report::progress::Progress;
use crate::setup::{self, MODEL, Shape};
use crate::tokens::{extend_run, seed};
use crate::{probe, report, stats};

const TAG: u64 = 0x5052_4f50;
const POLL: Duration = Duration::from_millis(1);
const WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, clap::Args)]
pub struct PropagationArgs {
    /// Samples (events followed end to end).
    #[arg(long, default_value_t = 200)]
    pub samples: usize,
    /// Prompt length in tokens (blocks of 16).
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    #[arg(long)]
    pub quick: bool,
    #[arg(long, default_value = "bench-out/propagation")]
    pub out: std::path::PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct PropagationResult {
    pub samples: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
    pub fast_interval_ms: u64,
}

pub async fn run(args: PropagationArgs) -> Result<PropagationResult, BenchError> {
    let samples = if args.quick { 20 } else { args.samples };
    let dir = setup::bin_dir();
    setup::ensure_all(&dir)?;
    let shape = Shape {
        workers: 1,
        routers: 1,
        replica_exchange: true,
        sidecars: true,
        policy: kvroute_router::policy::DEFAULT_POLICY.into(),
        num_blocks: 65_536,
        sim_args: vec!["--instant".into()],
        router_args: vec![],
        tokenizer: None,
    };
    let mut progress = Progress::new("propagation", samples, Duration::from_secs(5));
    progress.note("starting a simulated engine, its sidecar and a router");
    let cluster = Cluster::start(setup::spec(&shape, &dir)).await?;
    progress.note(format!("cluster up; following {samples} events of {} tokens", args.prompt_len));
    let http = client::http_client();
    let router = cluster.router_url(0).to_owned();
    let engine = cluster.engines[0].url.clone();
    let worker = kvroute_sim::cluster::worker_id(0);
    let blocks = (args.prompt_len / setup::BLOCK_SIZE as usize) as u64;
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        let mut prompt = Vec::new();
        extend_run(&mut prompt, seed(TAG, i as u64, 0), args.prompt_len);
        let body = client::completion_body(MODEL, &prompt, 1, false, false);
        let started = Instant::now();
        client::complete(&http, &engine, body, WAIT).await?;
        loop {
            let view = probe::debug_route(&http, &router, MODEL, &prompt).await?;
            if view.matched_blocks(&worker) >= blocks {
                let took = started.elapsed();
                latencies.push(took);
                progress.step(i + 1, format_args!("last {:.1} ms", took.as_secs_f64() * 1e3));
                break;
            }
            if started.elapsed() > WAIT {
                return Err(BenchError::Timeout(format!("sample {i}: blocks never reached the router")));
            }
            tokio::time::sleep(POLL).await;
        }
    }
    cluster.shutdown().await;
    latencies.sort();
    let result = PropagationResult {
        samples,
        p50_ms: stats::percentile_ms(&latencies, 50.0),
        p90_ms: stats::percentile_ms(&latencies, 90.0),
        p99_ms: stats::percentile_ms(&latencies, 99.0),
        max_ms: stats::percentile_ms(&latencies, 100.0),
        mean_ms: stats::mean_ms(&latencies),
        fast_interval_ms: 100,
    };
    report::write_results(&args.out, &args, &result)?;
    let md = format!(
        "# kvroute-bench propagation\n\nvLLM KV event → router map applied, {samples} samples, {}-token prompts, \
         engine `--instant`, sidecar fast interval 100 ms.\n\n{}\n\nMachine: {}\n",
        args.prompt_len,
        report::table(
            &["p50", "p90", "p99", "max", "mean"],
            &[vec![
                report::ms(result.p50_ms),
                report::ms(result.p90_ms),
                report::ms(result.p99_ms),
                report::ms(result.max_ms),
                report::ms(result.mean_ms),
            ]]
        ),
        report::machine()
    );
    report::write(&args.out.join("report.md"), md.as_bytes())?;
    Ok(result)
}
