//! Bounded fuzzing of everything a client, a sidecar or another router
//! replica can send the router (proptest-driven, so it runs in CI): no input
//! panics, bad input gets a 4xx naming the field, and a rejected internal
//! push or report changes nothing.
//! Longer runs: `PROPTEST_CASES=100000 cargo test -p kvroute-router --test fuzz`.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_router::config::{RawConfig, Secret};
use kvroute_router::state::AppState;
use kvroute_router::{app, build_state};
use proptest::prelude::*;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

const TOKEN: &str = "fuzz-internal-token-0123";

fn state() -> Arc<AppState> {
    let raw = RawConfig { internal_token: Some(Secret::new(TOKEN)), max_body_bytes: 64 * 1024, ..Default::default() };
    build_state(raw.validate().unwrap(), CancellationToken::new()).unwrap()
}

async fn post(state: &Arc<AppState>, path: &str, body: Vec<u8>) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::from(body))
        .unwrap();
    let resp = app(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// JSON values with the shapes of the fields the router reads, and wrong ones.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        "[a-f0-9]{16}".prop_map(Value::String),
        ".{0,20}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("worker_id".to_string()),
                    Just("hashes".to_string()),
                    Just("evicted_hashes".to_string()),
                    Just("stored_hashes".to_string()),
                    Just("seq".to_string()),
                    Just("epoch".to_string()),
                    Just("url".to_string()),
                    Just("block_size".to_string()),
                    Just("load".to_string()),
                    Just("model".to_string()),
                    Just("prompt".to_string()),
                    Just("messages".to_string()),
                    Just("role".to_string()),
                    Just("content".to_string()),
                    Just("router_epoch".to_string()),
                    Just("workers".to_string()),
                    Just("sent".to_string()),
                    Just("keys".to_string()),
                    Just("id".to_string()),
                    Just("pending_prefill_tokens".to_string()),
                    "[a-z_]{1,8}",
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const PATHS: &[&str] = &[
    "/internal/sync",
    "/internal/eviction",
    "/internal/replica",
    "/v1/completions",
    "/v1/chat/completions",
    "/debug/route",
    "/v1/context",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_or_500(bytes in proptest::collection::vec(any::<u8>(), 0..512), path in 0usize..PATHS.len()) {
        let s = state();
        let (status, body) = rt().block_on(post(&s, PATHS[path], bytes));
        prop_assert!(status.is_client_error() || status == StatusCode::SERVICE_UNAVAILABLE || status.is_success(),
            "{} → {status}", PATHS[path]);
        if status.is_client_error() {
            prop_assert!(body["error"]["message"].is_string(), "{body}");
        }
        prop_assert_eq!(s.map.read().index.entry_count(), 0);
    }

    #[test]
    fn structured_junk_is_rejected_cleanly(v in json_value(), path in 0usize..PATHS.len()) {
        let s = state();
        let (status, body) = rt().block_on(post(&s, PATHS[path], serde_json::to_vec(&v).unwrap()));
        prop_assert!(!status.is_server_error() || status == StatusCode::SERVICE_UNAVAILABLE, "{} → {status}: {body}", PATHS[path]);
        if status == StatusCode::BAD_REQUEST {
            prop_assert!(body["error"]["param"].is_string() || body["error"]["message"].is_string(), "{body}");
        }
        if !status.is_success() {
            // A rejected push or report leaves no trace.
            prop_assert_eq!(s.map.read().index.entry_count(), 0);
            prop_assert_eq!(s.workers.snapshot().len(), 0);
            prop_assert_eq!(s.replicas.publish(&[], std::time::Instant::now()), 0);
        }
    }
}

#[test]
fn rejected_pushes_leave_state_unchanged() {
    let s = state();
    let rt = rt();
    let good = json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "hashes": ["00000000000000aa"], "seq": 1});
    assert_eq!(rt.block_on(post(&s, "/internal/sync", serde_json::to_vec(&good).unwrap())).0, StatusCode::OK);
    for bad in [
        json!({"worker_id": "w1", "hashes": ["00000000000000aa", "zz"], "seq": 2}),
        json!({"worker_id": "w1", "hashes": [], "block_size": 99, "seq": 3}),
        json!({"worker_id": "w1", "hashes": [], "load": {"kv_usage": 2.0}, "seq": 4}),
    ] {
        let (status, body) = rt.block_on(post(&s, "/internal/sync", serde_json::to_vec(&bad).unwrap()));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(body["error"]["param"].is_string(), "{body}");
        assert_eq!(s.map.read().index.entry_count(), 1);
    }
}

/// The hostile inputs of the hardening review (issue 13), kept as seeds: each
/// is refused cleanly or applied harmlessly, never a panic or a 500.
#[test]
fn the_hardening_reviews_inputs_are_handled() {
    let s = state();
    let rt = rt();
    let send = |path: &str, v: Value| rt.block_on(post(&s, path, serde_json::to_vec(&v).unwrap()));
    // URLs that once registered as healthy workers.
    for url in ["http://", "http://a b c", "ftp://x:1", "javascript:alert(1)", "http://[::1", ""] {
        let (status, body) = send("/internal/sync", json!({"worker_id": "w-url", "url": url, "hashes": []}));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{url:?}: {body}");
    }
    assert!(s.workers.snapshot().is_empty());
    // A legitimate worker, then the freeze attempt: the largest seq.
    let ok = json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "hashes": ["00000000000000aa"],
        "epoch": "0000000000000000aaaa", "seq": 1});
    assert_eq!(send("/internal/sync", ok).0, StatusCode::OK);
    let max = json!({"worker_id": "w1", "epoch": "0000000000000000aaaa", "seq": u64::MAX, "evicted_hashes": []});
    assert_eq!(send("/internal/eviction", max.clone()).0, StatusCode::OK);
    let (status, ack) = send("/internal/eviction", max);
    assert_eq!((status, ack["outcome"].as_str()), (StatusCode::OK, Some("stale")), "a replay of the max seq");
    // A newer epoch (what the real sidecar draws after a stale reply) is applied again.
    let newer =
        json!({"worker_id": "w1", "epoch": "0000000000000001aaaa", "seq": 0, "stored_hashes": ["00000000000000bb"]});
    let (status, ack) = send("/internal/eviction", newer);
    assert_eq!((status, ack["outcome"].as_str()), (StatusCode::OK, Some("applied")), "{ack}");
    // `cleared` for an id nobody registered: nothing to wipe.
    let (status, ack) = send(
        "/internal/eviction",
        json!({"worker_id": "ghost", "epoch": "ffffffffffffffffffff", "seq": 0, "cleared": true}),
    );
    assert_eq!((status, ack["outcome"].as_str()), (StatusCode::OK, Some("unknown_worker")));
    // Ids that are too long or not printable.
    for id in ["x".repeat(10_000), "w\u{0}1".to_string(), "w 1".to_string()] {
        let (status, body) =
            send("/internal/sync", json!({"worker_id": id, "url": "http://127.0.0.1:9", "hashes": []}));
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    }
    // A prompt larger than the body limit, to the API and to /debug/route.
    let huge = json!({"model": "m", "prompt": "a ".repeat(100_000)});
    for path in ["/v1/completions", "/debug/route"] {
        let (status, _) = send(path, huge.clone());
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
    }
    assert_eq!(s.workers.snapshot().len(), 1, "only w1 was ever registered");
}
