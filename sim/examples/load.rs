//! A closed-loop load generator for the simulator's overhead benchmark:
//! `--concurrency` workers send non-streaming completions with a
//! `--prompt-tokens` token-id prompt until `--requests` are done or
//! `--seconds` pass, then print throughput and latency percentiles.
//!
//! Without `--url` it starts an `--instant` simulator in-process on
//! `127.0.0.1:0` (same process, so the figure includes the client's cost).
//!
//! ```text
//! cargo run --release -p kvroute-sim --example load -- --url http://127.0.0.1:8000
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kvroute_sim::{Config, Sim};

#[derive(Debug, Parser)]
struct Opts {
    /// Simulator base URL; omitted: start one in-process (instant mode).
    #[arg(long)]
    url: Option<String>,
    #[arg(long, default_value = "sim-model")]
    model: String,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: u32,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Distinct prompts cycled through (shared prefixes make cache hits).
    #[arg(long, default_value_t = 256)]
    distinct: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let opts = Opts::parse();
    let (url, _stop) = match &opts.url {
        Some(u) => (u.trim_end_matches('/').to_owned(), None),
        None => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let sim = Sim::start(listener, Config::for_model(&opts.model)).await?;
            let url = sim.info().listen.clone();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(sim.serve(async {
                let _ = rx.await;
            }));
            (url, Some(tx))
        }
    };
    let bodies: Arc<Vec<bytes::Bytes>> = Arc::new(
        (0..opts.distinct)
            .map(|d| {
                let prompt: Vec<u32> =
                    (0..opts.prompt_tokens).map(|i| if i < 512 { i } else { d * 7919 + i }).collect();
                let body = serde_json::json!({"model": opts.model, "prompt": prompt, "max_tokens": opts.max_tokens});
                bytes::Bytes::from(body.to_string())
            })
            .collect(),
    );
    let client = reqwest::Client::builder().pool_max_idle_per_host(opts.concurrency).build()?;
    let endpoint = format!("{url}/v1/completions");
    client.get(format!("{url}/health")).send().await.context("simulator not reachable")?.error_for_status()?;

    let issued = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(opts.seconds);
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..opts.concurrency {
        let (client, endpoint, bodies, issued, errors) =
            (client.clone(), endpoint.clone(), bodies.clone(), issued.clone(), errors.clone());
        let limit = opts.requests;
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let n = issued.fetch_add(1, Relaxed);
                if n >= limit || Instant::now() >= deadline {
                    return lat;
                }
                let body = bodies[(n % bodies.len() as u64) as usize].clone();
                let t = Instant::now();
                let ok = match client.post(&endpoint).header("content-type", "application/json").body(body).send().await
                {
                    Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                    _ => false,
                };
                if ok {
                    lat.push(t.elapsed());
                } else {
                    errors.fetch_add(1, Relaxed);
                }
            }
        }));
    }
    let mut lat = Vec::new();
    for w in workers {
        lat.extend(w.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();
    lat.sort();
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied();
    println!(
        "completed {} requests ({} errors) in {:.2}s: {:.0} req/s; latency p50 {:?} p99 {:?} (concurrency {}, {} prompt tokens, {} max tokens)",
        lat.len(),
        errors.load(Relaxed),
        elapsed,
        lat.len() as f64 / elapsed,
        pct(0.5).unwrap_or_default(),
        pct(0.99).unwrap_or_default(),
        opts.concurrency,
        opts.prompt_tokens,
        opts.max_tokens,
    );
    Ok(())
}
