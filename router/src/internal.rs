//! `POST /internal/eviction` and `POST /internal/sync`: what sidecars push
//! (DESIGN.md §2). Authenticated by a bearer token compared in constant time:
//! the worker's own token when `worker_tokens_file` is set (a sidecar then
//! speaks only for its own id), else the shared internal token. Bad bodies get
//! a 400 naming the field and change nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use kvroute_shared::wire::{AckOutcome, EvictionBatch, InternalAck, SyncSnapshot, Validate, decode_valid};
use subtle::ConstantTimeEq;

use kvroute_shared::WorkerId;

use crate::config::Secret;
use crate::error::RouterError;
use crate::proxy::read_body_within;
use crate::state::{AppState, now_ms};
use crate::workers::Source;

fn presented(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

fn matches(presented: &str, token: &Secret) -> bool {
    bool::from(presented.as_bytes().ct_eq(token.expose().as_bytes()))
}

/// Before the body is read: the caller holds some valid token (the shared
/// one, or any worker's), so strangers cannot make the router read bodies.
fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<(), RouterError> {
    let p = presented(headers);
    let tokens = &state.config.worker_tokens;
    match &state.config.raw.internal_token {
        _ if !tokens.is_empty() => {
            tokens.values().any(|t| matches(p, t)).then_some(()).ok_or(RouterError::Unauthorized)
        }
        Some(shared) => matches(p, shared).then_some(()).ok_or(RouterError::Unauthorized),
        None => Ok(()),
    }
}

/// After decoding: with per-worker tokens, the token must be `worker`'s own.
fn authorize_for(state: &AppState, headers: &HeaderMap, worker: &WorkerId) -> Result<(), RouterError> {
    let tokens = &state.config.worker_tokens;
    if tokens.is_empty() {
        return Ok(());
    }
    match tokens.get(worker) {
        Some(t) if matches(presented(headers), t) => Ok(()),
        _ => {
            state.metrics.event("forbidden_push", 1);
            tracing::warn!(worker.id = %worker, "push refused: the token is not this worker's");
            Err(RouterError::Forbidden(format!("this token may not push for worker {worker}")))
        }
    }
}

/// Authenticates, reads (under the internal body limit) and decodes an internal push.
async fn push_body<T: serde::de::DeserializeOwned + Validate>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RouterError> {
    authenticate(state, headers)?;
    let body = read_body_within(body, state.config.raw.max_internal_body_bytes).await?;
    Ok(decode_valid(&body)?)
}

fn ack(state: &AppState, outcome: AckOutcome) -> Json<InternalAck> {
    Json(InternalAck { router_epoch: state.router_epoch.clone(), outcome })
}

pub async fn eviction(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<InternalAck>, RouterError> {
    let batch: EvictionBatch = push_body(&state, &headers, body).await?;
    authorize_for(&state, &headers, &batch.worker_id)?;
    let Some(worker) = state.workers.get(&batch.worker_id) else {
        return Ok(ack(&state, AckOutcome::UnknownWorker));
    };
    let max = state.config.raw.max_sync_keys;
    if batch.stored_hashes.len() + batch.evicted_hashes.len() > max {
        state.metrics.event("rejected_too_large", 1);
        return Err(RouterError::PayloadTooLarge { limit: max });
    }
    {
        let mut map = state.map.write();
        // A worker holds at most max_sync_keys entries, however they arrive.
        let held = map.index.counts(worker.slot);
        if held.confirmed + held.speculative + batch.stored_hashes.len() > max + batch.evicted_hashes.len() {
            drop(map);
            state.metrics.event("rejected_too_large", 1);
            return Err(RouterError::PayloadTooLarge { limit: max });
        }
        let seq = map.seqs.entry(batch.worker_id.clone()).or_default();
        if !seq.accept(batch.epoch.as_deref(), batch.seq) {
            drop(map);
            state.metrics.event("stale_batch", 1);
            return Ok(ack(&state, AckOutcome::Stale));
        }
        map.index.apply_events(worker.slot, batch.cleared, &batch.evicted_hashes, &batch.stored_hashes);
    }
    let m = &state.metrics;
    m.event("cleared", usize::from(batch.cleared));
    m.event("evicted", batch.evicted_hashes.len());
    m.event("stored", batch.stored_hashes.len());
    if let Some(load) = &batch.load {
        worker.live.set_reported(load);
    }
    worker.live.last_report_ms.store(now_ms(), Ordering::Relaxed);
    Ok(ack(&state, AckOutcome::Applied))
}

pub async fn sync(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<InternalAck>, RouterError> {
    let snap: SyncSnapshot = push_body(&state, &headers, body).await?;
    authorize_for(&state, &headers, &snap.worker_id)?;
    let want = state.config.block_size;
    if let Some(bs) = snap.block_size
        && bs != want
    {
        state.metrics.sync("rejected_block_size");
        tracing::error!(worker.id = %snap.worker_id, theirs = %bs, ours = %want, "block size mismatch: refusing worker");
        return Err(RouterError::bad_request(
            "block_size",
            format!(
                "worker {} uses block size {bs} but this router keys blocks of {want}: set --block-size to the engine's",
                snap.worker_id
            ),
        ));
    }
    if snap.hashes.len() > state.config.raw.max_sync_keys {
        state.metrics.sync("rejected_too_large");
        return Err(RouterError::PayloadTooLarge { limit: state.config.raw.max_sync_keys });
    }
    let models = (!snap.models.is_empty()).then_some(snap.models.as_slice());
    let (worker, how) =
        state.workers.upsert(&snap.worker_id, snap.url.as_deref(), models, Source::Sidecar).map_err(|e| match e {
            crate::workers::RegistryError::Full => RouterError::Unavailable(e.to_string()),
            e => RouterError::bad_request("url", e.to_string()),
        })?;
    if how == crate::workers::Upsert::Added {
        tracing::info!(worker.id = %worker.id, url = %worker.url, "worker registered by sidecar");
    }
    let as_of = snap.as_of_ms.unwrap_or_else(now_ms);
    let outcome = {
        let mut map = state.map.write();
        let seq = map.seqs.entry(snap.worker_id.clone()).or_default();
        if seq.accept_as(snap.epoch.as_deref(), snap.seq, true) {
            // A sidecar reports for this worker: its index is exact from now on.
            map.index.set_approximate(worker.slot, None);
            Some(map.index.sync(worker.slot, &snap.hashes, as_of))
        } else {
            None
        }
    };
    let Some(outcome) = outcome else {
        state.metrics.sync("stale");
        return Ok(ack(&state, AckOutcome::Stale));
    };
    state.metrics.sync("applied");
    tracing::debug!(worker.id = %worker.id, added = outcome.added, removed = outcome.removed, kept = outcome.kept_speculative, "sync applied");
    worker.live.has_sidecar.store(true, Ordering::Relaxed);
    if let Some(load) = &snap.load {
        worker.live.set_reported(load);
    }
    let now = now_ms();
    worker.live.last_report_ms.store(now, Ordering::Relaxed);
    worker.live.last_sync_ms.store(now, Ordering::Relaxed);
    Ok(ack(&state, AckOutcome::Applied))
}
