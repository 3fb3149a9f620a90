//! `kvroute-bench lifecycle`: a prefix's life in the router's map, each state
//! checked (PASS/FAIL) and timed on a real cluster with sidecars (3 simulated
//! engines, or 2 real vLLM ones with `--engine vllm`): cold start,
//! stickiness, eviction, recovery, and a router restart.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cli::LifecycleArgs;
use crate::client::{self, Outcome};
use crate::engine::EngineKind;
use crate::error::BenchError;
use crate::rig::Rig;
use crate::setup::{self, Shape};
use crate::tokens::{extend_run, seed};
use crate::vllm::{self, ServeSpec, VllmEngines};
use crate::{probe, report};

const TAG: u64 = 0x4c49_4645;
/// How often the map is polled while waiting for a change: tight, so the
/// measured latency is the router's, not the poller's.
const POLL: Duration = Duration::from_millis(2);
const WAIT: Duration = Duration::from_secs(30);
/// How long an engine may refuse `/reset_prefix_cache` (vLLM does while
/// dropped streams still hold blocks).
const RESET_WAIT: Duration = Duration::from_secs(120);
/// A prompt shorter than a block: it runs an engine step and caches nothing.
const NUDGE: &[u32] = &[11, 12, 13];

#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub state: String,
    pub pass: bool,
    /// The latency this state is about, when it has one.
    pub latency_ms: Option<f64>,
    pub latency_what: String,
    pub detail: String,
}

struct Ctx {
    http: reqwest::Client,
    router: String,
    engines: Vec<String>,
    prefix_len: usize,
    engine: EngineKind,
    /// Output tokens of the long requests that keep a worker busy.
    long_tokens: u32,
}

impl Ctx {
    fn prompt(&self, prefix: u64, suffix: u64) -> Vec<u32> {
        let mut t = Vec::new();
        extend_run(&mut t, seed(TAG, prefix, 0), self.prefix_len);
        extend_run(&mut t, seed(TAG, prefix, suffix + 1), 32);
        t
    }

    async fn send(&self, base: &str, prompt: &[u32], max_tokens: u32) -> Result<Outcome, BenchError> {
        let body = client::completion_body(self.engine.model(), prompt, max_tokens, true, self.engine.ignore_eos());
        client::complete(&self.http, base, body, Duration::from_secs(60)).await
    }

    async fn running(&self, engine: usize) -> Result<f64, BenchError> {
        let text = probe::get_text(&self.http, &format!("{}/metrics", self.engines[engine])).await?;
        Ok(probe::sum_metric(&text, "vllm:num_requests_running"))
    }

