//! Router restarts and router replicas: the map lives in the sidecars' pushes,
//! so a restarted router is whole again after one sync, and two routers fed by
//! the same sidecars make the same decisions and hear each other's in-flight
//! work.

use std::time::Duration;

use kvroute_tests::{Client, eventually, matched, spec, start, text};

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
