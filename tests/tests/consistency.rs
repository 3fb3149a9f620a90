//! The router's map against the engines' truth: sim → sidecar → router, with
//! evictions, resets and faults. "Truth" is `GET /sim/cache` (the engine's
//! cached blocks as router keys); the router's side is
//! `GET /debug/index?worker=ID`.

use std::collections::BTreeSet;
use std::time::Duration;

use kvroute_shared::{BlockKey, BlockSize, KeyRoot, block_keys};
use kvroute_tests::{Client, confirmed, converge, eventually, spec, start, truth};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// Token-id prompts: shared prefixes of various lengths, so the small caches
/// evict and prefixes overlap.
fn prompt(i: u32) -> Vec<u32> {
    let group = i % 5;
    (0..16 * (4 + group)).map(|t| group * 100_000 + t).chain((0..40).map(|t| i * 1000 + t)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_traffic_the_map_equals_the_engines_cache_exactly() {
    let mut s = spec(2);
    // 48 blocks per engine: the traffic below needs far more, so engines evict.
    s.num_blocks = 48;
    let cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    for i in 0..60 {
        let resp = c
            .post(&format!("{r}/v1/completions"), json!({"model": "sim-model", "prompt": prompt(i), "max_tokens": 2}))
            .await;
        assert!(resp.status().is_success(), "{}", resp.status());
    }
    let engines: Vec<String> = cluster.engines.iter().map(|e| e.url.clone()).collect();
    converge(&c, &r, &engines, WAIT, "the router's map to equal each engine's cache").await;
    // Evictions happened: 60 prompts of 6 to 11 blocks do not fit 2 × 48 blocks.
    let root = KeyRoot::new("sim-model", None);
    let created: BTreeSet<BlockKey> = (0..60).flat_map(|i| block_keys(root, &prompt(i), BlockSize::DEFAULT)).collect();
    let mut held = 0;
    for e in &engines {
        held += truth(&c, e).await.len();
    }
    assert!(held < created.len(), "engines hold {held} of {} blocks: they must have evicted", created.len());

    // /reset_prefix_cache (vLLM's AllBlocksCleared): the worker's entries go
    // (it held some: else "gone" held from the start).
    eventually("w1's entries confirmed before the reset", WAIT, || {
        let (c, r) = (c.clone(), r.clone());
        async move { (!confirmed(&c, &r, "w1").await.is_empty()).then_some(()) }
    })
    .await;
    let resp = c.post(&format!("{}/reset_prefix_cache", engines[0]), json!({})).await;
    assert!(resp.status().is_success());
    // Like vLLM, the engine publishes AllBlocksCleared with its next step.
    let nudge = json!({"model": "sim-model", "prompt": "hi", "max_tokens": 1});
    assert!(c.post(&format!("{}/v1/completions", engines[0]), nudge).await.status().is_success());
    eventually("w1's entries gone after the reset", WAIT, || {
        let (c, r) = (c.clone(), r.clone());
        async move { confirmed(&c, &r, "w1").await.is_empty().then_some(()) }
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_engine_events_are_healed() {
    let mut s = spec(1);
    s.num_blocks = 64;
    let cluster = start(s).await;
    let c = Client::default();
    let r = cluster.router_url(0).to_owned();
    let engine = cluster.engines[0].url.clone();
    // The engine loses 30 % of its event batches (they stay replayable, as
    // in vLLM's buffer): the sidecar sees the gaps and replays them.
    let resp = c.post(&format!("{engine}/sim/faults"), json!({"drop_events": 0.3})).await;
    assert!(resp.status().is_success());
    for i in 0..40 {
        let body = json!({"model": "sim-model", "prompt": prompt(i), "max_tokens": 2});
        let resp = c.post(&format!("{r}/v1/completions"), body).await;
        assert!(resp.status().is_success(), "{}", resp.status());
    }
    assert!(c.post(&format!("{engine}/sim/faults"), json!({"drop_events": 0.0})).await.status().is_success());
    converge(&c, &r, std::slice::from_ref(&engine), WAIT, "the map to heal from dropped event batches").await;
    assert!(!truth(&c, &engine).await.is_empty(), "the engine cached nothing: nothing was healed");
    let sidecar = cluster.sidecars[0].url.clone();
    assert!(c.metric(&sidecar, "kvroute_sidecar_seq_gaps_total").await >= 1.0, "no batch was dropped");
    cluster.shutdown().await;
}
