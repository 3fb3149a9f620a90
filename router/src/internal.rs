//! `POST /internal/eviction` and `POST /internal/sync`: what sidecars push
//! (DESIGN.md §2). Authenticated by the internal bearer token (compared in
//! constant time); bad bodies get a 400 naming the field and change nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use kvroute_shared::wire::{AckOutcome, EvictionBatch, InternalAck, SyncSnapshot, Validate, decode_valid};
use subtle::ConstantTimeEq;

use crate::error::RouterError;
use crate::proxy::read_body;
use crate::state::{AppState, now_ms};
use crate::workers::Source;

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), RouterError> {
    let Some(token) = &state.config.raw.internal_token else { return Ok(()) };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(presented.as_bytes().ct_eq(token.expose().as_bytes())) {
        Ok(())
    } else {
        Err(RouterError::Unauthorized)
    }
}

/// Authenticates, reads and decodes an internal push.
async fn push_body<T: serde::de::DeserializeOwned + Validate>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RouterError> {
    authorize(state, headers)?;
    let body = read_body(state, body).await?;
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
    let Some(worker) = state.workers.get(&batch.worker_id) else {
        return Ok(ack(&state, AckOutcome::UnknownWorker));
    };
    {
        let mut map = state.map.write();
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
    let (worker, how) = state
        .workers
        .upsert(&snap.worker_id, snap.url.as_deref(), models, Source::Sidecar)
        .map_err(|e| RouterError::bad_request("url", e.to_string()))?;
    if how == crate::workers::Upsert::Added {
        tracing::info!(worker.id = %worker.id, url = %worker.url, "worker registered by sidecar");
    }
    let as_of = snap.as_of_ms.unwrap_or_else(now_ms);
    let outcome = {
        let mut map = state.map.write();
        let seq = map.seqs.entry(snap.worker_id.clone()).or_default();
        if seq.accept(snap.epoch.as_deref(), snap.seq) {
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