    /// Polls `/debug/route` for `prompt` until `done` holds; returns the wait.
    async fn until_route(
        &self,
        prompt: &[u32],
        done: impl Fn(&probe::RouteView) -> bool,
    ) -> Result<(Duration, probe::RouteView), BenchError> {
        let started = Instant::now();
        loop {
            let v = probe::debug_route(&self.http, &self.router, self.engine.model(), prompt).await?;
            if done(&v) {
                return Ok((started.elapsed(), v));
            }
            if started.elapsed() > WAIT {
                return Err(BenchError::Timeout(format!("route never changed; last view {v:?}")));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

fn engine_index(worker: &str) -> Option<usize> {
    worker.strip_prefix('w')?.parse::<usize>().ok()?.checked_sub(1)
}

/// A state's verdict, also printed as it comes (a run takes minutes, real
/// vLLM engines longer).
fn step(state: &str, pass: bool, latency: Option<Duration>, what: &str, detail: String) -> Step {
    let took = latency.map_or(String::new(), |d| format!(", {:.1} ms ({what})", d.as_secs_f64() * 1e3));
    eprintln!("lifecycle: {state}: {}{took}", if pass { "PASS" } else { "FAIL" });
    Step {
        state: state.into(),
        pass,
        latency_ms: latency.map(|d| d.as_secs_f64() * 1e3),
        latency_what: what.into(),
        detail,
    }
}

/// Output tokens of the long requests: 4000, or what fits beside the
/// prompt in a vLLM engine's context.
fn long_tokens(engine: EngineKind, max_model_len: u32, prompt_len: usize) -> u32 {
    match engine {
        EngineKind::Sim => 4000,
        EngineKind::Vllm => max_model_len.saturating_sub(prompt_len as u32).min(4000),
    }
}

pub async fn run(args: LifecycleArgs) -> Result<Vec<Step>, BenchError> {
    let engine = args.engine.engine;
    let workers = args.workers.unwrap_or(match engine {
        EngineKind::Sim => 3,
        EngineKind::Vllm => 2,
    });
    engine.check_workers(workers)?;
    if workers < 2 {
        return Err(BenchError::Usage("lifecycle needs at least 2 workers".into()));
    }
    let num_blocks = args.num_blocks.unwrap_or(match engine {
        EngineKind::Sim => 4096,
        EngineKind::Vllm => 1024,
    });
    let dir = setup::bin_dir();
    let shape = Shape {
        workers,
        routers: 1,
        replica_exchange: true,
        sidecars: true,
        policy: kvroute_router::policy::DEFAULT_POLICY.into(),
        num_blocks,
        sim_args: vec!["--time-scale".into(), args.time_scale.to_string()],
        router_args: args.router_config.iter().flat_map(|c| ["--config".into(), c.display().to_string()]).collect(),
        tokenizer: None,
    };
    // The prompts: a prefix and a 32-token suffix.
    let prompt_len = args.prefix_len + 32;
    let http = client::http_client();
    let (pool, mut rig, engines_line) = match engine {
        EngineKind::Sim => {
            setup::ensure_all(&dir)?;
            let rig = Rig::start_sim(&shape, &dir).await?;
            (None, rig, format!("{workers} simulated engines (time scale {})", args.time_scale))
        }
        EngineKind::Vllm => {
            kvroute_sim::cluster::ensure_binaries(&dir)?;
            let tokenizer = crate::engine::tiny_model_dir(&args.engine.vllm_serve)?;
            let spec = ServeSpec {
                script: args.engine.vllm_serve.clone(),
                num_blocks,
                block_size: engine.block_size(),
                start_timeout: Duration::from_secs(args.engine.vllm_start_timeout),
            };
            let max_len = vllm::max_model_len(num_blocks, spec.block_size);
            if prompt_len + 4 > max_len as usize {
                return Err(BenchError::Usage(format!(
                    "--prefix-len {} does not fit the engines' context of {max_len} tokens (--num-blocks {num_blocks})",
                    args.prefix_len
                )));
            }
            let pool =
                VllmEngines::start(workers, spec, &args.out.join("logs"), kvroute_sim::cluster::worker_id, &http)
                    .await?;
            pool.warm_up(&http, prompt_len).await?;
            let rig = Rig::start_vllm(&pool, &shape, tokenizer, &dir).await?;
            let line = format!(
                "{workers} real vLLM engines (CPU build, tiny-qwen3 with random weights, {num_blocks} KV blocks of {} tokens)",
                engine.block_size()
            );
            (Some(pool), rig, line)
        }
    };
    let max_len = vllm::max_model_len(num_blocks, engine.block_size());
    let ctx = Ctx {
        http,
        router: rig.router_url(0).to_owned(),
        engines: rig.engine_urls(),
        prefix_len: args.prefix_len,
        engine,
        long_tokens: long_tokens(engine, max_len, prompt_len),
    };
    eprintln!("lifecycle: {engines_line} up; checking the states");
    let result = states(&mut rig, &ctx, &args).await;
    rig.shutdown().await;
    if let Some(pool) = pool {
        pool.shutdown().await;
    }
    let steps = result?;
    let mut md = String::from("# kvroute-bench lifecycle\n\n");
    md.push_str(&format!(
        "Machine: {}. {engines_line}, {workers} sidecars, 1 router, policy {}; \
         prefixes of {} tokens{}. Latencies are measured by polling the router's debug endpoints every {} ms.\n\n",
        report::machine(),
        kvroute_router::policy::DEFAULT_POLICY,
        args.prefix_len,
        args.router_config.as_ref().map_or(String::new(), |c| format!("; router config {}", c.display())),
        POLL.as_millis()
    ));
    let rows: Vec<Vec<String>> = steps
        .iter()
        .map(|s| {
            vec![
                s.state.clone(),
                if s.pass { "PASS".into() } else { "FAIL".into() },
                s.latency_ms.map_or("—".into(), |l| format!("{} ms ({})", report::ms(l), s.latency_what)),
                s.detail.clone(),
            ]
        })
        .collect();
    md.push_str(&report::table(&["state", "verdict", "latency", "detail"], &rows));
    report::write_results(&args.out, &args, &steps)?;
    md.push_str(&report::plots_section("lifecycle", &args.out));
    report::write(&args.out.join("report.md"), md.as_bytes())?;
    Ok(steps)
}

async fn states(rig: &mut Rig, ctx: &Ctx, args: &LifecycleArgs) -> Result<Vec<Step>, BenchError> {
    let mut steps = Vec::new();

    // 1. Cold start: a concurrent burst of one new prefix.
    let burst = args.burst;
    let started = Instant::now();
    let prompts: Vec<Vec<u32>> = (0..burst).map(|i| ctx.prompt(1, i as u64)).collect();
    let sends = prompts.iter().map(|p| ctx.send(&ctx.router, p, 4));
    let outs: Vec<Outcome> = futures::future::try_join_all(sends).await?;
    let burst_time = started.elapsed();
    let mut landed: Vec<String> = outs.iter().filter_map(|o| o.worker.clone()).collect();
    landed.sort();
    landed.dedup();
    steps.push(step(
        "cold start",
        landed.len() == 1,
        Some(burst_time),
        "whole burst",
        format!("{burst} concurrent requests of one new prefix landed on {landed:?}"),
    ));

    // 2. Stickiness: a second prefix, placed by one request; make its holder
    // the busiest worker, then repeat the prefix.
    let placed = ctx.send(&ctx.router, &ctx.prompt(2, 0), 4).await?;
    let holder = placed.worker.clone().unwrap_or_default();
    let h = engine_index(&holder).unwrap_or(0);
    // The long requests go one at a time, each after the previous one is
    // running, so each is routed against the load the previous ones left.
    let mut long = Vec::new();
    for i in 0..args.busy {
        let prompt = ctx.prompt(2, 1000 + i as u64);
        let http = ctx.http.clone();
        let router = ctx.router.clone();
        let body = client::completion_body(ctx.engine.model(), &prompt, ctx.long_tokens, true, ctx.engine.ignore_eos());
        long.push(tokio::spawn(async move { client::complete(&http, &router, body, Duration::from_secs(60)).await }));
        let started = Instant::now();
        let mut total = 0.0;
        while total < (i + 1) as f64 && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            total = 0.0;
            for e in 0..ctx.engines.len() {
                total += ctx.running(e).await?;
            }
        }
        // Past its prefill: a decoding request is load, not pending prefill.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let started = Instant::now();
    let busier = loop {
        let mine = ctx.running(h).await?;
        let mut others = Vec::new();
        for e in (0..ctx.engines.len()).filter(|&e| e != h) {
            others.push(ctx.running(e).await?);
        }
        let least = others.iter().copied().fold(f64::INFINITY, f64::min);
        if mine >= args.busy as f64 && mine > least {
            break Some((mine, least));
        }
        if started.elapsed() > Duration::from_secs(10) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let repeat = ctx.send(&ctx.router, &ctx.prompt(2, 500), 4).await?;
    for t in &long {
        t.abort();
    }
    let stuck = repeat.worker.as_deref() == Some(holder.as_str());
    steps.push(step(
        "stickiness",
        stuck && busier.is_some(),
        Some(repeat.ttft),
        "TTFT of the repeat",
        match busier {
            Some((mine, least)) => format!(
                "holder {holder} running {mine} requests, least-loaded other {least}; the repeat went to {:?}",
                repeat.worker
            ),
            None => format!(
                "the {} long requests did not all run on {holder}; repeat went to {:?}",
                args.busy, repeat.worker
            ),
        },
    ));
    // Let the aborted streams drain out of the engine before resetting it
    // (vLLM refuses to reset a cache that running requests use).
    let started = Instant::now();
    while ctx.running(h).await? > 0.0 && started.elapsed() < WAIT {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 3. Eviction: a second worker holds the prefix too; evict the holder.
    let probe_prompt = ctx.prompt(2, 9_999);
    let b = (h + 1) % ctx.engines.len();
    let other = kvroute_sim::cluster::worker_id(b);
    ctx.send(&ctx.engines[b], &ctx.prompt(2, 600), 1).await?;
    let (learn, _) = ctx.until_route(&probe_prompt, |v| v.matched_blocks(&other) > 0).await?;
    let evict_at = Instant::now();
    probe::reset_prefix_cache(&ctx.http, &ctx.engines[h], RESET_WAIT).await?;
    // vLLM (and the sim) publish AllBlocksCleared with the engine's next step;
    // an idle engine takes none, so one tiny request (no full block) runs one.
    ctx.send(&ctx.engines[h], NUDGE, 1).await?;
    let (evict_latency, view) = match ctx.until_route(&probe_prompt, |v| v.matched_blocks(&holder) == 0).await {
        Ok(x) => (Some(evict_at.elapsed()), Some(x.1)),
        Err(_) => (None, None),
    };
    let after = ctx.send(&ctx.router, &ctx.prompt(2, 700), 4).await?;
    steps.push(step(
        "eviction",
        evict_latency.is_some() && after.worker.as_deref() != Some(holder.as_str()),
        evict_latency,
        "reset_prefix_cache → router map update",
        format!(
            "{other} learned the prefix in {} ms (sent to its engine directly); after evicting {holder}, \
             the map showed {:?} and the next request went to {:?}",
            report::ms(learn.as_secs_f64() * 1e3),
            view.map(|v| v.matched),
            after.worker
        ),
    ));

    // 4. Recovery: evict it everywhere, then the next request is placed anew and sticks.
    let reset_at = Instant::now();
    for e in &ctx.engines {
        probe::reset_prefix_cache(&ctx.http, e, RESET_WAIT).await?;
        ctx.send(e, NUDGE, 1).await?;
    }
    let (_, cold) = ctx.until_route(&probe_prompt, |v| v.matched.iter().all(|m| m.1 == 0)).await?;
    let forgot = reset_at.elapsed();
    let first = ctx.send(&ctx.router, &ctx.prompt(2, 800), 4).await?;
    let mut followers = Vec::new();
    let mut last_ttft = Duration::ZERO;
    for i in 0..3 {
        let o = ctx.send(&ctx.router, &ctx.prompt(2, 801 + i), 4).await?;
        last_ttft = o.ttft;
        followers.push(o.worker);
    }
    let placed = first.worker.clone();
    steps.push(step(
        "recovery",
        placed.is_some() && followers.iter().all(|w| *w == placed),
        Some(forgot),
        "evict everywhere → map empty for the prefix",
        format!(
            "cold decision {:?} ({}); first request went to {placed:?}, the next 3 to {followers:?}; \
             TTFT first {} ms, last {} ms",
            cold.worker,
            cold.reason,
            report::ms(first.ttft.as_secs_f64() * 1e3),
            report::ms(last_ttft.as_secs_f64() * 1e3)
        ),
    ));

    // 5. Router restart: fill the map, kill -9, restart, time until it is whole.
    for p in 0..args.restart_prefixes {
        ctx.send(&ctx.router, &ctx.prompt(100 + p as u64, 0), 1).await?;
    }
    let mut before = probe::index_confirmed(&ctx.http, &ctx.router).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = probe::index_confirmed(&ctx.http, &ctx.router).await?;
        if now == before {
            break;
        }
        before = now;
    }
    let killed_at = Instant::now();
    rig.kill_router(0).await;
    rig.restart_router(0).await?;
    let listening = killed_at.elapsed();
    let restarted_at = Instant::now();
    let whole = loop {
        if let Ok(now) = probe::index_confirmed(&ctx.http, rig.router_url(0)).await
            && now.len() == before.len()
            && now.iter().zip(&before).all(|(a, b)| a.0 == b.0 && a.1 >= b.1)
        {
            break Some(restarted_at.elapsed());
        }
        if restarted_at.elapsed() > WAIT {
            break None;
        }
        tokio::time::sleep(POLL).await;
    };
    steps.push(step(
        "router restart",
        whole.is_some(),
        whole,
        "restarted router listening → index whole",
        format!(
            "index before kill {before:?}; kill -9 → new router listening took {} ms; whole again: {}",
            report::ms(listening.as_secs_f64() * 1e3),
            whole.map_or("not within 30 s".into(), |d| format!("after {} ms", report::ms(d.as_secs_f64() * 1e3)))
        ),
    ));
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_requests_fit_a_vllm_context() {
        assert_eq!(long_tokens(EngineKind::Sim, 0, 1056), 4000);
        assert_eq!(long_tokens(EngineKind::Vllm, 4096, 1056), 3040);
        assert_eq!(long_tokens(EngineKind::Vllm, 63 * 32, 4000), 0);
    }

    #[test]
    fn worker_ids_name_engines() {
        assert_eq!(engine_index("w1"), Some(0));
        assert_eq!(engine_index("w2"), Some(1));
        assert_eq!(engine_index("x"), None);
    }
}
