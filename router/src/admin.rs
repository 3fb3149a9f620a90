//! Operator endpoints: liveness and readiness, Prometheus metrics, the model
//! list, and the debug views that explain the router's decisions.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvroute_shared::openai::Endpoint;
use serde_json::{Value, json};

use crate::error::RouterError;
use crate::index::{self, Kind};
use crate::proxy::admit;
use crate::routing;
use crate::state::{AppState, now_ms};

/// The endpoint a bare body belongs to: chat if it has `messages`.
///
/// Only the top-level keys are looked at; every value is skipped without
/// being built (a `serde_json::Value` of a 16 MB body of small numbers took
/// ~40 × its size, before any concurrency slot was taken).
pub fn endpoint_of(body: &[u8]) -> Endpoint {
    use serde::Deserialize;
    use serde::de::IgnoredAny;
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default, deserialize_with = "present")]
        messages: Option<IgnoredAny>,
    }
    // Present, whatever its value (`null` too).
    fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<IgnoredAny>, D::Error> {
        IgnoredAny::deserialize(d).map(Some)
    }
    match serde_json::from_slice::<Probe>(body) {
        Ok(Probe { messages: Some(_) }) => Endpoint::ChatCompletions,
        _ => Endpoint::Completions,
    }
}

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Ready once some worker takes traffic and has answered a health probe, and
/// until a stop is asked for (`drain_delay`). A
/// worker is taken as healthy from its admission (its requests go at once),
/// so counting those alone answered yes while every worker was unreachable,
/// until enough probes had failed to eject them: seconds of 502s behind a
/// load balancer that believed it.
pub async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let workers = state.workers.snapshot();
    let healthy = workers.iter().filter(|w| w.live.is_healthy()).count();
    let answered =
        workers.iter().filter(|w| w.live.is_healthy() && w.live.last_probe_ok_ms.load(Ordering::Relaxed) > 0).count();
    let draining = state.draining.load(Ordering::Relaxed);
    let ready = answered > 0 && !draining;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = json!({"ready": ready, "draining": draining, "healthy_workers": healthy, "probed_workers": answered});
    (status, Json(body)).into_response()
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    crate::health::housekeeping_gauges(&state, false);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
        .into_response()
}

/// OpenAI's model list: the union of healthy workers' models.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let mut names: Vec<String> = state
        .workers
        .snapshot()
        .iter()
        .filter(|w| w.live.is_healthy())
        .flat_map(|w| w.models.iter().map(|m| m.to_string()).collect::<Vec<_>>())
        .collect();
    names.sort();
    names.dedup();
    let data: Vec<Value> =
        names.iter().map(|m| json!({"id": m, "object": "model", "owned_by": "kvroute", "created": 0})).collect();
    Json(json!({"object": "list", "data": data}))
}

/// `POST /debug/route`: the decision the router would make, without
/// forwarding, and without changing routing state (no speculative entry, no
/// session touched, no decision or request counted; its tokenizing time and
/// a shed are counted, as the router's own load). An `x-session-id` header
/// is read as a request's: a pinned session's worker is the decision. The
/// body is a completion's or a chat's as its `messages` key says, or as
/// `?endpoint=completions` or `?endpoint=chat` says (a completion's body
/// may carry a `messages` key the engine ignores).
pub async fn debug_route(
    State(state): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, RouterError> {
    let endpoint = match query.as_deref().and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("endpoint="))) {
        None => None,
        Some("completions") => Some(Endpoint::Completions),
        Some("chat") => Some(Endpoint::ChatCompletions),
        Some(_) => return Err(RouterError::bad_request("endpoint", "must be completions or chat")),
    };
    let session = crate::proxy::session_of(&state, &headers)?;
    // Same limits as a real request: body deadline, concurrency slot, prompt
    // size, tokenizing off the runtime.
    let crate::proxy::Admitted { body, endpoint, budget: _budget, slot: _permit } =
        admit(&state, body, endpoint).await?;
    let (_, prepared) = routing::parse_and_prepare(&state, endpoint, &body).await?;
    let template_fallback = prepared.template_fallback;
    let pinned = session.and_then(|(id, _)| state.sessions.peek(&id, Instant::now()));
    let plan = routing::plan(&state, prepared, pinned.as_ref(), false)?;
    let name = |i: usize| plan.workers[i].id.to_string();
    let workers: Vec<Value> = plan
        .candidates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "id": name(i),
                "matched_blocks": c.matched_blocks,
                "matched_kind": c.matched_kind,
                "matched_tokens": c.matched_blocks * plan.block_size,
                "uncached_tokens": plan.uncached_tokens(c),
                "load": c.load,
                "cost": plan.decision.costs.get(i).copied().flatten(),
            })
        })
        .collect();
    Ok(Json(json!({
        "model": plan.model,
        "policy": state.policy.name(),
        "tokens": plan.tokens.len(),
        // A truncated prompt too long to tokenize here, counted as what the
        // engine keeps of it.
        "unkeyed_tokens": plan.unkeyed_tokens,
        "exact_tokenizer": plan.exact_tokenizer,
        "block_size": plan.block_size,
        "block_keys": plan.keys,
        // Asks for its prompt's logprobs: the engine reads nothing cached.
        "skips_prefix_cache": plan.skips_prefix_cache,
        "sole_router": plan.sole_router,
        "pinned_session_worker": pinned,
        "chat_template_fallback": template_fallback,
        "routers_counted": plan.routers_counted,
        "decision": {
            "worker": plan.decision.chosen().map(name),
            "reason": plan.decision.reason,
            "fallbacks": plan.decision.ranked.iter().skip(1).map(|&i| name(i)).collect::<Vec<_>>(),
        },
        "workers": workers,
    })))
}

