//! `kvroute-bench restarts`: how soon the router's map is true again after a
//! part of the cluster dies or restarts, on simulated engines with sidecars.
//!
//! - **engine restart**: `kill -9` one engine (its blocks are gone) after it
//!   has been idle for 0 to 2.1 s; time until its sidecar counts the event
//!   stream lost, and until the router holds no entry for the worker. Whether the router's health checks had
//!   ejected the worker by then is noted (that path takes seconds).
//! - **router restart while idle**: no traffic, `kill -9` the router, keep
//!   it down for a while (the sidecars' retry backoff grows meanwhile),
//!   restart it; time from the new router listening until its index holds
//!   every worker's entries again.
//! - **sidecar loss**: `kill -9` one sidecar, its engine serving on; time
//!   until the router indexes that worker approximately (it stays a
//!   candidate), then restart the sidecar and time until the worker is
//!   exact again (confirmed entries = the engine's blocks).
//!
//! Each step waits on what it measures by polling every 2 ms; the figures
//! are the router's and sidecar's latencies plus at most that.

use std::time::{Duration, Instant};

use kvroute_sim::cluster::{Cluster, worker_id};
use serde::Serialize;
use serde_json::Value;

use crate::error::BenchError;
use crate::setup::{self, MODEL, Shape};
use crate::tokens::{extend_run, seed};
use crate::{client, probe, report, stats};

const TAG: u64 = 0x5253_5452;
const POLL: Duration = Duration::from_millis(2);
const WAIT: Duration = Duration::from_secs(60);
const PROMPT_LEN: usize = 256;
/// Engine restart rounds wait 0, 1, 2, 3 × this idle before the kill.
const IDLE_STEP_MS: u64 = 700;

