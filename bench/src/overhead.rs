//! `kvroute-bench overhead`: what a router adds. One engine in `--instant`
//! mode (no modelled delays, so every microsecond measured is real software
//! cost), the same requests sent to the engine directly, through kvroute (no
//! sidecars), and through the peer routers found on this machine (SMG,
//! vllm-router; see [`crate::peers`]), at one or more prompt lengths:
//! latency at concurrency 1 (p50/p99, interleaved in blocks across every
//! path so drift in the shared machine's load hits all alike) and
//! closed-loop throughput at concurrency 64 (two rounds, paths alternating).
//! `--baseline-router` adds a second kvroute build to the same run, for
//! before/after comparisons of a change.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kvroute_sim::cluster::{Cluster, LOCAL_TOKEN, Proc, worker_id};
use serde::Serialize;

use crate::cli::OverheadArgs;
use crate::error::BenchError;
use crate::peers;
use crate::setup::{self, BLOCK_SIZE, MODEL, Shape};
use crate::stats::percentile_ms;
use crate::tokens::{extend_run, seed};
use crate::{client, report};

const TAG: u64 = 0x4f56_4552;
const DISTINCT: usize = 256;
const BLOCK: usize = 50;
const CONCURRENCY: usize = 64;

#[derive(Debug, Clone, Serialize)]
pub struct PathFigures {
    pub path: String,
    pub prompt_tokens: usize,
    pub c1_requests: usize,
    pub c1_p50_ms: f64,
    pub c1_p90_ms: f64,
    pub c1_p99_ms: f64,
    /// p50 and p99 minus the direct path's, same prompt length.
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub c64_throughput_rps: f64,
    /// Throughput at concurrency 64 ÷ the direct path's.
    pub throughput_ratio: f64,
    pub c64_p50_ms: f64,
    pub c64_p99_ms: f64,
    pub errors: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Results {
    pub paths: Vec<PathFigures>,
    /// Peers not measured, and why.
    pub absent: Vec<String>,
    /// kvroute at the first prompt length (the summary line).
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub throughput_ratio: f64,
}

/// Prompts of `len` tokens: the first half shared (so the engine's cache is
/// exercised as in real traffic), the rest one of `DISTINCT` suffixes.
/// Token ids, or, with `text`, English-like sentences of about `len` tokens.
fn bodies(len: usize, text: bool) -> Arc<Vec<Vec<u8>>> {
    Arc::new(
        (0..DISTINCT)
            .map(|i| {
                if text {
                    let prompt = format!("{}\n{}", sentences(0, len / 2), sentences(1 + i as u64, len / 2));
                    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": false});
                    return serde_json::to_vec(&body).unwrap_or_default();
                }
                let mut t = Vec::with_capacity(len);
                extend_run(&mut t, seed(TAG, 0, 0), len / 2);
                extend_run(&mut t, seed(TAG, 1, i as u64), len - len / 2);
                client::completion_body(MODEL, &t, 1, false, false)
            })
            .collect(),
    )
}

/// About `tokens` tokens of sentences (a word is about one GPT-2 token),
/// different for each `seed`.
pub fn sentences(seed: u64, tokens: usize) -> String {
    const WORDS: &[&str] = &[
        "the", "router", "keeps", "a", "map", "of", "which", "worker", "holds", "each", "block", "and", "sends",
        "every", "request", "where", "its", "prefix", "is", "cached", "so", "prefill", "work", "shrinks", "while",
        "load", "stays", "even", "across", "engines", "in", "one", "cluster",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(tokens * 7);
    for n in 0..tokens {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = WORDS[(x % WORDS.len() as u64) as usize];
        if n % 12 == 0 {
            if n > 0 {
                out.push_str(". ");
            }
            let mut c = w.chars();
            out.extend(c.next().map(|f| f.to_ascii_uppercase()));
            out.push_str(c.as_str());
        } else {
            out.push(' ');
            out.push_str(w);
        }
    }
    out.push('.');
    out
}

async fn one(http: &reqwest::Client, base: &str, body: &[u8]) -> Result<Duration, BenchError> {
    let o = client::complete(http, base, body.to_vec(), Duration::from_secs(30)).await?;
    Ok(o.latency)
}

/// `concurrency` closed-loop clients for `secs`: (completed, latencies, errors).
async fn closed_loop(
    http: &reqwest::Client,
    base: &str,
    bodies: &Arc<Vec<Vec<u8>>>,
    concurrency: usize,
    secs: f64,
) -> (usize, Vec<Duration>, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..concurrency)
        .map(|c| {
            let (http, base, bodies, stop) = (http.clone(), base.to_owned(), bodies.clone(), stop.clone());
            tokio::spawn(async move {
                let mut lats = Vec::new();
                let mut errors = 0;
                let mut k = c;
                while !stop.load(Ordering::Relaxed) {
                    match one(&http, &base, &bodies[k % bodies.len()]).await {
                        Ok(d) => lats.push(d),
                        Err(_) => errors += 1,
                    }
                    k += concurrency;
                }
                (lats, errors)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut lats = Vec::new();
    let mut errors = 0;
    for t in tasks {
        if let Ok((l, e)) = t.await {
            lats.extend(l);
            errors += e;
        }
    }
    (lats.len(), lats, errors)
}

/// A path under test: a name and the base URL requests go to.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    url: String,
}

/// Everything running besides the cluster, stopped at the end.
#[derive(Default)]
struct Extras {
    procs: Vec<Proc>,
    absent: Vec<String>,
}

pub async fn run(args: OverheadArgs) -> Result<Results, BenchError> {
    let dir = setup::bin_dir();
    setup::ensure_all(&dir)?;
    let shape = Shape {
        workers: 1,
        routers: 1,
        replica_exchange: true,
        sidecars: false,
        policy: kvroute_router::policy::DEFAULT_POLICY.into(),
        num_blocks: 8192,
        // Room for 32k-token prompts (the default model length is 32,768).
        sim_args: vec!["--instant".into(), "--max-model-len".into(), "131072".into()],
        router_args: Vec::new(),
        tokenizer: None,
    };
    let mut spec = setup::spec(&shape, &dir);
    spec.tokenizer = args.text_tokenizer.clone();
    let cluster = Cluster::start(spec).await?;
    let mut targets = vec![
        Target { name: "direct".into(), url: cluster.engines[0].url.clone() },
        Target { name: "kvroute".into(), url: cluster.router_url(0).to_owned() },
    ];
    let mut extras = Extras::default();
    let started = start_extras(&args, &cluster, &dir, &mut targets, &mut extras).await;
    let result = match started {
        Ok(()) => measure_all(&targets, &args).await,
        Err(e) => Err(e),
    };
    for mut p in extras.procs {
        p.kill().await;
    }
    cluster.shutdown().await;
    let paths = result?;
    let first = paths.iter().find(|p| p.path == "kvroute");
    let results = Results {
        added_p50_ms: first.map_or(0.0, |p| p.added_p50_ms),
        added_p99_ms: first.map_or(0.0, |p| p.added_p99_ms),
        throughput_ratio: first.map_or(0.0, |p| p.throughput_ratio),
        absent: extras.absent,
        paths,
    };
    report::write_results(&args.out, &args, &results)?;
    report::write(&args.out.join("report.md"), render(&results, &args).as_bytes())?;
    for a in &results.absent {
        eprintln!("not measured: {a}");
    }
    Ok(results)
}

/// Starts the baseline router and the peers that are installed; each that
/// cannot run is recorded in `extras.absent` with the reason.
async fn start_extras(
    args: &OverheadArgs,
    cluster: &Cluster,
    dir: &Path,
    targets: &mut Vec<Target>,
    extras: &mut Extras,
) -> Result<(), BenchError> {
    let engine = &cluster.engines[0];
    if let Some(bin) = &args.baseline_router {
        let mut a: Vec<String> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--policy".into(),
            kvroute_router::policy::DEFAULT_POLICY.into(),
            "--block-size".into(),
            BLOCK_SIZE.to_string(),
            "--internal-token".into(),
            LOCAL_TOKEN.into(),
            "--worker".into(),
            format!("{}={}", worker_id(0), engine.url),
        ];
        if let Some(t) = &args.text_tokenizer {
            a.extend(["--tokenizer".into(), t.display().to_string()]);
        }
        let mut proc = Proc::spawn("baseline router", bin, &a).await?;
        let url = proc.announced("listening on ").await?;
        kvroute_sim::cluster::wait_router_ready(&proc, &url, 1).await?;
        targets.push(Target { name: "kvroute baseline".into(), url });
        extras.procs.push(proc);
    }
    if args.no_peers {
        extras.absent.push("peers: --no-peers".into());
        return Ok(());
    }
    let http = client::http_client();
    for peer in peers::ALL {
        let flag = args.peer_bins.given(peer.exe());
        let Some(bin) = peers::find(flag, peer.exe(), dir) else {
            extras.absent.push(format!(
                "{}: absent (no `{}` {}; pip install {})",
                peer.name(),
                peer.exe(),
                flag.map_or("on PATH or in target/peers-venv/bin".to_owned(), |f| format!("at {}", f.display())),
                peer.exe()
            ));
            continue;
        };
        eprintln!("starting {} ({})", peer.name(), bin.display());
        let fleet = peers::Fleet {
            engines: vec![peers::EngineAt { url: engine.url.clone(), events: engine.events.clone() }],
            model: MODEL.into(),
            block_size: BLOCK_SIZE,
        };
        match peers::start(peer, &bin, &fleet, &http).await {
            Ok(r) => {
                targets.push(Target { name: peer.name().into(), url: r.url });
                extras.procs.push(r.proc);
            }
            Err(e) => extras.absent.push(format!("{}: failed to start: {e}", peer.name())),
        }
    }
    Ok(())
}

async fn measure_all(targets: &[Target], args: &OverheadArgs) -> Result<Vec<PathFigures>, BenchError> {
    let mut all = Vec::new();
    for &len in &args.prompt_tokens {
        eprintln!("{len}-token prompts, {} paths", targets.len());
        let mut figs = measure(targets, len, args).await?;
        let (d50, d99, drps) = (figs[0].c1_p50_ms, figs[0].c1_p99_ms, figs[0].c64_throughput_rps);
        for f in &mut figs {
            f.added_p50_ms = f.c1_p50_ms - d50;
            f.added_p99_ms = f.c1_p99_ms - d99;
            f.throughput_ratio = if drps > 0.0 { f.c64_throughput_rps / drps } else { 0.0 };
        }
        all.extend(figs);
    }
    Ok(all)
}

fn render(results: &Results, args: &OverheadArgs) -> String {
    let mut md = String::from("# kvroute-bench overhead\n\n");
    md.push_str(&format!(
        "Machine: {}. One kvroute-sim engine in `--instant` mode; kvroute ({}, no sidecars) and the peer \
         routers in front of it; non-streaming completions of {} prompts (half shared, half one of {DISTINCT} \
         suffixes), 1 output token. Concurrency 1: {} requests per path, interleaved in blocks of {BLOCK} \
         across all paths. Concurrency {CONCURRENCY}: closed loop, {} s per path in two halves, paths \
         alternating. Client, routers and engine share the machine's cores; peers log at warning level.\n\n",
        report::machine(),
        kvroute_router::policy::DEFAULT_POLICY,
        args.text_tokenizer.as_ref().map_or("token-id".to_owned(), |t| format!("text ({})", t.display())),
        args.requests,
        args.seconds
    ));
    for &len in &args.prompt_tokens {
        md.push_str(&format!("## {len}-token prompts\n\n"));
        let rows: Vec<Vec<String>> = results
            .paths
            .iter()
            .filter(|p| p.prompt_tokens == len)
            .map(|p| {
                vec![
                    p.path.clone(),
                    report::ms(p.c1_p50_ms),
                    report::ms(p.c1_p99_ms),
                    format!("{:+.2}", p.added_p50_ms),
                    format!("{:+.2}", p.added_p99_ms),
                    format!("{:.0}", p.c64_throughput_rps),
                    format!("{:.2}", p.throughput_ratio),
                    report::ms(p.c64_p50_ms),
                    report::ms(p.c64_p99_ms),
                    p.errors.to_string(),
                ]
            })
            .collect();
        md.push_str(&report::table(
            &[
                "path",
                "c=1 p50 ms",
                "c=1 p99 ms",
                "added p50",
                "added p99",
                "c=64 req/s",
                "÷ direct",
                "c=64 p50 ms",
                "c=64 p99 ms",
                "errors",
            ],
            &rows,
        ));
        md.push('\n');
    }
    if !results.absent.is_empty() {
        md.push_str("Not measured:\n\n");
        for a in &results.absent {
            md.push_str(&format!("- {a}\n"));
        }
    }
    md.push_str(&report::plots_section("overhead", &args.out));
    md
}

async fn measure(targets: &[Target], len: usize, args: &OverheadArgs) -> Result<Vec<PathFigures>, BenchError> {
    let http = client::http_client();
    let bodies = bodies(len, args.text_tokenizer.is_some());
    // The engine first sees every body directly, so its own (cached)
    // tokenization costs every path the same: otherwise the path that
    // happens to bring a suffix first pays the engine's cold encoding.
    for b in bodies.iter() {
        one(&http, &targets[0].url, b).await?;
    }
    // Warm-up: connections, the routers' maps.
    for t in targets {
        for b in bodies.iter().take(BLOCK) {
            one(&http, &t.url, b).await?;
        }
    }
    let pb = ProgressBar::new((args.requests * targets.len()) as u64);
    pb.set_style(
        ProgressStyle::with_template("c=1 {bar:30} {pos}/{len} [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut c1: Vec<Vec<Duration>> = vec![Vec::new(); targets.len()];
    let mut errors = vec![0usize; targets.len()];
    let mut k = 0;
    while c1[0].len() < args.requests {
        // Every path gets the same bodies in the same order.
        for (p, t) in targets.iter().enumerate() {
            for i in 0..BLOCK {
                match one(&http, &t.url, &bodies[(k + i) % bodies.len()]).await {
                    Ok(d) => c1[p].push(d),
                    Err(_) => errors[p] += 1,
                }
                pb.inc(1);
            }
        }
        k += BLOCK;
    }
    pb.finish_and_clear();
    let mut c64: Vec<(usize, Vec<Duration>, f64)> = vec![(0, Vec::new(), 0.0); targets.len()];
    let half = args.seconds / 2.0;
    for round in 0..2 {
        for (p, t) in targets.iter().enumerate() {
            eprintln!("c={CONCURRENCY} {} ({len} tokens), round {} of 2, {half} s", t.name, round + 1);
            let started = Instant::now();
            let (n, lats, e) = closed_loop(&http, &t.url, &bodies, CONCURRENCY, half).await;
            c64[p].0 += n;
            c64[p].1.extend(lats);
            c64[p].2 += started.elapsed().as_secs_f64();
            errors[p] += e;
        }
    }
    Ok(targets
        .iter()
        .enumerate()
        .map(|(p, t)| {
            c1[p].sort();
            c64[p].1.sort();
            PathFigures {
                path: t.name.clone(),
                prompt_tokens: len,
                c1_requests: c1[p].len(),
                c1_p50_ms: percentile_ms(&c1[p], 50.0),
                c1_p90_ms: percentile_ms(&c1[p], 90.0),
                c1_p99_ms: percentile_ms(&c1[p], 99.0),
                added_p50_ms: 0.0,
                added_p99_ms: 0.0,
                c64_throughput_rps: if c64[p].2 > 0.0 { c64[p].0 as f64 / c64[p].2 } else { 0.0 },
                throughput_ratio: 0.0,
                c64_p50_ms: percentile_ms(&c64[p].1, 50.0),
                c64_p99_ms: percentile_ms(&c64[p].1, 99.0),
                errors: errors[p],
            }
        })
        .collect())
}
