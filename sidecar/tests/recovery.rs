//! Gap recovery through the engine's replay endpoint, and anti-entropy through
//! the engine snapshot hook.

mod support;

use std::sync::Arc;

use parking_lot::Mutex;
use support::{Harness, Options, hex_set, keys, removed, stored};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_in_order() {
    let mut h = Harness::start_with(Options { replay_keep_last: Some(10_000), ..Options::sync("60s") }).await;
    let epoch = h.epoch().await;
    let tokens: Vec<u32> = (0..12).collect();
    h.publisher.publish(vec![stored(&[1], None, &tokens[..4])]).await;
    h.publisher.drop_next(vec![stored(&[2], Some(1), &tokens[4..8])]);
    h.publisher.drop_next(vec![removed(&[1])]);
    h.publisher.publish(vec![stored(&[3], Some(2), &tokens[8..])]).await;
    let k = keys(&tokens);
    support::wait("the replayed chain", || async { h.router_view() == hex_set(&k[1..]) }).await;
    assert!(h.metric("kvroute_sidecar_replays_total{outcome=\"recovered\"}").await >= 1.0);
    assert_eq!(h.epoch().await, epoch, "a recovered gap keeps the epoch");
    h.stop().await;
}

/// A sidecar starting beside an engine that has run for a while: its first
/// sync carries what the replay buffer holds, even when the replay is slower
/// than the first push would be, so a router never sees the worker empty
/// (registered empty, or its kept set wiped by a restarted sidecar).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_sync_waits_for_what_the_engine_cached_before_the_start() {
    let tokens: Vec<u32> = (0..8).collect();
    let before = vec![vec![stored(&[1], None, &tokens[..4])], vec![stored(&[2], Some(1), &tokens[4..])]];
    let opts = Options {
        replay_keep_last: Some(10_000),
        published_before: before,
        slow_first_replay: true,
        ..Options::sync("60s")
    };
    let h = Harness::start_with(opts).await;
    let received = h.received();
    let first = received.iter().find(|m| m.is_sync()).expect("a sync");
    let hashes: std::collections::HashSet<String> =
        first.body["hashes"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_owned()).collect();
    assert_eq!(hashes, hex_set(&keys(&tokens)), "the first sync holds the replayed blocks");
    h.stop().await;
}

/// An engine that restarts on its port: the sidecar sees the connection
/// close, clears the worker, connects again and rebuilds from the new
/// engine's replay buffer (its first batch went out before the sidecar was
/// back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_on_its_port_is_reconnected_and_rebuilt() {
    let mut h = Harness::start_with(Options { replay_keep_last: Some(10_000), ..Options::sync("60s") }).await;
    let old: Vec<u32> = (0..4).collect();
    h.publisher.publish(vec![stored(&[1], None, &old)]).await;
    support::wait("the old engine's block", || async { h.router_view() == hex_set(&keys(&old)) }).await;
    h.publisher.restart().await;
    let new: Vec<u32> = (10..14).collect();
    h.publisher.publish(vec![stored(&[2], None, &new)]).await;
    support::wait("the new engine's block only", || async { h.router_view() == hex_set(&keys(&new)) }).await;
    assert!(h.metric("kvroute_sidecar_event_disconnects_total").await >= 1.0);
    h.stop().await;
}

