//! End-to-end flows of `run` against a fake router and a fake vLLM publisher.

mod support;

use std::sync::atomic::Ordering;

use support::{Harness, hex_set, keys, removed, stored};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_become_eviction_pushes() {
    let mut h = Harness::start("60s").await;
    let before = h.received().len();
    let tokens: Vec<u32> = (0..12).collect();
    let k = keys(&tokens);
    h.publisher.publish(vec![stored(&[1, 2], None, &tokens[..8])]).await;
    h.publisher.publish(vec![stored(&[3], Some(2), &tokens[8..])]).await;
    support::wait("router view holds the chain", || async { h.router_view() == hex_set(&k) }).await;
    let after: Vec<_> = h.received()[before..].to_vec();
    assert!(after.iter().all(|m| !m.is_sync()), "events travel as evictions, not syncs");
    let first = &after[0].body;
    assert_eq!(first["worker_id"], "w1");
    assert!(first["seq"].as_u64().unwrap() > 0);
    h.publisher.publish(vec![removed(&[3])]).await;
    support::wait("eviction of the last block", || async { h.router_view() == hex_set(&k[..2]) }).await;
    let last = h.received().last().unwrap().body.clone();
    assert_eq!(last["evicted_hashes"][0], k[2].to_hex());
    let seqs: Vec<u64> = h.received().iter().map(|m| m.body["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "seq increases: {seqs:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_sync_carries_the_full_state() {
    let mut h = Harness::start("300ms").await;
    let tokens: Vec<u32> = (100..108).collect();
    h.publisher.publish(vec![stored(&[11, 12], None, &tokens)]).await;
    let want = hex_set(&keys(&tokens));
    h.wait_for("a sync with both keys and load", |r| {
        r.iter().any(|m| {
            m.is_sync()
                && m.body["hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_owned())
                    .collect::<std::collections::HashSet<_>>()
                    == want
                && m.body["load"].is_object()
        })
    })
    .await;
    let sync = h.received().into_iter().rev().find(|m| m.is_sync() && m.body["load"].is_object()).unwrap().body;
    assert_eq!(sync["worker_id"], "w1");
    assert_eq!(sync["url"], "http://10.0.0.7:8000");
    assert_eq!(sync["models"], serde_json::json!(["m", "sql-adapter"]));
    assert_eq!(sync["block_size"], 4);
    assert_eq!(sync["load"], serde_json::json!({"running": 3, "waiting": 1, "kv_usage": 0.5}));
    assert_eq!(sync["epoch"], h.epoch().await.as_str());
    // Protocol v2: the digest of the set, and no wall-clock time.
    assert_eq!(sync["digest"]["count"], 2);
    assert!(sync.get("as_of_ms").is_none(), "{sync}");
    let syncs = h.received().iter().filter(|m| m.is_sync()).count();
    h.wait_for("another periodic sync", |r| r.iter().filter(|m| m.is_sync()).count() > syncs).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_restart_triggers_an_immediate_sync() {
    let mut h = Harness::start("60s").await;
    let syncs_before = h.received().iter().filter(|m| m.is_sync()).count();
    *h.fake.router_epoch.lock() = "r2".into();
    let tokens: Vec<u32> = (200..204).collect();
    h.publisher.publish(vec![stored(&[21], None, &tokens)]).await;
    // The eviction's ack carries the new router epoch; a sync must follow at
    // once (the sync interval is a minute).
    h.wait_for("a sync after the router epoch changed", |r| r.iter().filter(|m| m.is_sync()).count() > syncs_before)
        .await;
    let sync = h.received().into_iter().rev().find(|m| m.is_sync()).unwrap().body;
    assert_eq!(sync["hashes"], serde_json::json!([keys(&tokens)[0].to_hex()]));
    h.stop().await;
}

/// A push the router answers `unknown_worker` was not applied: it counts as
/// a failure (a router refusing every push showed as healthy), and a full
/// sync follows at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_push_counts_as_a_failure_and_a_sync_follows() {
    let mut h = Harness::start("60s").await;
    // The eviction series of the one router.
    let count = |text: String, family: &str| -> f64 {
        let prefix = format!("kvroute_sidecar_{family}_total{{");
        let line = text.lines().find(|l| l.starts_with(&prefix) && l.contains("kind=\"eviction\""));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    h.epoch().await;
    let failed = count(h.metrics().await, "push_failures");
    let syncs_before = h.received().iter().filter(|m| m.is_sync()).count();
    h.fake.refuse_next_eviction.store(true, Ordering::SeqCst);
    h.publisher.publish(vec![stored(&[31], None, &(300..304).collect::<Vec<u32>>())]).await;
    h.wait_for("a sync after the refusal", |r| r.iter().filter(|m| m.is_sync()).count() > syncs_before).await;
    // (Heartbeats go on being applied: `pushes` cannot be held still.)
    support::wait("the refusal counted", || async { count(h.metrics().await, "push_failures") > failed }).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_outage_ends_with_a_full_sync() {
    let mut h = Harness::start("60s").await;
    h.fake.down.store(true, Ordering::SeqCst);
    let n_before = h.received().len();
    let tokens: Vec<u32> = (0..400).collect();
    let mut parent = None;
    for (i, chunk) in tokens.chunks(4).enumerate() {
        let hash = 1000 + i as u64;
        h.publisher.publish(vec![stored(&[hash], parent, chunk)]).await;
        parent = Some(hash);
        if i % 10 == 0 {
            h.publisher.publish(vec![removed(&[hash])]).await;
            parent = None;
        }
    }
    // Two failures in a row: one lost delta is repaired by the next push
    // (protocol v2), a longer outage ends with the whole key set.
    support::wait("two failed pushes", || async {
        let text = h.metrics().await;
        let failed: f64 = text
            .lines()
            .filter(|l| l.starts_with("kvroute_sidecar_push_failures_total{"))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum();
        failed >= 2.0
    })
    .await;
    support::wait("all events applied", || async {
        h.health().await.is_some_and(|v| v["keys"].as_u64().unwrap_or(0) > 0)
    })
    .await;
    h.fake.down.store(false, Ordering::SeqCst);
    h.wait_for("a message after recovery", |r| r.len() > n_before).await;
    let first = h.received()[n_before].clone();
    assert!(first.is_sync(), "first message after recovery is a full sync, got {}", first.path);
    let health = h.health().await.unwrap();
    support::wait("router view equals the sidecar's keys", || async {
        h.router_view().len() as u64 == health["keys"].as_u64().unwrap()
    })
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_and_resyncs() {
    let mut h = Harness::start("60s").await;
    let old: Vec<u32> = (0..8).collect();
    h.publisher.publish(vec![stored(&[1, 2], None, &old)]).await;
    support::wait("old keys", || async { h.router_view() == hex_set(&keys(&old)) }).await;
    let epoch = h.epoch().await;
    // A restarted engine numbers its batches from 0 again.
    let new: Vec<u32> = (50..54).collect();
    h.publisher.publish_at(0, vec![stored(&[7], None, &new)]).await;
    support::wait("only the new engine's key", || async { h.router_view() == hex_set(&keys(&new)) }).await;
    let new_epoch = h.epoch().await;
    assert_ne!(new_epoch, epoch, "an engine restart draws a new epoch");
    let last_sync = h.received().into_iter().rev().find(|m| m.is_sync()).unwrap().body;
    assert_eq!(last_sync["epoch"], new_epoch.as_str());
    assert!(h.metric("kvroute_sidecar_engine_restarts_total").await >= 1.0);
    h.stop().await;
}
