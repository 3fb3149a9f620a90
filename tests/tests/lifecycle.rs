//! The paper's four states of a prefix, asserted on a real cluster (three
//! simulated engines, three sidecars, one router): cold start, stickiness,
//! eviction, recovery.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use kvroute_tests::{Client, eventually, matched, spec, start, text};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_start_stickiness_eviction_recovery() {
    let cluster = start(spec(3)).await;
    let r = cluster.router_url(0).to_owned();
    let c = Client::default();
    let shared = text(1, 300);

    // 1. Cold start: a concurrent burst of one new prefix lands on one worker
    //    (the first request's speculative entries hold the rest together).
    let burst = (0..8).map(|i| {
        let c = c.clone();
        let (r, p) = (r.clone(), format!("{shared} question {i}"));
        async move { c.complete(&r, &p, 4).await.0 }
    });
    let landed: BTreeSet<String> = futures::future::join_all(burst).await.into_iter().collect();
    assert_eq!(landed.len(), 1, "the burst scattered over {landed:?}");
    let holder = landed.into_iter().next().expect("one worker");

    // The sidecar confirms the speculative entries with the engine's events.
    eventually("the holder's blocks confirmed by its sidecar", WAIT, || {
        let (c, r, holder) = (c.clone(), r.clone(), holder.clone());
        async move {
            let index = c.get(&format!("{r}/debug/index")).await;
            (index["workers"][&holder]["confirmed"].as_u64() > Some(0)).then_some(())
        }
    })
    .await;

    // 2. Stickiness: with two streams held open on the holder, another worker
    //    is less loaded, and the repeat still goes to the holder.
    let mut open = Vec::new();
    for i in 0..2 {
        let resp = c
            .post(
                &format!("{r}/v1/completions"),
                json!({"model": "sim-model", "prompt": format!("{shared} long {i}"), "max_tokens": 20000, "stream": true}),
            )
            .await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-kvroute-worker"].to_str().unwrap(), holder);
        let mut body = resp.bytes_stream();
        body.next().await.expect("first chunk").expect("chunk");
        open.push(body);
    }
    let debug = c.debug_route(&r, &format!("{shared} again")).await;
    let loads: Vec<(String, u64)> = debug["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_str().unwrap().to_owned(), w["load"]["inflight"].as_u64().unwrap()))
        .collect();
    let holder_load = loads.iter().find(|(w, _)| *w == holder).unwrap().1;
    assert!(loads.iter().any(|(w, l)| *w != holder && *l < holder_load), "another worker is less loaded: {loads:?}");
    assert_eq!(debug["decision"]["worker"], holder.as_str(), "{debug}");
    assert_eq!(c.complete(&r, &format!("{shared} again"), 4).await.0, holder);
    drop(open);

    // 3. Eviction: the holder drops its cache and another worker computes the
    //    prefix on its own (a request sent straight to its engine). The router
    //    stops routing to the evicted holder.
    let holder_i = worker_index(&holder);
    let other_i = (holder_i + 1) % 3;
    let other = format!("w{}", other_i + 1);
    reset(&c, &cluster.engines[holder_i].url).await;
    let direct = c
        .post(
            &format!("{}/v1/completions", cluster.engines[other_i].url),
            json!({"model": "sim-model", "prompt": format!("{shared} direct"), "max_tokens": 2}),
        )
        .await;
    assert!(direct.status().is_success());
    eventually("the router to see the eviction and the other worker's blocks", WAIT, || {
        let (c, r, holder, other, shared) = (c.clone(), r.clone(), holder.clone(), other.clone(), shared.clone());
        async move {
            let d = c.debug_route(&r, &format!("{shared} after")).await;
            (matched(&d, &holder) == 0 && matched(&d, &other) > 0).then_some(())
        }
    })
    .await;
    assert_eq!(c.complete(&r, &format!("{shared} after"), 4).await.0, other);

    // 4. Recovery: once nobody holds the prefix, it is placed afresh and the
    //    next requests stick to where it was placed.
    for e in &cluster.engines {
        reset(&c, &e.url).await;
    }
    let d = eventually("every worker's entries for the prefix gone", WAIT, || {
        let (c, r, shared) = (c.clone(), r.clone(), shared.clone());
        async move {
            let d = c.debug_route(&r, &format!("{shared} recovered")).await;
            let gone = d["workers"].as_array().unwrap().iter().all(|w| w["matched_blocks"] == 0);
            gone.then_some(d)
        }
    })
    .await;
    assert_eq!(d["decision"]["reason"], "cold_placement", "{d}");
    let placed = c.complete(&r, &format!("{shared} recovered"), 4).await.0;
    for i in 0..3 {
        assert_eq!(c.complete(&r, &format!("{shared} recovered {i}"), 4).await.0, placed);
    }
    cluster.shutdown().await;
}

fn worker_index(id: &str) -> usize {
    id.trim_start_matches('w').parse::<usize>().expect("worker ids are wN") - 1
}

/// `POST /reset_prefix_cache` on an engine, retried while requests still run
/// (vLLM answers `{"success": false}` with blocks in use), then one tiny
/// request: like vLLM, the engine publishes `AllBlocksCleared` only with its
/// next step, and an idle engine takes none.
async fn reset(c: &Client, engine: &str) {
    eventually("the engine to reset its prefix cache", WAIT, || {
        let c = c.clone();
        let url = format!("{engine}/reset_prefix_cache");
        async move {
            let resp = c.http.post(&url).send().await.ok().filter(|r| r.status().is_success())?;
            let body: serde_json::Value = resp.json().await.ok()?;
            (body["success"] == true).then_some(())
        }
    })
    .await;
    let url = format!("{engine}/v1/completions");
    let nudge = c.post(&url, json!({"model": "sim-model", "prompt": "hi", "max_tokens": 1})).await;
    assert!(nudge.status().is_success());
}