#[derive(Debug, Clone, clap::Args)]
pub struct RestartsArgs {
    /// Engine restarts, and router restarts per downtime.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// How long the router stays down before each restart, in ms, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,500,2000,5000")]
    pub downtimes_ms: Vec<u64>,
    /// Sidecar losses (each waits out the router's `worker_expiry`, 30 s by default; 0 skips them).
    #[arg(long, default_value_t = 1)]
    pub sidecar_rounds: usize,
    /// Engines in the cluster.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Prompts of 256 tokens cached per engine before each measurement.
    #[arg(long, default_value_t = 16)]
    pub prompts: usize,
    /// Tokenizer directory for routers and engines (a router loads it after
    /// it listens and before it serves, so a restart's figures include it).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// A router TOML config (`--config`), e.g. a shorter `worker_expiry`.
    #[arg(long, value_name = "FILE")]
    pub router_config: Option<std::path::PathBuf>,
    /// One round of each, downtimes 0 and 2000 ms.
    #[arg(long)]
    pub quick: bool,
    #[arg(long, default_value = "bench-out/restarts")]
    pub out: std::path::PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineRound {
    pub worker: String,
    pub entries_before: u64,
    /// kill → the sidecar's `event_disconnects_total` went up.
    pub kill_to_seen_ms: Option<f64>,
    /// kill → the router holds no entry for the worker.
    pub kill_to_clear_ms: Option<f64>,
    /// The sidecar seeing it → the router clear (the sidecar's share).
    pub seen_to_clear_ms: Option<f64>,
    /// Had health checks ejected the worker by the time it was clear?
    pub ejected_by_then: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct RouterRound {
    pub downtime_ms: u64,
    pub entries_before: u64,
    /// kill → the new router printed `listening on`.
    pub kill_to_listening_ms: f64,
    /// listening → `/health` answers (state built: tokenizers loaded).
    pub listening_to_serving_ms: Option<f64>,
    /// listening → every worker's confirmed entries as before.
    pub listening_to_whole_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SidecarRound {
    pub worker: String,
    /// kill → `/admin/workers` shows the worker without a sidecar.
    pub kill_to_approximate_ms: Option<f64>,
    /// Was it still a healthy routing candidate then (not removed)?
    pub still_routable: bool,
    /// sidecar restarted (listening) → confirmed entries equal the engine's blocks.
    pub restart_to_exact_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RestartsResult {
    pub engine: Vec<EngineRound>,
    pub router: Vec<RouterRound>,
    pub sidecar: Vec<SidecarRound>,
}

impl RestartsResult {
    /// The worst figure of each scenario, on one line.
    pub fn summary(&self) -> String {
        let worst = |xs: Vec<Option<f64>>| {
            xs.into_iter().flatten().reduce(f64::max).map_or("—".to_owned(), |x| format!("{} ms", report::ms(x)))
        };
        format!(
            "engine kill → router clear at most {}; router restart listening → whole at most {}; \
             sidecar loss → approximate index at most {}",
            worst(self.engine.iter().map(|e| e.kill_to_clear_ms).collect()),
            worst(self.router.iter().map(|e| e.listening_to_whole_ms).collect()),
            worst(self.sidecar.iter().map(|e| e.kill_to_approximate_ms).collect()),
        )
    }
}

struct Ctx {
    http: reqwest::Client,
}

impl Ctx {
    fn router<'a>(&self, cluster: &'a Cluster) -> &'a str {
        cluster.router_url(0)
    }

    /// Caches `n` fresh prompts on engine `i` (sent to it directly).
    async fn fill(&self, cluster: &Cluster, i: usize, n: usize, salt: u64) -> Result<(), BenchError> {
        for p in 0..n {
            let mut prompt = Vec::new();
            extend_run(&mut prompt, seed(TAG, salt, (i * 10_000 + p) as u64), PROMPT_LEN);
            let body = client::completion_body(MODEL, &prompt, 1, false, false);
            client::complete(&self.http, &cluster.engines[i].url, body, WAIT).await?;
        }
        Ok(())
    }

    /// The engine's cached blocks (`/sim/cache`): the truth.
    async fn truth(&self, cluster: &Cluster, i: usize) -> Result<u64, BenchError> {
        let v = probe::get_json(&self.http, &format!("{}/sim/cache", cluster.engines[i].url)).await?;
        Ok(v["block_keys"].as_array().map_or(0, |a| a.len() as u64))
    }

    /// The router's index entries for `worker` (every kind), `None` if unknown.
    async fn entries(&self, router: &str, worker: &str) -> Result<Option<Value>, BenchError> {
        let v = probe::get_json(&self.http, &format!("{router}/debug/index")).await?;
        Ok(v["workers"].get(worker).cloned())
    }

    async fn row(&self, router: &str, worker: &str) -> Result<Option<Value>, BenchError> {
        let v = probe::get_json(&self.http, &format!("{router}/admin/workers")).await?;
        Ok(v["workers"].as_array().and_then(|ws| ws.iter().find(|w| w["id"] == worker).cloned()))
    }

    /// Waits until the router's confirmed entries for engine `i` equal its blocks.
    async fn until_exact(&self, cluster: &Cluster, i: usize) -> Result<u64, BenchError> {
        let started = Instant::now();
        loop {
            let want = self.truth(cluster, i).await?;
            let got = self.entries(self.router(cluster), &worker_id(i)).await.ok().flatten();
            let exact = got.as_ref().is_some_and(|g| {
                g["confirmed"].as_u64() == Some(want) && g["speculative"] == 0 && g["approximate"] == 0
            });
            if exact {
                return Ok(want);
            }
            if started.elapsed() > WAIT {
                return Err(BenchError::Timeout(format!(
                    "{}: router shows {got:?}, engine {want} blocks",
                    worker_id(i)
                )));
            }
            tokio::time::sleep(POLL * 10).await;
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Polls `check` every [`POLL`] until it holds; the elapsed time since
/// `from`, or `None` after [`WAIT`].
async fn until<F, Fut>(from: Instant, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    while from.elapsed() < WAIT {
        if check().await {
            return Some(from.elapsed());
        }
        tokio::time::sleep(POLL).await;
    }
    None
}

async fn metric(http: &reqwest::Client, url: &str, name: &str) -> f64 {
    probe::get_text(http, &format!("{url}/metrics")).await.map_or(f64::NAN, |t| probe::sum_metric(&t, name))
}

async fn ejections(http: &reqwest::Client, router: &str, worker: &str) -> f64 {
    let text = probe::get_text(http, &format!("{router}/metrics")).await.unwrap_or_default();
    let line = format!("kvroute_ejections_total{{worker=\"{worker}\"}}");
    text.lines().find_map(|l| l.strip_prefix(&line)?.trim().parse().ok()).unwrap_or(0.0)
}

async fn engine_round(
    ctx: &Ctx,
    cluster: &mut Cluster,
    round: usize,
    prompts: usize,
) -> Result<EngineRound, BenchError> {
    let i = round % cluster.engines.len();
    let worker = worker_id(i);
    let router = cluster.router_url(0).to_owned();
    let sidecar = cluster.sidecars[i].url.clone();
    ctx.fill(cluster, i, prompts, round as u64).await?;
    let entries_before = ctx.until_exact(cluster, i).await?;
    // Engines are often idle when they die: the sidecar then runs its idle
    // replay probe every second. Rounds vary how long the engine has been idle.
    tokio::time::sleep(Duration::from_millis(IDLE_STEP_MS * (round % 4) as u64)).await;
    let disconnects = metric(&ctx.http, &sidecar, "kvroute_sidecar_event_disconnects_total").await;
    let ejected_before = ejections(&ctx.http, &router, &worker).await;

    let killed = Instant::now();
    cluster.engines[i].proc.kill().await;
    let seen = until(killed, || async {
        metric(&ctx.http, &sidecar, "kvroute_sidecar_event_disconnects_total").await > disconnects
    });
    let clear = until(killed, || async {
        let e = ctx.entries(&router, &worker).await.ok().flatten();
        e.is_none_or(|e| e["confirmed"] == 0 && e["speculative"] == 0 && e["approximate"] == 0)
    });
    let (seen, clear) = tokio::join!(seen, clear);
    let ejected_by_then = ejections(&ctx.http, &router, &worker).await > ejected_before;

    cluster.restart_engine(i).await?;
    // Back in: healthy, and its (restarted) sidecar stream indexing it exactly.
    let back = until(Instant::now(), || async {
        ctx.row(&router, &worker).await.ok().flatten().is_some_and(|w| w["healthy"] == true && w["sidecar"] == true)
    })
    .await;
    if back.is_none() {
        return Err(BenchError::Timeout(format!("{worker} not back in the router after its engine restarted")));
    }
    Ok(EngineRound {
        worker,
        entries_before,
        kill_to_seen_ms: seen.map(ms),
        kill_to_clear_ms: clear.map(ms),
        seen_to_clear_ms: seen.zip(clear).map(|(s, c)| ms(c.saturating_sub(s))),
        ejected_by_then,
    })
}

async fn router_round(ctx: &Ctx, cluster: &mut Cluster, downtime_ms: u64) -> Result<RouterRound, BenchError> {
    let mut before = Vec::new();
    for i in 0..cluster.engines.len() {
        before.push((worker_id(i), ctx.until_exact(cluster, i).await?));
    }
    let killed = Instant::now();
    cluster.routers[0].proc.kill().await;
    tokio::time::sleep(Duration::from_millis(downtime_ms)).await;
    cluster.restart_router(0).await?;
    let listening = Instant::now();
    let router = cluster.router_url(0).to_owned();
    let serving = until(listening, || async { probe::get_text(&ctx.http, &format!("{router}/health")).await.is_ok() });
    let whole = until(listening, || async {
        let Ok(now) = probe::index_confirmed(&ctx.http, &router).await else { return false };
        before.iter().all(|(w, n)| now.iter().any(|(id, m)| id == w && m == n))
    });
    let (serving, whole) = tokio::join!(serving, whole);
    Ok(RouterRound {
        downtime_ms,
        entries_before: before.iter().map(|(_, n)| n).sum(),
        kill_to_listening_ms: ms(listening - killed),
        listening_to_serving_ms: serving.map(ms),
        listening_to_whole_ms: whole.map(ms),
    })
}

async fn sidecar_round(ctx: &Ctx, cluster: &mut Cluster, round: usize) -> Result<SidecarRound, BenchError> {
    let i = round % cluster.engines.len();
    let worker = worker_id(i);
    let router = cluster.router_url(0).to_owned();
    ctx.until_exact(cluster, i).await?;
    let killed = Instant::now();
    cluster.sidecars[i].proc.kill().await;
    // The worker's row once it has no sidecar any more; `None` once removed.
    let (fallback, row) = loop {
        match ctx.row(&router, &worker).await {
            Ok(Some(w)) if w["sidecar"] == false => break (Some(killed.elapsed()), Some(w)),
            Ok(None) => break (Some(killed.elapsed()), None),
            _ if killed.elapsed() > WAIT * 2 => break (None, None),
            _ => tokio::time::sleep(POLL).await,
        }
    };
    let still_routable = row.is_some_and(|w| w["healthy"] == true);
    let restarted = Instant::now();
    cluster.restart_sidecar(i).await?;
    let exact = ctx.until_exact(cluster, i).await.ok().map(|_| restarted.elapsed());
    Ok(SidecarRound {
        worker,
        kill_to_approximate_ms: fallback.filter(|_| still_routable).map(ms),
        still_routable,
        restart_to_exact_ms: exact.map(ms),
    })
}

pub async fn run(args: RestartsArgs) -> Result<RestartsResult, BenchError> {
    let (rounds, downtimes, sidecar_rounds) = if args.quick {
        (1, vec![0, 2000], args.sidecar_rounds.min(1))
    } else {
        (args.rounds, args.downtimes_ms.clone(), args.sidecar_rounds)
    };
    let dir = setup::bin_dir();
    setup::ensure_all(&dir)?;
    let shape = Shape {
        workers: args.workers,
        routers: 1,
        replica_exchange: true,
        sidecars: true,
        policy: kvroute_router::policy::DEFAULT_POLICY.into(),
        num_blocks: 8192,
        sim_args: vec!["--instant".into()],
        router_args: args.router_config.iter().flat_map(|c| ["--config".into(), c.display().to_string()]).collect(),
        tokenizer: None,
    };
    let mut spec = setup::spec(&shape, &dir);
    spec.tokenizer = args.tokenizer.clone();
    let mut cluster = Cluster::start(spec).await?;
    let ctx = Ctx { http: client::http_client() };
    let result = rounds_of(&ctx, &mut cluster, &args, rounds, &downtimes, sidecar_rounds).await;
    cluster.shutdown().await;
    let result = result?;
    report::write_results(&args.out, &args, &result)?;
    report::write(&args.out.join("report.md"), render(&args, &result).as_bytes())?;
    Ok(result)
}

async fn rounds_of(
    ctx: &Ctx,
    cluster: &mut Cluster,
    args: &RestartsArgs,
    rounds: usize,
    downtimes: &[u64],
    sidecar_rounds: usize,
) -> Result<RestartsResult, BenchError> {
    let mut result = RestartsResult { engine: Vec::new(), router: Vec::new(), sidecar: Vec::new() };
    for round in 0..rounds {
        let r = engine_round(ctx, cluster, round, args.prompts).await?;
        eprintln!("engine restart {}: {r:?}", round + 1);
        result.engine.push(r);
    }
    for i in 0..cluster.engines.len() {
        ctx.fill(cluster, i, args.prompts, 1_000).await?;
    }
    for &downtime in downtimes {
        for _ in 0..rounds {
            let r = router_round(ctx, cluster, downtime).await?;
            eprintln!("router restart: {r:?}");
            result.router.push(r);
        }
    }
    for round in 0..sidecar_rounds {
        let r = sidecar_round(ctx, cluster, round).await?;
        eprintln!("sidecar loss {}: {r:?}", round + 1);
        result.sidecar.push(r);
    }
    Ok(result)
}

/// "p50 / max" of the present figures, or "—".
fn spread(xs: impl Iterator<Item = Option<f64>>) -> String {
    let mut ds: Vec<Duration> = xs.flatten().map(|x| Duration::from_secs_f64(x / 1e3)).collect();
    if ds.is_empty() {
        return "—".into();
    }
    ds.sort();
    format!(
        "{} / {} ms (n = {})",
        report::ms(stats::percentile_ms(&ds, 50.0)),
        report::ms(stats::percentile_ms(&ds, 100.0)),
        ds.len()
    )
}

fn render(args: &RestartsArgs, r: &RestartsResult) -> String {
    let mut md = format!(
        "# kvroute-bench restarts\n\nMachine: {}. {} simulated engines (`--instant`) with sidecars, 1 router{}{}; \
         the map is polled every {} ms. Figures are p50 / max.\n\n",
        report::machine(),
        args.workers,
        args.router_config.as_ref().map_or(String::new(), |c| format!(" (config {})", c.display())),
        args.tokenizer.as_ref().map_or(String::new(), |t| format!(", tokenizer {}", t.display())),
        POLL.as_millis()
    );
    let e = &r.engine;
    md.push_str("## Engine restart (kill -9 an engine)\n\n");
    md.push_str(&report::table(
        &["kill → sidecar sees it", "sidecar sees it → router clear", "kill → router clear", "ejected by then"],
        &[vec![
            spread(e.iter().map(|x| x.kill_to_seen_ms)),
            spread(e.iter().map(|x| x.seen_to_clear_ms)),
            spread(e.iter().map(|x| x.kill_to_clear_ms)),
            format!("{} of {}", e.iter().filter(|x| x.ejected_by_then).count(), e.len()),
        ]],
    ));
    md.push_str("\n## Router restart while idle (kill -9, down for a while, restart)\n\n");
    let mut downtimes: Vec<u64> = r.router.iter().map(|x| x.downtime_ms).collect();
    downtimes.dedup();
    let rows: Vec<Vec<String>> = downtimes
        .iter()
        .map(|&d| {
            let of = r.router.iter().filter(|x| x.downtime_ms == d);
            vec![
                format!("{d} ms"),
                spread(of.clone().map(|x| Some(x.kill_to_listening_ms))),
                spread(of.clone().map(|x| x.listening_to_serving_ms)),
                spread(of.clone().map(|x| x.listening_to_whole_ms)),
                format!("{} of {}", of.clone().filter(|x| x.listening_to_whole_ms.is_some()).count(), of.count()),
            ]
        })
        .collect();
    md.push_str(&report::table(
        &["down for", "kill → listening", "listening → serving", "listening → whole", "whole within 60 s"],
        &rows,
    ));
    if !r.sidecar.is_empty() {
        md.push_str("\n## Sidecar loss (kill -9 a sidecar, engine serving on; then restart the sidecar)\n\n");
        let s = &r.sidecar;
        md.push_str(&report::table(
            &["kill → approximate index", "still routable", "sidecar restart → exact"],
            &[vec![
                spread(s.iter().map(|x| x.kill_to_approximate_ms)),
                format!("{} of {}", s.iter().filter(|x| x.still_routable).count(), s.len()),
                spread(s.iter().map(|x| x.restart_to_exact_ms)),
            ]],
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_p50_and_max_of_the_figures_present() {
        assert_eq!(spread([Some(30.0), None, Some(10.0), Some(20.0)].into_iter()), "20.0 / 30.0 ms (n = 3)");
        assert_eq!(spread([None, None].into_iter()), "—");
    }
}