/// The idle probe recovers a batch the live stream lost; when the stream then
/// delivers its late copy, that is a duplicate, not an engine restart (which
/// would clear the worker while the engine still holds everything).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_copy_of_a_batch_the_idle_probe_recovered_is_no_restart() {
    let mut h = Harness::start_with(Options { replay_keep_last: Some(10_000), ..Options::sync("60s") }).await;
    let epoch = h.epoch().await;
    let tokens: Vec<u32> = (0..8).collect();
    h.publisher.publish(vec![stored(&[1], None, &tokens[..4])]).await;
    let lost_at = h.publisher.seq;
    h.publisher.drop_next(vec![stored(&[2], Some(1), &tokens[4..])]);
    let k = keys(&tokens);
    support::wait("the batch the idle probe recovered", || async { h.router_view() == hex_set(&k) }).await;
    h.publisher.publish_at(lost_at, vec![stored(&[2], Some(1), &tokens[4..])]).await;
    let next: Vec<u32> = (20..24).collect();
    h.publisher.seq = lost_at + 1;
    h.publisher.publish(vec![stored(&[3], None, &next)]).await;
    let mut all = k.clone();
    all.extend(keys(&next));
    support::wait("every key, none cleared", || async { h.router_view() == hex_set(&all) }).await;
    assert_eq!(h.metric("kvroute_sidecar_engine_restarts_total").await, 0.0, "a duplicate is no restart");
    // No resync either: the same epoch, and the only sync the warm-up's.
    assert_eq!(h.epoch().await, epoch, "a replayed batch keeps the epoch");
    let syncs = h.received().iter().filter(|m| m.is_sync() && m.body["epoch"] == epoch.as_str()).count();
    assert_eq!(syncs, 1, "no full sync after the replay");
    h.stop().await;
}

/// An engine that restarted unnoticed (no disconnect seen) and whose first
/// batches went by: the first one seen numbers below what was expected, and
/// the new engine's events are replayed from its first, so blocks chained to
/// the unseen ones are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_seen_mid_stream_is_replayed_from_its_start() {
    let mut h = Harness::start_with(Options { replay_keep_last: Some(10_000), ..Options::sync("60s") }).await;
    let old: Vec<u32> = (0..4).collect();
    for hash in 1..=3 {
        h.publisher
            .publish(vec![stored(&[hash * 100], None, &old.iter().map(|t| t + hash as u32 * 10).collect::<Vec<_>>())])
            .await;
    }
    support::wait("the old engine's keys", || async { h.router_view().len() == 3 }).await;
    // The new engine: its buffer starts empty, its batch 0 is missed.
    h.publisher.history.clear();
    h.publisher.seq = 0;
    let tokens: Vec<u32> = (50..58).collect();
    h.publisher.drop_next(vec![stored(&[1], None, &tokens[..4])]);
    h.publisher.publish(vec![stored(&[2], Some(1), &tokens[4..])]).await;
    support::wait("the new engine's whole chain", || async { h.router_view() == hex_set(&keys(&tokens)) }).await;
    assert!(h.metric("kvroute_sidecar_engine_restarts_total").await >= 1.0);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_beyond_the_replay_buffer_clears_and_resyncs() {
    let mut h = Harness::start_with(Options { replay_keep_last: Some(2), ..Options::sync("60s") }).await;
    let old: Vec<u32> = (0..4).collect();
    h.publisher.publish(vec![stored(&[1], None, &old)]).await;
    support::wait("the first key", || async { h.router_view() == hex_set(&keys(&old)) }).await;
    let epoch = h.epoch().await;
    for _ in 0..5 {
        h.publisher.drop_next(vec![removed(&[1])]);
    }
    let new: Vec<u32> = (10..14).collect();
    h.publisher.publish(vec![stored(&[9], None, &new)]).await;
    support::wait("a fresh view", || async { h.router_view() == hex_set(&keys(&new)) }).await;
    assert_ne!(h.epoch().await, epoch, "lost events draw a new epoch");
    assert!(h.metric("kvroute_sidecar_replays_total{outcome=\"lost\"}").await >= 1.0);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_snapshot_drops_blocks_the_engine_lost() {
    let held = Arc::new(Mutex::new(Vec::new()));
    let mut h = Harness::start_with(Options { snapshot: Some(held.clone()), ..Options::sync("200ms") }).await;
    let tokens: Vec<u32> = (0..8).collect();
    *held.lock() = vec![1];
    h.publisher.publish(vec![stored(&[1, 2], None, &tokens)]).await;
    // The engine dropped block 2 without an event reaching us: the next
    // snapshot removes it.
    let k = keys(&tokens);
    support::wait("only the block the engine holds", || async {
        h.router_view() == hex_set(&k[..1]) && h.health().await.is_some_and(|v| v["keys"] == 1)
    })
    .await;
    assert!(h.metric("kvroute_sidecar_snapshot_dropped_blocks_total").await >= 1.0);
    h.stop().await;
}
