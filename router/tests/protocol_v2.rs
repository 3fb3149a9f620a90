//! Wire protocol v2 through the router's HTTP surface (in-process): digests
//! on every push and a full sync only on a mismatch, causal (not wall-clock)
//! survival of speculative entries, liveness from any push, and v1 sidecars
//! still accepted (one release of overlap).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_router::config::{RawConfig, Secret};
use kvroute_router::index::Kind;
use kvroute_router::state::{AppState, now_ms};
use kvroute_router::{app, build_state};
use kvroute_shared::{BlockKey, KeyDigest, WorkerId};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

const TOKEN: &str = "protocol-v2-internal-token-0123";
const EPOCH: &str = "0190000000000000aaaa";

fn state() -> Arc<AppState> {
    let raw = RawConfig { internal_token: Some(Secret::new(TOKEN)), ..Default::default() };
    build_state(raw.validate().unwrap(), CancellationToken::new()).unwrap()
}

/// POSTs `body` under protocol `version` (`None`: no header, as sidecars
/// before versioning) and returns the status and the JSON answer.
async fn push(state: &Arc<AppState>, path: &str, version: Option<u32>, body: Value) -> (StatusCode, Value) {
    let mut req = Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {TOKEN}"));
    if let Some(v) = version {
        req = req.header("x-kvroute-protocol", v.to_string());
    }
    let resp = app(state.clone()).oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn hex(keys: &[u64]) -> Vec<String> {
    keys.iter().map(|k| format!("{k:016x}")).collect()
}

fn digest(keys: &[u64]) -> Value {
    serde_json::to_value(KeyDigest::of(keys.iter().map(|&k| BlockKey(k)))).unwrap()
}

fn held(state: &AppState, id: &str) -> Vec<(u64, Kind)> {
    let w = state.workers.get(&WorkerId::new(id)).unwrap();
    state.map.read().index.keys_of(w.slot).into_iter().map(|(k, kind)| (k.0, kind)).collect()
}

fn sync_body(seq: u64, keys: &[u64]) -> Value {
    json!({"worker_id": "w1", "epoch": EPOCH, "seq": seq, "url": "http://10.0.0.1:8000",
           "hashes": hex(keys), "digest": digest(keys)})
}

fn batch(seq: u64, stored: &[u64], evicted: &[u64], after: &[u64]) -> Value {
    json!({"worker_id": "w1", "epoch": EPOCH, "seq": seq, "stored_hashes": hex(stored),
           "evicted_hashes": hex(evicted), "digest": digest(after)})
}

/// A lost batch shows at the next one: the router's digest of the worker's
/// confirmed keys differs from the sidecar's, the ack asks for a full sync,
/// and after it the digests agree again.
#[tokio::test]
async fn a_lost_batch_is_detected_by_digest_and_healed_by_one_sync() {
    let s = state();
    let (status, ack) = push(&s, "/internal/sync", Some(2), sync_body(1, &[1, 2])).await;
    assert_eq!((status, ack["outcome"].as_str(), ack.get("resync")), (StatusCode::OK, Some("applied"), None));
    let (_, ack) = push(&s, "/internal/eviction", Some(2), batch(2, &[3], &[], &[1, 2, 3])).await;
    assert_eq!(ack.get("resync"), None, "in sync: {ack}");
    // Batch 3 (store 4, evict 1) is lost; batch 4 stores 5.
    let (_, ack) = push(&s, "/internal/eviction", Some(2), batch(4, &[5], &[], &[2, 3, 4, 5])).await;
    assert_eq!(ack["resync"], true, "{ack}");
    let metrics = s.metrics.encode();
    assert!(metrics.contains("kind=\"digest_mismatch\"} 1"), "{metrics}");
    let (_, ack) = push(&s, "/internal/sync", Some(2), sync_body(5, &[2, 3, 4, 5])).await;
    assert_eq!(ack["outcome"], "applied");
    assert_eq!(held(&s, "w1").into_iter().map(|(k, _)| k).collect::<Vec<_>>(), [2, 3, 4, 5]);
    let (_, ack) = push(&s, "/internal/eviction", Some(2), batch(6, &[], &[2], &[3, 4, 5])).await;
    assert_eq!(ack.get("resync"), None, "healed: {ack}");
    s.map.read().index.check_consistency().unwrap();
}

/// A sync that does not reproduce its own digest (the worker cleared while
/// its chunks were applied, or a bug) is answered with a resync, not left
/// for the next delta to find.
#[tokio::test]
async fn a_sync_that_misses_its_own_digest_asks_for_another() {
    let s = state();
    let mut body = sync_body(1, &[1, 2]);
    body["digest"] = digest(&[1, 2, 3]);
    let (status, ack) = push(&s, "/internal/sync", Some(2), body).await;
    assert_eq!((status, ack["outcome"].as_str(), &ack["resync"]), (StatusCode::OK, Some("applied"), &json!(true)));
    let (_, ack) = push(&s, "/internal/sync", Some(2), sync_body(2, &[1, 2])).await;
    assert_eq!(ack.get("resync"), None, "{ack}");
}

/// Speculative entries are the router's own: they never count in the digest,
/// and a sync drops exactly those made up to the router clock it covers,
/// whatever time the sidecar's clock (ten minutes off either way) says.
#[tokio::test]
async fn a_sync_keeps_speculative_entries_made_after_the_clock_it_covers_whatever_the_sidecar_clock() {
    for skew_ms in [-600_000i64, 600_000] {
        let s = state();
        let (_, ack) = push(&s, "/internal/sync", Some(2), sync_body(1, &[1])).await;
        let w = s.workers.get(&WorkerId::new("w1")).unwrap();
        s.map.write().index.record_routed(w.slot, &[BlockKey(1), BlockKey(10)], now_ms());
        // The sidecar heard from the router after the request for 10 was routed.
        let (_, ack2) = push(&s, "/internal/eviction", Some(2), batch(2, &[], &[], &[1])).await;
        assert_eq!(ack2.get("resync"), None, "a speculative entry is not in the digest: {ack2}");
        let covered = ack2["clock"].as_u64().unwrap();
        assert!(covered > ack["clock"].as_u64().unwrap());
        s.map.write().index.record_routed(w.slot, &[BlockKey(1), BlockKey(11)], now_ms());
        let skewed = now_ms().saturating_add_signed(skew_ms);
        let mut body = sync_body(3, &[1]);
        body["covers"] = json!(covered);
        body["as_of_ms"] = json!(skewed);
        let (_, ack3) = push(&s, "/internal/sync", Some(2), body).await;
        assert_eq!(ack3["outcome"], "applied");
        assert_eq!(
            held(&s, "w1"),
            [(1, Kind::Confirmed), (11, Kind::Speculative)],
            "10 was routed before the covered clock, 11 after (skew {skew_ms} ms)"
        );
    }
}

/// One release of overlap: a v1 sidecar (no header, or 1; no digests; a
/// wall-clock `as_of_ms`) is served as before, and never asked to resync.
#[tokio::test]
async fn a_v1_sidecar_is_served_by_a_v2_router() {
    let s = state();
    for version in [None, Some(1)] {
        let sync = json!({"worker_id": "w1", "epoch": EPOCH, "seq": 1, "url": "http://10.0.0.1:8000",
                          "hashes": hex(&[1, 2]), "as_of_ms": now_ms()});
        let (status, ack) = push(&s, "/internal/sync", version, sync).await;
        assert_eq!(
            (status, ack["outcome"].as_str(), ack["protocol"].as_u64()),
            (StatusCode::OK, Some("applied"), Some(2))
        );
        let w = s.workers.get(&WorkerId::new("w1")).unwrap();
        s.map.write().index.record_routed(w.slot, &[BlockKey(7)], now_ms() + 60_000);
        let delta = json!({"worker_id": "w1", "epoch": EPOCH, "seq": 2, "evicted_hashes": hex(&[1])});
        let (_, ack) = push(&s, "/internal/eviction", version, delta).await;
        assert_eq!((ack["outcome"].as_str(), ack.get("resync")), (Some("applied"), None), "{ack}");
        // A v1 sync keeps speculative entries made after its as_of_ms, as v1 did.
        let again = json!({"worker_id": "w1", "epoch": EPOCH, "seq": 3, "hashes": hex(&[2, 3]), "as_of_ms": now_ms()});
        push(&s, "/internal/sync", version, again).await;
        assert_eq!(held(&s, "w1"), [(2, Kind::Confirmed), (3, Kind::Confirmed), (7, Kind::Speculative)]);
        let w = s.workers.get(&WorkerId::new("w1")).unwrap();
        assert!(s.map.write().remove(&s.workers, &w));
    }
}

/// Liveness is any push, not an applied key set: a push the router calls
/// stale still shows the sidecar alive.
#[tokio::test]
async fn any_push_from_a_member_counts_as_a_sign_of_life() {
    let s = state();
    push(&s, "/internal/sync", Some(2), sync_body(5, &[1])).await;
    let w = s.workers.get(&WorkerId::new("w1")).unwrap();
    w.live.last_report_ms.store(1, Ordering::Relaxed);
    let (_, ack) = push(&s, "/internal/eviction", Some(2), batch(4, &[], &[], &[1])).await;
    assert_eq!(ack["outcome"], "stale");
    assert!(w.live.last_report_ms.load(Ordering::Relaxed) > 1, "a stale push is still a sign of life");
}

/// A push the router refuses (`stale`, `unknown_worker`) is answered with
/// its clock as well: the sync that answers it covers what was routed
/// before, which otherwise lingered until `speculative_ttl`.
#[tokio::test]
async fn a_refused_push_is_acked_with_the_clock_its_sync_covers() {
    let s = state();
    push(&s, "/internal/sync", Some(2), sync_body(5, &[1])).await;
    let w = s.workers.get(&WorkerId::new("w1")).unwrap();
    s.map.write().index.record_routed(w.slot, &[BlockKey(1), BlockKey(10)], now_ms());
    let (_, ack) = push(&s, "/internal/eviction", Some(2), batch(4, &[], &[], &[1])).await;
    assert_eq!(ack["outcome"], "stale");
    let covered = ack["clock"].as_u64().expect("a stale ack carries the clock");
    let mut body = sync_body(6, &[1]);
    body["covers"] = json!(covered);
    push(&s, "/internal/sync", Some(2), body).await;
    assert_eq!(held(&s, "w1"), [(1, Kind::Confirmed)], "10 was routed before the clock the sync covers");
    let mut stranger = batch(1, &[2], &[], &[2]);
    stranger["worker_id"] = json!("w2");
    let (_, ack) = push(&s, "/internal/eviction", Some(2), stranger).await;
    assert_eq!(ack["outcome"], "unknown_worker");
    assert!(ack["clock"].as_u64().is_some_and(|c| c >= covered), "{ack}");
}

/// A large sync, applied in chunks, leaves exactly its key set (plus the
/// speculative entries it does not cover) with forward and reverse maps in
/// agreement, and its digest equal to the sidecar's.
#[tokio::test]
async fn a_large_sync_applied_in_chunks_replaces_the_key_set_exactly() {
    let s = state();
    let old: Vec<u64> = (1..=10_000).collect();
    push(&s, "/internal/sync", Some(2), sync_body(1, &old)).await;
    let new: Vec<u64> = (5_001..=20_000).collect();
    let (_, ack) = push(&s, "/internal/sync", Some(2), sync_body(2, &new)).await;
    assert_eq!(ack["outcome"], "applied");
    let w = s.workers.get(&WorkerId::new("w1")).unwrap();
    let map = s.map.read();
    map.index.check_consistency().unwrap();
    assert_eq!(map.index.digest(w.slot), KeyDigest::of(new.iter().map(|&k| BlockKey(k))));
    assert_eq!(map.index.counts(w.slot).confirmed, new.len());
}
