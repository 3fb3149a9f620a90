//! Faults injected into a real cluster: lost pushes, engine restarts, a
//! worker dying mid-stream. Each asserts the behaviour, never a timing (the
//! benchmark reports how long recovery takes).

use std::time::Duration;

use futures::StreamExt;
use kvroute_tests::lossy::LossyProxy;
use kvroute_tests::{Client, converge, eventually, spec, start, text, truth};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

fn prompt(i: u32) -> Vec<u32> {
    let group = i % 4;
    (0..16 * (3 + group)).map(|t| group * 100_000 + t).chain((0..40).map(|t| i * 1000 + t)).collect()
}

async fn traffic(c: &Client, router: &str, n: u32) {
    for i in 0..n {
        let resp = c
            .post(
                &format!("{router}/v1/completions"),
                json!({"model": "sim-model", "prompt": prompt(i), "max_tokens": 2}),
            )
            .await;
        assert!(resp.status().is_success(), "{}", resp.status());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_fast_path_pushes_are_healed_by_the_next_sync() {
    let mut s = spec(1);
    s.num_blocks = 48;
    let mut cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    // 10 % of the sidecar's eviction/store pushes vanish on the way.
    let proxy = LossyProxy::start(&r, 0.1).await;
    cluster.repoint_sidecar(0, std::slice::from_ref(&proxy.url)).await.expect("sidecar restarts");
    // Traffic until a push was lost (bounded: at most 5,000 requests; a push
    // nets 100 ms of events, so there are far fewer pushes than requests).
    let mut sent = 0;
    while proxy.dropped() < 1 && sent < 5000 {
        traffic(&c, &r, 20).await;
        sent += 20;
    }
    assert!(
        proxy.dropped() >= 1,
        "the proxy dropped only {} pushes in {sent} requests; saw (evictions, syncs, other) = {:?}",
        proxy.dropped(),
        proxy.seen()
    );
    let engines = vec![cluster.engines[0].url.clone()];
    converge(&c, &r, &engines, WAIT, "the map to equal the engine after lost pushes").await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_drops_its_entries() {
    let mut s = spec(1);
    // No health-check ejection: the sidecar's sequence handling must do it.
    s.router_args = vec!["--health-check-interval".into(), "1h".into()];
    let mut cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    traffic(&c, &r, 10).await;
    let engines = vec![cluster.engines[0].url.clone()];
    converge(&c, &r, &engines, WAIT, "the map to hold the engine's blocks").await;
    let before = kvroute_tests::confirmed(&c, &r, "w1").await;
    assert!(!before.is_empty());

    cluster.engines[0].proc.kill().await;
    cluster.restart_engine(0).await.expect("engine restarts");
    // The restarted engine starts empty and its event sequence from 0.
    let fresh: Vec<u32> = (0..64).map(|t| 900_000 + t).collect();
    let resp =
        c.post(&format!("{r}/v1/completions"), json!({"model": "sim-model", "prompt": fresh, "max_tokens": 2})).await;
    assert!(resp.status().is_success());
    converge(&c, &r, &engines, WAIT, "the old engine's entries gone, the new ones in").await;
    let after = kvroute_tests::confirmed(&c, &r, "w1").await;
    assert!(before.iter().all(|k| !after.contains(k)), "no entry of the dead engine survives");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_is_ejected_and_readmitted() {
    let mut s = spec(2);
    s.router_args = vec!["--health-check-interval".into(), "200ms".into()];
    let mut cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let p = text(5, 200);
    let resp = c
        .post(
            &format!("{r}/v1/completions"),
            json!({"model": "sim-model", "prompt": p, "max_tokens": 20000, "stream": true}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let victim = resp.headers()["x-kvroute-worker"].to_str().unwrap().to_owned();
    let i = victim.trim_start_matches('w').parse::<usize>().unwrap() - 1;
    let mut body = resp.bytes_stream();
    body.next().await.expect("first chunk").expect("chunk");

    cluster.engines[i].proc.kill().await;
    // The stream ends — with an error event, not a hang.
    let mut rest = String::new();
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(b) => rest.push_str(&String::from_utf8_lossy(&b)),
            Err(_) => break,
        }
    }
    assert!(
        rest.contains("upstream_error"),
        "stream ended without an error event: …{}",
        &rest[rest.len().saturating_sub(300)..]
    );

    // New requests go elsewhere (retried before the first byte if need be).
    let (w, _) = c.complete(&r, &p, 2).await;
    assert_ne!(w, victim);
    let healthy = |v: &Value| {
        v["workers"].as_array().unwrap().iter().find(|x| x["id"] == victim.as_str()).map(|x| x["healthy"] == true)
    };
    eventually("the dead worker to be ejected", WAIT, || {
        let (c, r) = (c.clone(), r.clone());
        async move { (healthy(&c.get(&format!("{r}/admin/workers")).await) == Some(false)).then_some(()) }
    })
    .await;
    let index = c.get(&format!("{r}/debug/index")).await;
    assert_eq!(index["workers"][&victim]["confirmed"], 0, "an ejected worker's entries are purged: {index}");

    cluster.restart_engine(i).await.expect("engine restarts");
    eventually("the worker to be re-admitted", WAIT, || {
        let (c, r) = (c.clone(), r.clone());
        async move { (healthy(&c.get(&format!("{r}/admin/workers")).await) == Some(true)).then_some(()) }
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_down_while_events_flow_is_exact_after_its_first_sync() {
    let mut s = spec(1);
    s.num_blocks = 64;
    let mut cluster = start(s).await;
    let c = Client::default();
    let engine = cluster.engines[0].url.clone();
    let sidecar = cluster.sidecars[0].url.clone();
    cluster.routers[0].proc.kill().await;

    // Events flow with nobody to push them to, for 60 s (the outage):
    // requests straight to the engine, churning its 64-block cache many times
    // over. Bounded in time and count.
    let outage = std::time::Instant::now();
    let mut round = 0u32;
    // Paced (20 requests a 100 ms tick) so tests running beside it keep their CPU.
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    while outage.elapsed() < Duration::from_secs(60) && round < 1_000 {
        pace.tick().await;
        round += 1;
        let reqs = (0..20u32).map(|i| {
            let (c, engine) = (c.clone(), engine.clone());
            async move {
                c.post(
                    &format!("{engine}/v1/completions"),
                    json!({"model": "sim-model", "prompt": prompt(round * 20 + i), "max_tokens": 1}),
                )
                .await
            }
        });
        for r in futures::future::join_all(reqs).await {
            assert!(r.status().is_success());
        }
    }
    // The sidecar keeps the engine's state, not a queue of what it missed.
    let tracked = c.metric(&sidecar, "kvroute_sidecar_tracked_blocks").await;
    assert!(tracked <= 64.0, "the sidecar tracks {tracked} blocks for a 64-block engine");
    assert!(
        c.metric(&sidecar, "kvroute_sidecar_push_failures_total").await > 0.0,
        "pushes failed while the router was down"
    );

    cluster.restart_router(0).await.expect("router restarts");
    let r = cluster.router_url(0).to_owned();
    converge(&c, &r, &[engine], WAIT, "the restarted router to equal the engine").await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_rebuilds_from_the_engines_replay_buffer() {
    let mut cluster = start(spec(1)).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let engines = vec![cluster.engines[0].url.clone()];
    traffic(&c, &r, 10).await;
    converge(&c, &r, &engines, WAIT, "the map to hold the engine's blocks").await;
    cluster.sidecars[0].proc.kill().await;
    // The engine keeps caching while its sidecar is down.
    let before = truth(&c, &engines[0]).await.len();
    for i in 100..110 {
        let resp = c
            .post(
                &format!("{}/v1/completions", engines[0]),
                json!({"model": "sim-model", "prompt": prompt(i), "max_tokens": 1}),
            )
            .await;
        assert!(resp.status().is_success(), "{}", resp.status());
    }
    assert!(truth(&c, &engines[0]).await.len() > before, "the engine cached nothing while its sidecar was down");
    cluster.restart_sidecar(0).await.expect("sidecar restarts");
    // No further traffic: the new sidecar must rebuild from the replay buffer.
    converge(&c, &r, &engines, WAIT, "the map to equal the engine after a sidecar restart").await;
    let sidecar = cluster.sidecars[0].url.clone();
    assert!(c.metric(&sidecar, "kvroute_sidecar_replays_total").await >= 1.0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_beyond_the_replay_buffer_clears_without_phantoms() {
    let mut s = spec(1);
    // The engine keeps only its last 4 batches for replay.
    s.sim_args.extend(["--kv-events-buffer".into(), "4".into()]);
    let cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let engine = cluster.engines[0].url.clone();
    let sidecar = cluster.sidecars[0].url.clone();
    traffic(&c, &r, 5).await;
    converge(&c, &r, std::slice::from_ref(&engine), WAIT, "the map to hold the engine's blocks").await;
    // Every batch is lost for a while: far more than the buffer holds.
    c.post(&format!("{engine}/sim/faults"), json!({"drop_events": 1.0})).await;
    for i in 200..220 {
        c.post(
            &format!("{engine}/v1/completions"),
            json!({"model": "sim-model", "prompt": prompt(i), "max_tokens": 1}),
        )
        .await;
    }
    c.post(&format!("{engine}/sim/faults"), json!({"drop_events": 0.0})).await;
    // A new prefix: its blocks are stored (and keyed) after the rank is
    // cleared, so the router ends up holding keys again.
    let fresh: Vec<u32> = (0..64).map(|t| 700_000 + t).collect();
    c.post(&format!("{engine}/v1/completions"), json!({"model": "sim-model", "prompt": fresh, "max_tokens": 1})).await;
    // The gap is detected and counted; what the sidecar could not recover is
    // dropped, never guessed: every key the router holds is truly cached.
    eventually("the gap to be counted and its replay as lost", WAIT, || {
        let (c, sidecar) = (c.clone(), sidecar.clone());
        async move {
            let text = c.http.get(format!("{sidecar}/metrics")).send().await.unwrap().text().await.unwrap();
            (c.metric(&sidecar, "kvroute_sidecar_seq_gaps_total").await >= 1.0 && text.contains("outcome=\"lost\""))
                .then_some(())
        }
    })
    .await;
    eventually("the router to hold only truly cached keys", WAIT, || {
        let (c, r, engine) = (c.clone(), r.clone(), engine.clone());
        async move {
            let truth = kvroute_tests::truth(&c, &engine).await;
            let held = kvroute_tests::confirmed(&c, &r, "w1").await;
            (!held.is_empty() && held.iter().all(|k| truth.contains(k))).then_some(())
        }
    })
    .await;
    cluster.shutdown().await;
}
