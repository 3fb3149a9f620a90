//! A lossy proxy between sidecars and a router: it forwards everything, except
//! that a fraction of fast-path pushes (`/internal/eviction`) are acknowledged
//! as applied and thrown away — pushes lost without anyone noticing, which only
//! the periodic sync can repair.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::net::TcpListener;

#[derive(Debug)]
struct Lossy {
    target: String,
    drop_fraction: f64,
    client: reqwest::Client,
    dropped: AtomicU64,
    /// Requests seen, by path kind: [eviction, sync, other].
    seen: [AtomicU64; 3],
    /// The router's epoch as last seen, for the forged acknowledgements.
    epoch: parking_epoch::Epoch,
}

mod parking_epoch {
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    pub struct Epoch(Mutex<String>);

    impl Epoch {
        pub fn get(&self) -> String {
            self.0.lock().map(|e| e.clone()).unwrap_or_default()
        }
        pub fn set(&self, e: &str) {
            if let Ok(mut g) = self.0.lock() {
                *g = e.to_owned();
            }
        }
    }
}

/// A running proxy.
#[derive(Debug, Clone)]
pub struct LossyProxy {
    pub url: String,
    state: Arc<Lossy>,
}

impl LossyProxy {
    pub async fn start(target: &str, drop_fraction: f64) -> LossyProxy {
        let state = Arc::new(Lossy {
            target: target.trim_end_matches('/').to_owned(),
            drop_fraction,
            client: reqwest::Client::new(),
            dropped: AtomicU64::new(0),
            seen: Default::default(),
            epoch: Default::default(),
        });
        let app = Router::new().fallback(forward).with_state(state.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        LossyProxy { url, state }
    }

    /// Requests seen so far: (evictions, syncs, other).
    pub fn seen(&self) -> (u64, u64, u64) {
        let s = &self.state.seen;
        (s[0].load(Ordering::Relaxed), s[1].load(Ordering::Relaxed), s[2].load(Ordering::Relaxed))
    }

    /// Fast-path pushes that changed something, thrown away so far.
    pub fn dropped(&self) -> u64 {
        self.state.dropped.load(Ordering::Relaxed)
    }
}

async fn forward(State(s): State<Arc<Lossy>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 64 << 20).await else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let kind = match path.as_str() {
        "/internal/eviction" => 0,
        "/internal/sync" => 1,
        _ => 2,
    };
    s.seen[kind].fetch_add(1, Ordering::Relaxed);
    let epoch = s.epoch.get();
    // Only pushes that change something are lost: a heartbeat's loss needs
    // no healing, and a test that saw only those proved nothing.
    let changes = || {
        serde_json::from_slice::<Value>(&bytes).is_ok_and(|v| {
            let some = |k: &str| v[k].as_array().is_some_and(|a| !a.is_empty());
            some("stored_hashes") || some("evicted_hashes") || v["cleared"] == true
        })
    };
    if path == "/internal/eviction" && !epoch.is_empty() && rand::random::<f64>() < s.drop_fraction && changes() {
        s.dropped.fetch_add(1, Ordering::Relaxed);
        return axum::Json(json!({"router_epoch": epoch, "outcome": "applied"})).into_response();
    }
    let mut rb = s.client.request(parts.method.clone(), format!("{}{path}", s.target)).body(bytes);
    for name in ["authorization", "content-type"] {
        if let Some(v) = parts.headers.get(name) {
            rb = rb.header(name, v);
        }
    }
    match rb.send().await {
        Ok(resp) => {
            let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let body: Bytes = resp.bytes().await.unwrap_or_default();
            if let Ok(v) = serde_json::from_slice::<Value>(&body)
                && let Some(e) = v["router_epoch"].as_str()
            {
                s.epoch.set(e);
            }
            Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
        }
        Err(_) => StatusCode::BAD_GATEWAY.into_response(),
    }
}
