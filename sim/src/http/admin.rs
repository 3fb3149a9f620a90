//! Small endpoints: `/health`, `/version`, `/v1/models`, `/reset_prefix_cache`,
//! and the simulator's own `/sim/info` (bound addresses, for discovery) and
//! `/sim/faults` (fault knobs at runtime).

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;

use super::{ApiError, AppState};
use crate::events::EventFormat;
use crate::faults::FaultsPatch;

pub async fn health() -> StatusCode {
    StatusCode::OK
}

/// The vLLM version whose event format is being spoken, so a client that
/// picks a decoder by version picks the right one.
pub async fn version(State(s): State<AppState>) -> Json<serde_json::Value> {
    let v = match s.config.events.as_ref().map(|e| e.format) {
        Some(EventFormat::Legacy) => "0.11.0",
        _ => "0.33.0",
    };
    Json(json!({"version": v, "simulator": concat!("kvroute-sim ", env!("CARGO_PKG_VERSION"))}))
}

pub async fn models(State(s): State<AppState>) -> Json<serde_json::Value> {
    let base = s.config.model.as_str();
    let card = |id: &str, root: &str, parent: Option<&str>| {
        json!({
            "id": id, "object": "model", "created": s.started, "owned_by": "vllm",
            "root": root, "parent": parent, "max_model_len": s.config.max_model_len,
            "permission": [],
        })
    };
    let mut data = vec![card(base, base, None)];
    data.extend(s.config.loras.iter().map(|l| card(l.as_str(), l.as_str(), Some(base))));
    Json(json!({"object": "list", "data": data}))
}

/// vLLM's answer: 200 with `{"success": false}` while running requests hold
/// blocks (nothing is reset then), `{"success": true}` otherwise.
pub async fn reset_prefix_cache(State(s): State<AppState>) -> Response {
    // Every rank, as vLLM resets every engine core; success only if all did.
    let mut all = true;
    for r in &s.ranks {
        match r.engine.reset_prefix_cache().await {
            Ok(success) => all &= success,
            Err(_) => return ApiError::EngineGone.into_response(),
        }
    }
    Json(json!({"success": all})).into_response()
}

/// `GET /sim/cache`: the kvroute router keys of every cached block — what a
/// router's map for this worker must equal once the sidecar caught up.
/// `?rank=R`: that data-parallel rank's alone (default: the first served).
pub async fn cache(State(s): State<AppState>, Query(q): Query<RankQuery>) -> Response {
    let Some(rank) = (match q.rank {
        Some(r) => s.ranks.iter().find(|e| e.rank == r),
        None => s.ranks.first(),
    }) else {
        return ApiError::bad(format!("rank {:?} is not served here", q.rank)).into_response();
    };
    match rank.engine.router_keys().await {
        Ok(mut keys) => {
            keys.sort();
            Json(serde_json::json!({"count": keys.len(), "block_keys": keys})).into_response()
        }
        Err(_) => ApiError::EngineGone.into_response(),
    }
}

#[derive(Debug, serde::Deserialize)]
pub struct RankQuery {
    rank: Option<u32>,
}

pub async fn info(State(s): State<AppState>) -> Json<super::SimInfo> {
    Json(s.info.clone())
}

pub async fn get_faults(State(s): State<AppState>) -> Json<crate::faults::Faults> {
    Json(*s.faults.borrow())
}

/// Merges a partial `{"drop_events", "pause_events", "reject", "reject_status",
/// "slowdown"}` into the current faults and answers with the result.
pub async fn set_faults(State(s): State<AppState>, body: Bytes) -> Response {
    let patch: FaultsPatch = match kvroute_shared::wire::decode(&body) {
        Ok(p) => p,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let current = *s.faults.borrow();
    match current.patched(patch) {
        Ok(next) => {
            s.faults.send_replace(next);
            tracing::info!(faults = ?next, "faults changed");
            Json(next).into_response()
        }
        Err(e) => ApiError::BadRequest { message: e.to_string(), param: Some(e.field().to_owned()) }.into_response(),
    }
}
