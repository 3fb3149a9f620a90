//! Workers joining and leaving, end to end through the router's HTTP surface
//! (in-process, so a test can make a worker silent without waiting for the
//! clock): a removed worker leaves nothing behind, not even metric series,
//! and a flood of registrations neither takes a static worker's slot nor
//! keeps a newcomer out once a flooder goes silent; speculative entries
//! nobody confirms expire.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvroute_router::config::{RawConfig, Secret};
use kvroute_router::health::housekeeping;
use kvroute_router::index::MAX_WORKERS;
use kvroute_router::state::AppState;
use kvroute_router::{app, build_state};
use kvroute_shared::WorkerId;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

const TOKEN: &str = "membership-internal-token-0123";

fn state(statics: &[(&str, &str)]) -> Arc<AppState> {
    let raw = RawConfig {
        workers: statics.iter().map(|(id, url)| format!("{id}={url}")).collect(),
        internal_token: Some(Secret::new(TOKEN)),
        ..Default::default()
    };
    build_state(raw.validate().unwrap(), CancellationToken::new()).unwrap()
}

/// A vLLM stand-in on an ephemeral port that answers every completion.
async fn fake_worker() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/v1/completions", axum::routing::post(|| async { axum::Json(json!({"choices": [{"text": "hi"}]})) }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

async fn call(state: &Arc<AppState>, req: Request<Body>) -> (StatusCode, String) {
    let resp = app(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

async fn post(state: &Arc<AppState>, path: &str, body: Value) -> (StatusCode, String) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::from(body.to_string()))
        .unwrap();
    call(state, req).await
}

async fn get(state: &Arc<AppState>, path: &str) -> String {
    let (status, body) = call(state, Request::get(path).body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{path}: {body}");
    body
}

async fn register(state: &Arc<AppState>, id: &str, url: &str) -> StatusCode {
    let sync = json!({"worker_id": id, "url": url, "models": ["m"], "hashes": ["00000000000000aa"], "seq": 1});
    post(state, "/internal/sync", sync).await.0
}

/// As if its sidecar had said nothing for a minute.
fn silence(state: &AppState, id: &str) {
    let w = state.workers.get(&WorkerId::new(id)).unwrap();
    w.live.last_report_ms.fetch_sub(60_000, Ordering::Relaxed);
}

#[tokio::test]
async fn an_expired_worker_leaves_no_index_entries_and_no_metric_series() {
    let upstream = fake_worker().await;
    let state = state(&[]);
    assert_eq!(register(&state, "gone", &upstream).await, StatusCode::OK);
    let (status, body) = post(&state, "/v1/completions", json!({"model": "m", "prompt": "hello"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let metrics = get(&state, "/metrics").await;
    assert!(metrics.contains(r#"kvroute_requests_total{worker="gone",outcome="ok"} 1"#), "{metrics}");

    silence(&state, "gone");
    housekeeping(&state);
    let metrics = get(&state, "/metrics").await;
    let left: Vec<&str> = metrics.lines().filter(|l| l.contains(r#"worker="gone""#)).collect();
    assert!(left.is_empty(), "series of a removed worker: {left:#?}");
    assert!(!get(&state, "/admin/workers").await.contains("gone"));
    assert_eq!(state.map.read().index.entry_count(), 0);
}

#[tokio::test]
async fn a_registration_flood_keeps_static_workers_and_frees_silent_slots_for_newcomers() {
    let upstream = fake_worker().await;
    let state = state(&[("static", &upstream)]);
    for i in 0..MAX_WORKERS - 1 {
        assert_eq!(register(&state, &format!("fake{i}"), "http://10.255.0.1:1").await, StatusCode::OK);
    }
    assert_eq!(register(&state, "real", &upstream).await, StatusCode::SERVICE_UNAVAILABLE, "every slot is taken");
    // The static worker kept its slot and takes the traffic (it is the one
    // that answers; the flooders' address does not).
    let (status, body) = post(&state, "/v1/completions", json!({"model": "other", "prompt": "hello"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // One flooder goes quiet: a newcomer gets its slot now, not after worker_expiry.
    silence(&state, "fake7");
    assert_eq!(register(&state, "real", &upstream).await, StatusCode::OK);
    assert!(state.workers.get(&WorkerId::new("fake7")).is_none());
    let index: Value = serde_json::from_str(&get(&state, "/debug/index?worker=real").await).unwrap();
    assert_eq!(index["confirmed"], json!(["00000000000000aa"]), "{index}");
}

/// The housekeeping pass expires the speculative entries nobody confirmed
/// within `speculative_ttl` (a prefill that failed, events lost), and
/// counts them: left, they pulled a prompt's next requests to a worker
/// that never cached it until the next full sync, minutes later.
#[tokio::test]
async fn housekeeping_expires_unconfirmed_speculative_entries() {
    let upstream = fake_worker().await;
    let raw = RawConfig {
        internal_token: Some(Secret::new(TOKEN)),
        speculative_ttl: std::time::Duration::from_millis(1),
        ..Default::default()
    };
    let state = build_state(raw.validate().unwrap(), CancellationToken::new()).unwrap();
    assert_eq!(register(&state, "w", &upstream).await, StatusCode::OK);
    let prompt = "a prompt of several blocks, none of them held anywhere. ".repeat(4);
    let (status, body) = post(&state, "/v1/completions", json!({"model": "m", "prompt": prompt})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let slot = state.workers.get(&WorkerId::new("w")).unwrap().slot;
    let sent = state.map.read().index.counts(slot).speculative;
    assert!(sent >= 10, "{sent} speculative entries");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while state.map.read().index.counts(slot).speculative > 0 {
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        housekeeping(&state);
    }
    assert_eq!(state.map.read().index.counts(slot).confirmed, 1, "the sidecar's key stays");
    let metrics = get(&state, "/metrics").await;
    assert!(metrics.contains(&format!("kvroute_speculative_expired_total {sent}")), "{metrics}");
}
