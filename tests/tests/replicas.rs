//! Router restarts and router replicas: the map lives in the sidecars' pushes,
//! so a restarted router is whole again after one sync, and two routers fed by
//! the same sidecars make the same decisions and hear each other's in-flight
//! work.

use std::time::Duration;

use kvroute_tests::{Client, eventually, matched, spec, start, text};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_router_rebuilds_its_map_from_the_sidecars() {
    let mut cluster = start(spec(2)).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let prompt = text(7, 200);
    let (holder, _) = c.complete(&r, &prompt, 2).await;
    let before = eventually("the holder's blocks confirmed", WAIT, || {
        let (c, r, holder) = (c.clone(), r.clone(), holder.clone());
        async move {
            let n = c.get(&format!("{r}/debug/index")).await["workers"][&holder]["confirmed"].as_u64().unwrap_or(0);
            (n > 0).then_some(n)
        }
    })
    .await;

    cluster.routers[0].proc.kill().await;
    cluster.restart_router(0).await.expect("router restarts");
    let r = cluster.router_url(0).to_owned();
    eventually("the restarted router to hold the holder's blocks again", WAIT, || {
        let (c, r, holder) = (c.clone(), r.clone(), holder.clone());
        async move {
            let n = c.get(&format!("{r}/debug/index")).await["workers"][&holder]["confirmed"].as_u64().unwrap_or(0);
            (n >= before).then_some(())
        }
    })
    .await;
    let d = c.debug_route(&r, &prompt).await;
    assert_eq!(d["decision"]["worker"], holder.as_str(), "{d}");
    assert_eq!(d["decision"]["reason"], "best_cost");
    assert!(matched(&d, &holder) > 0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_router_replicas_agree() {
    let mut s = spec(3);
    s.routers = 2;
    let cluster = start(s).await;
    let c = Client::default();
    let (r1, r2) = (cluster.router_url(0).to_owned(), cluster.router_url(1).to_owned());

    // New prefixes: both replicas place them on the same worker, unprompted.
    for seed in 100..110 {
        let p = text(seed, 60);
        let a = c.debug_route(&r1, &p).await;
        let b = c.debug_route(&r2, &p).await;
        assert_eq!(a["decision"]["reason"], "cold_placement");
        assert_eq!(a["decision"]["worker"], b["decision"]["worker"], "replicas disagree on {seed}");
    }

    // A prefix served through replica 1 is routed to the same holder by replica 2
    // once the sidecar has pushed its blocks.
    let prompt = text(200, 200);
    let (holder, _) = c.complete(&r1, &prompt, 2).await;
    eventually("replica 2 to learn the holder's blocks", WAIT, || {
        let (c, r2, holder, prompt) = (c.clone(), r2.clone(), holder.clone(), prompt.clone());
        async move { (matched(&c.debug_route(&r2, &prompt).await, &holder) > 0).then_some(()) }
    })
    .await;
    assert_eq!(c.complete(&r2, &prompt, 2).await.0, holder);

    // The cluster links the replicas (`--replica`): each hears the other's
    // in-flight reports.
    for r in [&r1, &r2] {
        eventually("each replica to hear the other", WAIT, || {
            let (c, r) = (c.clone(), r.clone());
            async move {
                let text = c.http.get(format!("{r}/metrics")).send().await.ok()?.text().await.ok()?;
                text.lines().any(|l| l == "kvroute_replicas_heard 1").then_some(())
            }
        })
        .await;
    }
    cluster.shutdown().await;
}

/// A router tells its own requests from others' in the engine's real load
/// reports (scraped once a second, pushed every 100 ms): its own in flight
/// leave it the sole router; requests sent straight to the engine (as a
/// router that does not exchange with it would) do not, and are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_tells_its_own_requests_from_others_in_the_engine_reports() {
    let mut s = spec(1);
    // Real-time decode: a 600-token answer runs for seconds, across scrapes.
    s.sim_args = vec!["--time-scale".into(), "1".into()];
    let cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let engine = cluster.engines[0].url.clone();
    const FOREIGN: &str = "kvroute_foreign_traffic_reports_total";

    let own = {
        let (c, r) = (c.clone(), r.clone());
        tokio::spawn(async move { c.complete(&r, &text(1, 50), 600).await })
    };
    eventually("the engine to report the router's request running", WAIT, || {
        let (c, r) = (c.clone(), r.clone());
        async move {
            let all = c.get(&format!("{r}/admin/workers")).await;
            (all["workers"][0]["load"]["running"].as_u64() == Some(1)).then_some(())
        }
    })
    .await;
    assert_eq!(c.metric(&r, FOREIGN).await, 0.0, "its own request counted as someone else's");
    assert_eq!(c.debug_route(&r, &text(2, 50)).await["sole_router"], true);

    let body = json!({"model": "sim-model", "prompt": text(3, 50), "max_tokens": 600});
    let direct: Vec<_> = (0..2)
        .map(|_| {
            let (c, url, body) = (c.clone(), format!("{engine}/v1/completions"), body.clone());
            tokio::spawn(async move { c.post(&url, body).await.status() })
        })
        .collect();
    eventually("the router to see requests it did not send", WAIT, || {
        let (c, r) = (c.clone(), r.clone());
        async move { (c.metric(&r, FOREIGN).await > 0.0).then_some(()) }
    })
    .await;
    assert_eq!(c.debug_route(&r, &text(2, 50)).await["sole_router"], false);
    assert!(own.await.is_ok());
    for d in direct {
        assert!(d.await.expect("joins").is_success());
    }
    cluster.shutdown().await;
}