#[derive(Debug, serde::Deserialize)]
pub struct IndexQuery {
    worker: Option<String>,
}

/// `GET /debug/index`: per-worker entry counts by kind; with `?worker=ID`,
/// that worker's keys by kind (sorted).
pub async fn debug_index(
    State(state): State<Arc<AppState>>,
    q: Result<Query<IndexQuery>, QueryRejection>,
) -> Result<Response, RouterError> {
    // axum's own rejection is plain text: every error here is OpenAI-shaped.
    let Query(q) = q.map_err(|e| RouterError::bad_request("worker", e.body_text()))?;
    let workers = state.workers.snapshot();
    if let Some(id) = q.worker {
        let w = workers
            .iter()
            .find(|w| w.id.as_str() == id)
            .ok_or_else(|| RouterError::NotFound(format!("no worker {id:?}")))?
            .clone();
        // Up to max_sync_keys keys: copied under the lock, sorted and encoded
        // after it is released (a read lock held that long makes routing
        // wait behind the writers queued meanwhile), all of it off the async
        // runtime and at most one per core, as tokenizing is.
        let st = state.clone();
        return routing::on_tokenizer_pool(&state, move || {
            let unsorted = st.map.read().index.unsorted_keys_of(w.slot);
            let keys = index::sorted_keys(unsorted);
            let of = |kind: Kind| keys.iter().filter(|(_, k)| *k == kind).map(|(key, _)| *key).collect::<Vec<_>>();
            let body = json!({
                "worker": id,
                "confirmed": of(Kind::Confirmed),
                "speculative": of(Kind::Speculative),
                "approximate": of(Kind::Approximate),
            });
            Ok(([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response())
        })
        .await;
    }
    let map = state.map.read();
    let per: serde_json::Map<String, Value> = workers
        .iter()
        .map(|w| {
            let c = map.index.counts(w.slot);
            (w.id.to_string(), json!({"confirmed": c.confirmed, "speculative": c.speculative, "approximate": c.approximate, "approximate_index": map.index.is_approximate(w.slot)}))
        })
        .collect();
    Ok(Json(json!({"keys": map.index.key_count(), "entries": map.index.entry_count(), "workers": per})).into_response())
}

/// `GET /admin/workers`: every worker with health, load, index size, last sync.
pub async fn workers(State(state): State<Arc<AppState>>) -> Json<Value> {
    let now = now_ms();
    let map = state.map.read();
    let list: Vec<Value> = state
        .workers
        .snapshot()
        .iter()
        .map(|w| {
            let last_sync = w.live.last_sync_ms.load(Ordering::Relaxed);
            json!({
                "id": w.id,
                "url": w.url,
                "dp_rank": w.dp_rank,
                "models": w.models,
                "model_aliases": w.aliases,
                "source": w.source,
                "healthy": w.live.is_healthy(),
                // Ejected for failed requests: not re-admitted for this long
                // while its /health answers.
                "held_out_ms": (!w.live.is_healthy())
                    .then(|| w.live.held_until_ms.load(Ordering::Relaxed).saturating_sub(now))
                    .filter(|&ms| ms > 0),
                "sidecar": w.live.has_sidecar.load(Ordering::Relaxed),
                // Exact: a sidecar reports the engine's cache. Approximate:
                // the router's own routing decisions stand in for it.
                "index_mode": if w.live.has_sidecar.load(Ordering::Relaxed) { "exact" } else { "approximate" },
                "load": w.live.load(now_ms(), map.index.held(w.slot)),
                "index": map.index.counts(w.slot),
                "last_sync_ms_ago": (last_sync > 0).then(|| now.saturating_sub(last_sync)),
            })
        })
        .collect();
    Json(json!({"router_epoch": state.router_epoch, "policy": state.policy.name(), "workers": list}))
}

/// `/debug/*` and `/admin/*` behind `admin_token`, when one is configured.
pub async fn require_admin_token(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Result<axum::response::Response, RouterError> {
    if let Some(token) = &state.config.raw.admin_token {
        let presented = req
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !bool::from(subtle::ConstantTimeEq::ct_eq(presented.as_bytes(), token.expose().as_bytes())) {
            return Err(RouterError::Unauthorized);
        }
    }
    Ok(next.run(req).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_chat_when_it_has_top_level_messages() {
        let chat = br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
        assert_eq!(endpoint_of(chat), Endpoint::ChatCompletions);
        assert_eq!(endpoint_of(br#"{"messages": null}"#), Endpoint::ChatCompletions);
        assert_eq!(endpoint_of(br#"{"model": "m", "prompt": [1, 2, 3]}"#), Endpoint::Completions);
        // Only a top-level key counts; anything unparsable is a completion.
        assert_eq!(endpoint_of(br#"{"prompt": "x", "extra": {"messages": []}}"#), Endpoint::Completions);
        assert_eq!(endpoint_of(b"[1, 2"), Endpoint::Completions);
    }
}
