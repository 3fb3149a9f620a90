//! `kvroute-bench overhead`: what the router adds. One engine in `--instant`
//! mode (no modelled delays, so every microsecond measured is real software
//! cost), the same 1k-token requests sent to the engine directly and through
//! the router: latency at concurrency 1 (p50/p99, interleaved in blocks so
//! drift in the shared machine's load hits both paths alike) and closed-loop
//! throughput at concurrency 64.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kvroute_sim::cluster::Cluster;
use serde::Serialize;

use crate::cli::OverheadArgs;
use crate::error::BenchError;
use crate::setup::{self, MODEL, Shape};
use crate::stats::percentile_ms;
use crate::tokens::{extend_run, seed};
use crate::{client, report};

const TAG: u64 = 0x4f56_4552;
const DISTINCT: usize = 256;
const BLOCK: usize = 50;

#[derive(Debug, Clone, Serialize)]
pub struct PathFigures {
    pub path: String,
    pub c1_requests: usize,
    pub c1_p50_ms: f64,
    pub c1_p90_ms: f64,
    pub c1_p99_ms: f64,
    pub c64_throughput_rps: f64,
    pub c64_p50_ms: f64,
    pub c64_p99_ms: f64,
    pub errors: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Results {
    pub paths: Vec<PathFigures>,
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
fn sentences(seed: u64, tokens: usize) -> String {
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

pub async fn run(args: OverheadArgs) -> Result<Results, BenchError> {
    let dir = setup::bin_dir();
    setup::ensure_all(&dir)?;
    let shape = Shape {
        workers: 1,
        routers: 1,
        sidecars: true,
        policy: kvroute_router::policy::DEFAULT_POLICY.into(),
        num_blocks: 8192,
        sim_args: vec!["--instant".into()],
        router_args: Vec::new(),
    };
    let mut spec = setup::spec(&shape, &dir);
    spec.tokenizer = args.text_tokenizer.clone();
    let cluster = Cluster::start(spec).await?;
    let paths = [
        ("direct".to_string(), cluster.engines[0].url.clone()),
        ("router".to_string(), cluster.router_url(0).to_owned()),
    ];
    let result = measure(&paths, &args).await;
    cluster.shutdown().await;
    let figures = result?;
    let (d, r) = (&figures[0], &figures[1]);
    let results = Results {
        added_p50_ms: r.c1_p50_ms - d.c1_p50_ms,
        added_p99_ms: r.c1_p99_ms - d.c1_p99_ms,
        throughput_ratio: if d.c64_throughput_rps > 0.0 { r.c64_throughput_rps / d.c64_throughput_rps } else { 0.0 },
        paths: figures,
    };
    report::write_json(&args.out.join("results.json"), &results)?;
    let mut md = String::from("# kvroute-bench overhead\n\n");
    md.push_str(&format!(
        "Machine: {}. One kvroute-sim engine in `--instant` mode with its sidecar, one router ({}); \
         non-streaming completions of {}-token {} prompts (half shared, half one of {DISTINCT} suffixes), \
         1 output token. Concurrency 1: {} requests per path, interleaved in blocks of {BLOCK}. Concurrency 64: \
         closed loop, {} s per path in two halves, direct and router alternating. Client, router, sidecar and \
         engine share the machine's cores.\n\n",
        report::machine(),
        kvroute_router::policy::DEFAULT_POLICY,
        args.prompt_tokens,
        args.text_tokenizer.as_ref().map_or("token-id".to_owned(), |t| format!("text ({})", t.display())),
        args.requests,
        args.seconds
    ));
    let rows: Vec<Vec<String>> = results
        .paths
        .iter()
        .map(|p| {
            vec![
                p.path.clone(),
                report::ms(p.c1_p50_ms),
                report::ms(p.c1_p90_ms),
                report::ms(p.c1_p99_ms),
                format!("{:.0}", p.c64_throughput_rps),
                report::ms(p.c64_p50_ms),
                report::ms(p.c64_p99_ms),
                p.errors.to_string(),
            ]
        })
        .collect();
    md.push_str(&report::table(
        &["path", "c=1 p50 ms", "c=1 p90 ms", "c=1 p99 ms", "c=64 req/s", "c=64 p50 ms", "c=64 p99 ms", "errors"],
        &rows,
    ));
    md.push_str(&format!(
        "\nAdded by the router at concurrency 1: **{:.3} ms p50**, {:.3} ms p99 ({}: ≤ 0.25 ms p50). \
         Throughput at concurrency 64 through the router: {:.0} % of direct.\n",
        results.added_p50_ms,
        results.added_p99_ms,
        if results.added_p50_ms <= 0.25 { "PASS" } else { "FAIL" },
        results.throughput_ratio * 100.0
    ));
    md.push_str(&report::plots_section("overhead", &args.out));
    report::write(&args.out.join("report.md"), md.as_bytes())?;
    Ok(results)
}

async fn measure(paths: &[(String, String)], args: &OverheadArgs) -> Result<Vec<PathFigures>, BenchError> {
    let http = client::http_client();
    let bodies = bodies(args.prompt_tokens, args.text_tokenizer.is_some());
    // Warm-up: connections, the engine's cache, the router's map.
    for (_, base) in paths {
        for b in bodies.iter().take(BLOCK) {
            one(&http, base, b).await?;
        }
    }
    let pb = ProgressBar::new((args.requests * paths.len()) as u64);
    pb.set_style(
        ProgressStyle::with_template("c=1 {bar:30} {pos}/{len} [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut c1: Vec<Vec<Duration>> = vec![Vec::new(); paths.len()];
    let mut errors = vec![0usize; paths.len()];
    let mut k = 0;
    while c1[0].len() < args.requests {
        for (p, (_, base)) in paths.iter().enumerate() {
            for _ in 0..BLOCK {
                match one(&http, base, &bodies[k % bodies.len()]).await {
                    Ok(d) => c1[p].push(d),
                    Err(_) => errors[p] += 1,
                }
                k += 1;
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    let mut c64: Vec<(usize, Vec<Duration>, f64)> = vec![(0, Vec::new(), 0.0); paths.len()];
    let half = args.seconds / 2.0;
    for round in 0..2 {
        for (p, (name, base)) in paths.iter().enumerate() {
            eprintln!("c=64 {name}, round {} of 2, {half} s", round + 1);
            let started = Instant::now();
            let (n, lats, e) = closed_loop(&http, base, &bodies, 64, half).await;
            c64[p].0 += n;
            c64[p].1.extend(lats);
            c64[p].2 += started.elapsed().as_secs_f64();
            errors[p] += e;
        }
    }
    Ok(paths
        .iter()
        .enumerate()
        .map(|(p, (name, _))| {
            c1[p].sort();
            c64[p].1.sort();
            PathFigures {
                path: name.clone(),
                c1_requests: c1[p].len(),
                c1_p50_ms: percentile_ms(&c1[p], 50.0),
                c1_p90_ms: percentile_ms(&c1[p], 90.0),
                c1_p99_ms: percentile_ms(&c1[p], 99.0),
                c64_throughput_rps: if c64[p].2 > 0.0 { c64[p].0 as f64 / c64[p].2 } else { 0.0 },
                c64_p50_ms: percentile_ms(&c64[p].1, 50.0),
                c64_p99_ms: percentile_ms(&c64[p].1, 99.0),
                errors: errors[p],
            }
        })
        .collect())
}
