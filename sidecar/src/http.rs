//! The sidecar's own HTTP endpoints: `/health` (readiness: 200 once the engine
//! facts are known and events are being followed, 503 before) and `/metrics`.

use std::sync::{Arc, OnceLock};

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use kvroute_shared::WorkerId;
use serde_json::json;

use crate::metrics::Metrics;
use crate::state::WorkerState;

/// What the handlers read.
#[derive(Clone, Debug)]
pub struct AppState {
    pub worker_id: WorkerId,
    pub metrics: Arc<Metrics>,
    /// Set once `run` has discovered the engine and started following it:
    /// each target it reports (one per data-parallel rank behind one URL).
    pub targets: Arc<OnceLock<Vec<Target>>>,
}

/// A routing target this sidecar reports, and its state.
pub type Target = (WorkerId, Arc<WorkerState>);

pub fn app(state: AppState) -> axum::Router {
    axum::Router::new().route("/health", get(health)).route("/metrics", get(metrics)).with_state(state)
}

async fn health(State(s): State<AppState>) -> impl IntoResponse {
    match s.targets.get() {
        Some(targets) => {
            let counts: Vec<(usize, usize)> = targets.iter().map(|(_, w)| w.counts()).collect();
            let body = json!({
                "status": "ok",
                "worker_id": s.worker_id,
                // Not the epoch: /health is unauthenticated, and an epoch lets a
                // token holder forge pushes that look current.
                "tracked_blocks": counts.iter().map(|c| c.0).sum::<usize>(),
                "keys": counts.iter().map(|c| c.1).sum::<usize>(),
                "targets": targets.iter().zip(&counts).map(|((id, _), (blocks, keys))| {
                    json!({"worker_id": id, "tracked_blocks": blocks, "keys": keys})
                }).collect::<Vec<_>>(),
            });
            (StatusCode::OK, Json(body))
        }
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "starting", "worker_id": s.worker_id}))),
    }
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render())
}
