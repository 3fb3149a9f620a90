//! Data-parallel ranks as routing targets (issue 14): each rank of an engine
//! has its own KV cache, so the router indexes and picks ranks, not engines.
//!
//! - Internal load balancing: one API server for every rank. The sidecar
//!   reports each rank as `wN-dpR`, and the router names the rank in
//!   `X-data-parallel-rank`.
//! - External load balancing: each rank has its own API server. A sidecar per
//!   rank follows that rank's event port (base + rank), reporting it as a
//!   plain worker.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_sim::cluster::{LOCAL_TOKEN, Proc, wait_router_ready};
use kvroute_tests::{Client, converge_targets, spec, start, text};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

/// A counter's sample for data-parallel engine `rank` on a sim's `/metrics`.
async fn rank_counter(c: &Client, engine: &str, family: &str, rank: u32) -> f64 {
    let text = c.http.get(format!("{engine}/metrics")).send().await.unwrap().text().await.unwrap();
    let prefix = format!("{family}{{engine=\"{rank}\",");
    let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {prefix} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_behind_one_api_is_a_target_pinned_by_header() {
    let mut s = spec(1);
    s.data_parallel_size = 2;
    let cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let engine = cluster.engines[0].url.clone();

    let workers = c.get(&format!("{r}/admin/workers")).await;
    let listed: Vec<(Value, Value, Value)> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].clone(), w["dp_rank"].clone(), w["index_mode"].clone()))
        .collect();
    assert_eq!(
        listed,
        [("w1-dp0".into(), 0.into(), "exact".into()), ("w1-dp1".into(), 1.into(), "exact".into())],
        "{workers}"
    );

    // Distinct prompts, each asked three times: every repeat goes where the
    // first one's blocks are.
    let mut routed: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..8 {
        let prompt = text(i, 150);
        let (first, _) = c.complete(&r, &prompt, 2).await;
        *routed.entry(first.clone()).or_default() += 1;
        // Let the sidecar report the stored blocks before the repeats.
        converge(&c, &r, &engine).await;
        for _ in 0..2 {
            let (again, _) = c.complete(&r, &prompt, 2).await;
            assert_eq!(again, first, "a repeat of prompt {i} left the rank holding it");
            *routed.entry(again).or_default() += 1;
        }
    }
    // The engine served on each rank exactly what the router sent there: the
    // header pinned the rank (its own balancer would have taken turns).
    for rank in 0..2 {
        let served = rank_counter(&c, &engine, "vllm:request_success_total", rank).await;
        let sent = routed.get(&format!("w1-dp{rank}")).copied().unwrap_or(0);
        assert_eq!(served, f64::from(sent), "rank {rank}: routed {routed:?}");
    }
    // Every repeat was a prefix-cache hit on its own rank.
    let hits: f64 = rank_counter(&c, &engine, "vllm:prefix_cache_hits_total", 0).await
        + rank_counter(&c, &engine, "vllm:prefix_cache_hits_total", 1).await;
    assert!(hits > 0.0);
    converge(&c, &r, &engine).await;
    cluster.shutdown().await;
}

/// Waits until each rank's entries on `router` are exactly that rank's cache.
async fn converge(c: &Client, router: &str, engine: &str) {
    let targets: Vec<(String, String)> =
        (0..2).map(|rank| (format!("w1-dp{rank}"), format!("{engine}/sim/cache?rank={rank}"))).collect();
    converge_targets(c, router, &targets, WAIT, "each rank's map to equal its cache").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_its_own_api_is_followed_on_base_port_plus_rank() {
    // A router alone; the rank and its sidecar are started by hand.
    let cluster = start(spec(0)).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let bin = &cluster.spec.bin_dir;
    let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let mut rank1 = Proc::spawn(
        "engine rank 1",
        &bin.join("kvroute-sim"),
        &args(&[
            "--listen",
            "127.0.0.1:0",
            "--model",
            "sim-model",
            "--instant",
            "--data-parallel-size",
            "2",
            "--data-parallel-rank",
            "1",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
        ]),
    )
    .await
    .unwrap();
    let url = rank1.announced("listening on ").await.unwrap();
    let events = rank1.announced("kv-events on ").await.unwrap();
    let replay = rank1.announced("kv-replay on ").await.unwrap();
    // The operator gives the engine's configured (base) ports; rank 1 is at
    // base + 1, as vLLM binds it.
    let base = |ep: &str| {
        let (host, port) = ep.rsplit_once(':').unwrap();
        format!("{host}:{}", port.parse::<u16>().unwrap() - 1)
    };
    let mut sidecar = Proc::spawn(
        "sidecar rank 1",
        &bin.join("kvroute-sidecar"),
        &args(&[
            "--worker-id",
            "r1",
            "--engine-url",
            &url,
            "--model",
            "sim-model",
            "--block-size",
            "16",
            "--events",
            &base(&events),
            "--replay",
            &base(&replay),
            "--data-parallel-size",
            "2",
            "--data-parallel-rank",
            "1",
            "--router",
            &r,
            "--internal-token",
            LOCAL_TOKEN,
            "--listen",
            "127.0.0.1:0",
            "--sync-interval",
            "1s",
        ]),
    )
    .await
    .unwrap();
    sidecar.announced("listening on ").await.unwrap();
    wait_router_ready(&cluster.routers[0].proc, &r, 1).await.unwrap();
    for i in 0..4 {
        c.complete(&r, &text(100 + i, 120), 2).await;
    }
    let targets = [("r1".to_owned(), format!("{url}/sim/cache"))];
    converge_targets(&c, &r, &targets, WAIT, "the rank's map to equal its cache").await;
    let worker = c.get(&format!("{r}/admin/workers")).await["workers"][0].clone();
    assert_eq!((worker["id"].as_str(), worker["dp_rank"].is_null()), (Some("r1"), true), "{worker}");
    assert!(c.get(&format!("{url}/sim/cache")).await["count"].as_u64().unwrap() > 0);
    cluster.shutdown().await;
}
