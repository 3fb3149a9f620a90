//! `kvroute-bench soak --minutes N`: steady mixed traffic through the router
//! for N minutes; every sample records the router's and sidecars' resident
//! memory, the index size and the error count. Memory must plateau: the index
//! is bounded by the engines' KV capacity and everything else by the request
//! rate, so a curve that keeps rising is a leak.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_sim::cluster::Cluster;
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::client;
use crate::error::BenchError;
use crate::setup::{self, MODEL, Shape};
use crate::tokens::{extend_run, seed};
use crate::{probe, report};

const TAG: u64 = 0x534f_414b;

#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Requests per second offered (open loop, at most 32 in flight).
    #[arg(long, default_value_t = 40.0)]
    pub rate: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10)]
    pub sample_secs: u64,
    /// One minute, samples every 5 s.
    #[arg(long)]
    pub quick: bool,
    #[arg(long, default_value = "bench-out/soak")]
    pub out: std::path::PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub router_rss_mb: f64,
    pub sidecar_rss_mb: f64,
    pub index_keys: u64,
    pub index_entries: u64,
    pub ok: u64,
    pub errors: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakResult {
    pub minutes: f64,
    pub rate: f64,
    pub samples: Vec<Sample>,
    pub error_rate: f64,
    /// Router RSS growth over the second half of the run, in percent.
    pub router_rss_growth_second_half_pct: f64,
}

/// Resident set size of a process, in MB, from `/proc/PID/status`.
fn rss_mb(pid: Option<u32>) -> f64 {
    let Some(pid) = pid else { return f64::NAN };
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Request `i`'s prompt: half come from 64 shared prefixes (skewed towards
/// the first ones), half are unique; 512 to 1,536 tokens.
fn prompt(i: u64) -> Vec<u32> {
    let mut t = Vec::new();
    let r = seed(TAG, i, 7);
    if r.is_multiple_of(2) {
        let group = (r >> 8) % 64;
        let group = group * group / 64; // skew: low groups are hot
        extend_run(&mut t, seed(TAG, group, 1), 512 + (group as usize % 4) * 256);
        extend_run(&mut t, seed(TAG, i, 2), 64);
    } else {
        extend_run(&mut t, seed(TAG, i, 3), 512 + (r as usize % 1024));
    }
    t
}

pub async fn run(args: SoakArgs) -> Result<SoakResult, BenchError> {
    let (minutes, sample_every) = if args.quick { (1.0, 5) } else { (args.minutes, args.sample_secs) };
    let dir = setup::bin_dir();
    setup::ensure_all(&dir)?;
    let shape = Shape {
        workers: args.workers,
        routers: 1,
        replica_exchange: true,
        sidecars: true,
        policy: kvroute_router::policy::DEFAULT_POLICY.into(),
        num_blocks: 2048,
        sim_args: vec!["--time-scale".into(), "20".into()],
        router_args: vec![],
        tokenizer: None,
    };
    let cluster = Cluster::start(setup::spec(&shape, &dir)).await?;
    let http = client::http_client();
    let router = cluster.router_url(0).to_owned();
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let in_flight = Arc::new(Semaphore::new(32));
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(minutes * 60.0);

    let traffic = {
        let (http, router, ok, errors) = (http.clone(), router.clone(), ok.clone(), errors.clone());
        tokio::spawn(async move {
            let gap = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
            let mut tick = tokio::time::interval(gap);
            let mut i = 0u64;
            while Instant::now() < until {
                tick.tick().await;
                let Ok(permit) = in_flight.clone().acquire_owned().await else { break };
                let (http, router, ok, errors) = (http.clone(), router.clone(), ok.clone(), errors.clone());
                let body = client::completion_body(MODEL, &prompt(i), 8, true, false);
                tokio::spawn(async move {
                    let counter = match client::complete(&http, &router, body, Duration::from_secs(60)).await {
                        Ok(_) => &ok,
                        Err(_) => &errors,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    drop(permit);
                });
                i += 1;
            }
        })
    };

    let router_pid = cluster.routers[0].proc.pid();
    let sidecar_pids: Vec<Option<u32>> = cluster.sidecars.iter().map(|s| s.proc.pid()).collect();
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(sample_every));
    loop {
        tick.tick().await;
        let index = probe::get_json(&http, &format!("{router}/debug/index")).await?;
        let sample = Sample {
            t_s: started.elapsed().as_secs_f64(),
            router_rss_mb: rss_mb(router_pid),
            sidecar_rss_mb: sidecar_pids.iter().map(|p| rss_mb(*p)).sum(),
            index_keys: index["keys"].as_u64().unwrap_or(0),
            index_entries: index["entries"].as_u64().unwrap_or(0),
            ok: ok.load(Ordering::Relaxed),
            errors: errors.load(Ordering::Relaxed),
        };
        eprintln!(
            "soak {:>5.0} s: router {:.1} MB, sidecars {:.1} MB, index {} entries, {} ok, {} errors",
            sample.t_s, sample.router_rss_mb, sample.sidecar_rss_mb, sample.index_entries, sample.ok, sample.errors
        );
        samples.push(sample);
        if Instant::now() >= until {
            break;
        }
    }
    let _ = traffic.await;
    cluster.shutdown().await;

    let half = samples.len() / 2;
    let mid = samples.get(half).map_or(f64::NAN, |s| s.router_rss_mb);
    let end = samples.last().map_or(f64::NAN, |s| s.router_rss_mb);
    let last = samples.last().cloned();
    let total = last.as_ref().map_or(0, |s| s.ok + s.errors);
    let result = SoakResult {
        minutes,
        rate: args.rate,
        error_rate: last.map_or(0.0, |s| s.errors as f64 / total.max(1) as f64),
        router_rss_growth_second_half_pct: (end - mid) / mid * 100.0,
        samples,
    };
    report::write_results(&args.out, &args, &result)?;
    let rows: Vec<Vec<String>> = result
        .samples
        .iter()
        .map(|s| {
            vec![
                format!("{:.0}", s.t_s),
                format!("{:.1}", s.router_rss_mb),
                format!("{:.1}", s.sidecar_rss_mb),
                s.index_entries.to_string(),
                s.ok.to_string(),
                s.errors.to_string(),
            ]
        })
        .collect();
    let md = format!(
        "# kvroute-bench soak\n\n{minutes} min, {} req/s offered, {} workers (2,048 KV blocks each).\n\n\
         Router RSS growth over the second half: {:.1} %. Error rate: {:.3} %.\n\n{}\n\nMachine: {}\n",
        args.rate,
        args.workers,
        result.router_rss_growth_second_half_pct,
        result.error_rate * 100.0,
        report::table(&["t (s)", "router RSS (MB)", "sidecars RSS (MB)", "index entries", "ok", "errors"], &rows),
        report::machine()
    );
    report::write(&args.out.join("report.md"), md.as_bytes())?;
    Ok(result)
}
