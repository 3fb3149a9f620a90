//! `POST /internal/eviction` and `POST /internal/sync`: what sidecars push
//! (DESIGN.md §2). Authenticated by a bearer token compared in constant time:
//! the worker's own token when `worker_tokens_file` is set (a sidecar then
//! speaks only for its own id), else the shared internal token. Bad bodies get
//! a 400 naming the field and change nothing.
//!
//! A push is applied under the index lock together with the check that its
//! worker is still registered (`state::MapState`), so membership changes and
//! pushes never interleave.
//!
//! Protocol v2 (DESIGN.md §2): a push carries the digest of its worker's
//! whole key set; the router compares it with its digest of that worker's
//! confirmed entries and, when they differ, answers `resync: true`. A full
//! sync is applied in chunks ([`crate::index::SyncPlan`]): the diff is
//! computed under the read lock in slices, and the write lock is taken for
//! at most [`SYNC_WRITE_CHUNK`] keys at a time. Both versions are accepted:
//! a v1 push simply has no digest.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use kvroute_shared::wire::{
    AckOutcome, EvictionBatch, InternalAck, OLDEST_PROTOCOL, PROTOCOL_HEADER, PROTOCOL_VERSION, SyncSnapshot, Validate,
    decode_valid,
};
use subtle::ConstantTimeEq;

use kvroute_shared::{BlockKey, WorkerId};

use crate::config::Secret;
use crate::error::RouterError;
use crate::index::{Covers, DeltaCursor, Slot, SyncOutcome, SyncPlan};
use crate::proxy::read_in_time;
use crate::state::{AppState, MapState, Registered, now_ms};
use crate::workers::{RegistryError, Served, Source, Target, Upsert, Worker};

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
    let ok = match &state.config.raw.internal_token {
        _ if !tokens.is_empty() => tokens.values().any(|t| matches(p, t)),
        Some(shared) => matches(p, shared),
        None => true,
    };
    if ok {
        return Ok(());
    }
    let fix = "its bearer token is not this router's internal_token (nor, with worker_tokens_file, any worker's): \
               give the sidecar the router's token";
    Err(refused_token(state, &LAST_REFUSED_PUSH_MS, "unauthorized_push", "a sidecar's push", fix))
}

/// When a refused push, and a refused report, were last logged (ms).
static LAST_REFUSED_PUSH_MS: AtomicU64 = AtomicU64::new(0);
static LAST_REFUSED_REPORT_MS: AtomicU64 = AtomicU64::new(0);

/// A push or report with no valid token: counted, and logged at most every
/// 10 s per kind (a sidecar with the wrong token retries every 30 s; the
/// router said nothing, and an operator reading it saw no worker register
/// and no reason).
fn refused_token(state: &AppState, last_log: &AtomicU64, kind: &'static str, what: &str, fix: &str) -> RouterError {
    state.metrics.event(kind, 1);
    let now = now_ms();
    let last = last_log.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= 10_000
        && last_log.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    {
        tracing::warn!("{what} refused: {fix}");
    }
    RouterError::Unauthorized
}

/// Another replica's report (`crate::replicas`): only the shared internal
/// token speaks for a router, never a worker's own token. With per-worker
/// tokens and no shared one, no router can be authenticated (config
/// validation refuses `replicas` then); with neither, the endpoint is open
/// as the sidecars' are (loopback, or `allow_insecure_internal`).
pub fn authenticate_replica(state: &AppState, headers: &HeaderMap) -> Result<(), RouterError> {
    let ok = match &state.config.raw.internal_token {
        Some(shared) => matches(presented(headers), shared),
        None => state.config.worker_tokens.is_empty(),
    };
    if ok {
        return Ok(());
    }
    let fix = "its bearer token is not this router's internal_token (replicas speak with the shared token only): \
               set the same internal_token on every replica";
    Err(refused_token(state, &LAST_REFUSED_REPORT_MS, "unauthorized_report", "a replica's report", fix))
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

/// Keys of a full sync's diff applied per write-lock hold: ~0.2 µs each,
/// so a hold stays well under a millisecond (BENCHMARKS.md, `kvroute-bench
/// antientropy`).
pub const SYNC_WRITE_CHUNK: usize = 2048;
/// Keys compared per read-lock hold while a sync's diff is computed.
pub const SYNC_READ_CHUNK: usize = 16_384;

/// Authenticates, reads (under the internal body limit) and decodes an
/// internal push; also returns the protocol major it was sent under.
async fn push_body<T: serde::de::DeserializeOwned + Validate + Send + 'static>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(T, u32), RouterError> {
    authenticate(state, headers)?;
    let protocol = check_protocol(state, headers)?;
    let body = read_in_time(state, body, state.config.raw.max_internal_body_bytes).await?;
    // A sync of a million keys is ~19 MB of JSON, a few hundred ms to
    // decode: on the blocking pool, as its apply is, not on an async worker
    // that every request shares.
    if body.len() <= DECODE_INLINE_MAX_BYTES {
        return Ok((decode_valid(&body)?, protocol));
    }
    let decoded = tokio::task::spawn_blocking(move || decode_valid(&body))
        .await
        .map_err(|_| RouterError::Unavailable("the push could not be decoded".into()))?;
    Ok((decoded?, protocol))
}

/// Deltas up to this many keys are applied on the async worker.
const APPLY_INLINE_MAX_KEYS: usize = 16 << 10;

/// Push bodies up to this size are decoded on the async worker (a routine
/// 100 ms delta: a few hundred keys).
const DECODE_INLINE_MAX_BYTES: usize = 64 << 10;

/// What an applied push tells its sidecar besides the outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Acked {
    /// The digests differ: send a full sync now.
    resync: bool,
    /// The index's causal clock after applying.
    clock: Option<u64>,
}

/// A push that changed nothing (`stale`, `unknown_worker`): its ack still
/// carries the index's clock, which the sidecar's next sync (the usual
/// answer to these) names as what it covers. Without it the sync covered
/// nothing, and speculative entries it accounts for lingered until
/// `speculative_ttl`.
fn refused(state: &AppState, outcome: AckOutcome) -> Json<InternalAck> {
    let clock = state.map.read().index.clock();
    ack(state, outcome, Acked { resync: false, clock: Some(clock) })
}

fn ack(state: &AppState, outcome: AckOutcome, acked: Acked) -> Json<InternalAck> {
    Json(InternalAck {
        router_epoch: state.router_epoch.clone(),
        outcome,
        protocol: PROTOCOL_VERSION,
        resync: acked.resync,
        clock: acked.clock,
        model_aliases: true,
    })
}

/// A push names its protocol version in a header (none: version 1). A major
/// this router does not speak is refused before the body is read, with an
/// error both sides log, and counted. This router speaks
/// [`OLDEST_PROTOCOL`]`..=`[`PROTOCOL_VERSION`].
fn check_protocol(state: &AppState, headers: &HeaderMap) -> Result<u32, RouterError> {
    let Some(v) = headers.get(PROTOCOL_HEADER) else { return Ok(1) };
    match v.to_str().ok().and_then(|s| s.trim().parse::<u32>().ok()) {
        Some(n) if (OLDEST_PROTOCOL..=PROTOCOL_VERSION).contains(&n) => Ok(n),
        other => {
            state.metrics.event("rejected_protocol", 1);
            let got = other.map_or_else(|| format!("{v:?}"), |n| n.to_string());
            tracing::warn!(protocol = %got, "push refused: unsupported wire protocol version");
            Err(RouterError::bad_request(
                PROTOCOL_HEADER,
                format!(
                    "wire protocol version {got} is not supported: this router speaks versions \
                     {OLDEST_PROTOCOL} to {PROTOCOL_VERSION} (upgrade the routers before the sidecars)"
                ),
            ))
        }
    }
}

/// How applying a push under the index lock went.
#[derive(Debug, PartialEq, Eq)]
enum Push<T> {
    Applied(T),
    /// Not newer than what was applied (reordered, duplicated or replayed).
    Stale,
    /// The worker it was looked up as is no longer registered, or its index
    /// no longer follows its sidecar's events: a full sync must come first.
    NotMember,
    /// It would make the worker hold more than `max_sync_keys` entries.
    TooLarge,
}

pub async fn eviction(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<InternalAck>, RouterError> {
    let (batch, _): (EvictionBatch, _) = push_body(&state, &headers, body).await?;
    authorize_for(&state, &headers, &batch.worker_id)?;
    // Looked up without the lock, so unknown ids cost no write lock; whether
    // it is still the member is checked again where the batch is applied.
    let Some(worker) = state.workers.get(&batch.worker_id) else {
        return Ok(refused(&state, AckOutcome::UnknownWorker));
    };
    let max = state.config.raw.max_sync_keys;
    if batch.stored_hashes.len() + batch.evicted_hashes.len() > max {
        state.metrics.event("rejected_too_large", 1);
        return Err(RouterError::PayloadTooLarge { limit: max });
    }
    // Every push takes the worker's turn (the sync gate), so no two
    // senders' chunks interleave: a small delta when the turn is free, here;
    // a large one (a sidecar that fell behind: up to max_sync_keys), or one
    // that must wait, on the blocking pool, the turn moved into the job so
    // that a sender giving up (this handler dropped) does not hand it on
    // while the job still runs.
    let changes = batch.stored_hashes.len() + batch.evicted_hashes.len();
    let gate = state.sync_gate(&worker.id);
    let inline = changes <= APPLY_INLINE_MAX_KEYS && !batch.cleared;
    let (pushed, batch) = match inline.then(|| gate.clone().try_lock_owned().ok()).flatten() {
        Some(_turn) => (apply_eviction(&state, &worker, &batch), batch),
        None => {
            let turn = gate.lock_owned().await;
            let (st, w) = (state.clone(), worker.clone());
            tokio::task::spawn_blocking(move || {
                let _turn = turn;
                (apply_eviction(&st, &w, &batch), batch)
            })
            .await
            .map_err(|_| RouterError::Unavailable("the push could not be applied".into()))?
        }
    };
    let acked = match pushed {
        Push::Applied(acked) => acked,
        Push::NotMember => return Ok(refused(&state, AckOutcome::UnknownWorker)),
        Push::Stale => {
            state.metrics.event("stale_batch", 1);
            return Ok(refused(&state, AckOutcome::Stale));
        }
        Push::TooLarge => {
            state.metrics.event("rejected_too_large", 1);
            return Err(RouterError::PayloadTooLarge { limit: max });
        }
    };
    let m = &state.metrics;
    m.event("cleared", usize::from(batch.cleared));
    m.event("evicted", batch.evicted_hashes.len());
    m.event("stored", batch.stored_hashes.len());
    if !batch.stored_hashes.is_empty() {
        // The engine filled blocks: it is prefilling or decoding, whoever's
        // requests they are (a batch of long non-streamed generations shows
        // no other progress to this router until they end).
        let now = now_ms();
        worker.live.last_progress_ms.store(now, Ordering::Relaxed);
        worker.live.last_blocks_ms.store(now, Ordering::Relaxed);
    }
    if acked.resync {
        m.event("digest_mismatch", 1);
        tracing::info!(worker.id = %worker.id, "digest mismatch: asking the sidecar for a full sync");
    }
    if let Some(load) = &batch.load {
        let unaccounted = worker.live.set_reported(load, now_ms());
        state.observe_foreign(&worker.id, unaccounted);
    }
    Ok(ack(&state, AckOutcome::Applied, acked))
}

/// Applies `batch` to `worker`'s slot in one critical section with the check
/// that `worker` is still its member: a batch that was in flight while its
/// worker expired (and its slot perhaps went to another) is refused.
fn apply_eviction(state: &AppState, worker: &Worker, batch: &EvictionBatch) -> Push<Acked> {
    // A worker holds at most max_sync_keys entries, however they arrive.
    // Judged under the read lock, a chunk of keys per hold: past the cheap
    // bound it looks up every key of the batch (up to max_sync_keys), which
    // under one hold stalled routing (it takes the write lock) for as long,
    // and a pusher could repeat it at will. The figures can move meanwhile:
    // the cap is a bound on memory, not an exact count.
    let too_large = over_cap(&state.map, worker.slot, batch, state.config.raw.max_sync_keys);
    let mut map = state.map.write();
    if !map.is_member(&state.workers, worker) {
        return Push::NotMember;
    }
    // Its sidecar went silent and the worker fell back to the approximate
    // index (`health::expire`): a delta continues a stream the router stopped
    // following, so the sidecar is asked for the whole set (it answers an
    // `unknown_worker` ack with a sync at once). Static workers take deltas
    // without a sync, as pushers that only ever send evictions rely on.
    if worker.source == Source::Sidecar && !worker.live.has_sidecar.load(Ordering::Relaxed) {
        return Push::NotMember;
    }
    // Any push from the member's sidecar is a sign of life, applied or not
    // (under the lock, so an expiry deciding under it sees it): liveness
    // never waits for a key set to be accepted.
    worker.live.last_report_ms.store(now_ms(), Ordering::Relaxed);
    if too_large {
        return Push::TooLarge;
    }
    if !map.seq(worker.slot).accept(batch.epoch.as_deref(), batch.seq) {
        return Push::Stale;
    }
    let (slot, evicted, stored) = (worker.slot, &batch.evicted_hashes, &batch.stored_hashes);
    let mut cursor = DeltaCursor::new(batch.cleared);
    // A large delta (up to max_sync_keys, or a `cleared` one over as many
    // held keys) would hold the lock every request's lookup waits on for a
    // tenth of a second or more: it is applied SYNC_WRITE_CHUNK keys per
    // hold, as a sync is, the worker's membership checked at each.
    while map.index.apply_some(slot, &mut cursor, evicted, stored, SYNC_WRITE_CHUNK) {
        drop(map);
        map = state.map.write();
        if !map.is_member(&state.workers, worker) {
            return Push::NotMember;
        }
    }
    let resync = batch.digest.is_some_and(|theirs| theirs != map.index.digest(slot));
    Push::Applied(Acked { resync, clock: Some(map.index.clock()) })
}

/// Whether `batch` would leave `slot` holding more than `max` entries of
/// its sidecar's, besides the router's speculative ones. Only
/// evictions of keys it holds make room (keys made up to evict would let a
/// pusher reach twice the cap), and only stored keys it does not hold take
/// any: confirming its speculative entries, or a repair re-sending held keys,
/// adds none. The keys are looked up only when the worker would be over the
/// cap without them, not on every routine push.
fn over_cap(map: &parking_lot::RwLock<MapState>, slot: Slot, batch: &EvictionBatch, max: usize) -> bool {
    let stored = batch.stored_hashes.len();
    if batch.cleared {
        return stored > max;
    }
    let counts = map.read().index.counts(slot);
    let held = counts.confirmed + counts.speculative;
    // The router's own speculative entries are not the sidecar's (clients
    // make them, and they have their own cap, `Index::MAX_SPECULATIVE`):
    // counted against it, a worker at its engine's size refused every store
    // once requests had been routed there.
    let max = max.saturating_add(counts.speculative);
    if held + stored <= max {
        return false;
    }
    let mut evicted: HashSet<&BlockKey> = HashSet::new();
    for chunk in batch.evicted_hashes.chunks(CAP_CHECK_CHUNK) {
        let map = map.read();
        evicted.extend(chunk.iter().filter(|k| map.index.holds(slot, k)));
    }
    let mut added: HashSet<&BlockKey> = HashSet::new();
    for chunk in batch.stored_hashes.chunks(CAP_CHECK_CHUNK) {
        let map = map.read();
        added.extend(chunk.iter().filter(|k| !map.index.holds(slot, k) || evicted.contains(k)));
    }
    held.saturating_sub(evicted.len()) + added.len() > max
}

/// Keys [`over_cap`] looks up per read-lock hold (about a millisecond).
const CAP_CHECK_CHUNK: usize = 8 * SYNC_WRITE_CHUNK;

pub async fn sync(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<InternalAck>, RouterError> {
    let (snap, protocol): (SyncSnapshot, _) = push_body(&state, &headers, body).await?;
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
    // A sync is a sign of life from the moment it arrives, however long it
    // waits for its turn below (a registration storm after a restart).
    if let Some(w) = state.workers.get(&snap.worker_id) {
        w.live.last_report_ms.store(now_ms(), Ordering::Relaxed);
    }
    // One sync per worker at a time, so two cannot interleave their chunks;
    // the chunks run on the blocking pool, off the async workers.
    // The turn and the slot go with the job, as a large delta's turn does.
    let turn = state.sync_gate(&snap.worker_id).lock_owned().await;
    let slot = state
        .sync_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| RouterError::Unavailable("the router is shutting down".into()))?;
    let st = state.clone();
    let (result, snap) = tokio::task::spawn_blocking(move || {
        let _held = (turn, slot);
        (apply_sync(&st, &snap, protocol), snap)
    })
    .await
    .map_err(|_| RouterError::Unavailable("the sync could not be applied".into()))?;
    let (registered, applied) = result.map_err(|e| match e {
        RegistryError::Full => RouterError::Unavailable(e.to_string()),
        e => RouterError::bad_request("url", e.to_string()),
    })?;
    let worker = &registered.worker;
    if let Some(gone) = &registered.reclaimed {
        tracing::warn!(worker.id = %gone.id, by = %worker.id, "every slot taken: a silent worker's slot reclaimed");
        state.metrics.retire_worker(gone);
    }
    if registered.how == Upsert::Added {
        tracing::info!(worker.id = %worker.id, url = %worker.url, "worker registered by sidecar");
    }
    let (outcome, acked) = match applied {
        Push::Applied(applied) => applied,
        Push::NotMember => {
            state.metrics.sync("not_member");
            return Ok(refused(&state, AckOutcome::UnknownWorker));
        }
        _ => {
            state.metrics.sync("stale");
            return Ok(refused(&state, AckOutcome::Stale));
        }
    };
    state.metrics.sync("applied");
    tracing::debug!(worker.id = %worker.id, added = outcome.added, removed = outcome.removed, kept = outcome.kept_speculative, "sync applied");
    if let Some(load) = &snap.load {
        let unaccounted = worker.live.set_reported(load, now_ms());
        state.observe_foreign(&worker.id, unaccounted);
    }
    Ok(ack(&state, AckOutcome::Applied, acked))
}

/// Registers (or updates) the worker and checks the sync's order in one
/// critical section (an expiry cannot come between them), then applies the
/// key set in chunks, each under the write lock together with the check that
/// the worker is still the slot's member.
fn apply_sync(
    state: &AppState,
    snap: &SyncSnapshot,
    protocol: u32,
) -> Result<(Registered, Push<(SyncOutcome, Acked)>), RegistryError> {
    let now = now_ms();
    let served = (!snap.models.is_empty()).then_some(Served { models: &snap.models, aliases: &snap.model_aliases });
    let (registered, covers) = {
        let mut map = state.map.write();
        // A stale or replayed sync changes nothing, not even the worker's
        // address or models: a retried old sync would point the worker at
        // an address or adapters it has left, its keys (and so the digests)
        // untouched, until the next full sync minutes later.
        if let Some(w) = state.workers.get(&snap.worker_id)
            && !map.seq(w.slot).admits(snap.epoch.as_deref(), snap.seq, true)
        {
            return Ok((Registered { worker: w, how: Upsert::Unchanged, reclaimed: None }, Push::Stale));
        }
        let target = snap.url.as_deref().map(|url| Target { url, dp_rank: snap.dp_rank });
        let registered = map.register_sidecar(&state.workers, &snap.worker_id, target, served, now)?;
        let w = &registered.worker;
        // Alive from the moment the sync arrived, however long it takes.
        w.live.last_report_ms.store(now, Ordering::Relaxed);
        if !map.seq(w.slot).accept_as(snap.epoch.as_deref(), snap.seq, true) {
            return Ok((registered, Push::Stale));
        }
        // A sidecar reports for this worker: its index is exact from now on.
        map.index.set_approximate(w.slot, None);
        w.live.has_sidecar.store(true, Ordering::Relaxed);
        // v2 names the router clock it follows; v1 a time on the sidecar's
        // clock (or nothing: as of now).
        let covers = match (snap.covers, snap.as_of_ms) {
            (Some(tick), _) => Covers(tick),
            (None, Some(ms)) if protocol < 2 => map.index.covers_ms(w.slot, crate::state::from_wall_ms(ms)),
            (None, _) if protocol < 2 => map.index.covers_ms(w.slot, now),
            (None, _) => Covers(0),
        };
        (registered, covers)
    };
    let w = registered.worker.clone();
    let mut plan = SyncPlan::new(w.slot, &snap.hashes, covers);
    let not_member = |registered| Ok((registered, Push::NotMember));
    loop {
        let map = state.map.read();
        if !map.is_member(&state.workers, &w) {
            return not_member(registered);
        }
        if !plan.scan_held(&map.index, SYNC_READ_CHUNK) {
            break;
        }
    }
    loop {
        let map = state.map.read();
        if !map.is_member(&state.workers, &w) {
            return not_member(registered);
        }
        if !plan.scan_fresh(&map.index, SYNC_READ_CHUNK) {
            break;
        }
    }
    loop {
        let mut map = state.map.write();
        if !map.is_member(&state.workers, &w) {
            return not_member(registered);
        }
        if plan.apply_some(&mut map.index, SYNC_WRITE_CHUNK) {
            continue;
        }
        let outcome = plan.finish(&mut map.index);
        let digest = map.index.digest(w.slot);
        let clock = map.index.clock();
        let now = now_ms();
        w.live.last_report_ms.store(now, Ordering::Relaxed);
        w.live.last_sync_ms.store(now, Ordering::Relaxed);
        drop(map);
        // The worker cleared (ejected) between two chunks, or a bug: either
        // way the sidecar is asked for the set again (it paces syncs a
        // router keeps asking for).
        let resync = snap.digest.is_some_and(|theirs| theirs != digest);
        if resync {
            state.metrics.sync("digest_mismatch");
            tracing::warn!(worker.id = %w.id, theirs = ?snap.digest, ours = ?digest, "a sync did not reproduce its own digest: asking for another");
        }
        return Ok((registered, Push::Applied((outcome, Acked { resync, clock: Some(clock) }))));
    }
}

#[cfg(test)]
mod tests {
    use kvroute_shared::{BlockKey, ModelName};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::RawConfig;

    fn sync_of(id: &str, hashes: Vec<BlockKey>) -> SyncSnapshot {
        SyncSnapshot {
            worker_id: WorkerId::new(id),
            epoch: None,
            seq: Some(1),
            as_of_ms: None,
            covers: None,
            digest: None,
            url: Some("http://10.0.0.1:8000".into()),
            dp_rank: None,
            models: Vec::new(),
            model_aliases: Default::default(),
            block_size: None,
            hashes,
            load: None,
        }
    }

    #[test]
    fn a_stale_sync_changes_neither_the_address_nor_the_models() {
        let state = crate::build_state(RawConfig::default().validate().unwrap(), CancellationToken::new()).unwrap();
        let mut now = sync_of("a", vec![BlockKey(1)]);
        now.seq = Some(7);
        now.url = Some("http://10.0.0.2:8000".into());
        now.models = vec![ModelName::new("m")];
        assert!(matches!(apply_sync(&state, &now, 2).unwrap().1, Push::Applied(_)));
        // A retried sync from before, with the address and adapters the worker had then.
        let mut old = sync_of("a", vec![BlockKey(1)]);
        old.seq = Some(5);
        old.models = vec![ModelName::new("m"), ModelName::new("lora1")];
        assert_eq!(apply_sync(&state, &old, 2).unwrap().1, Push::Stale);
        let w = state.workers.get(&WorkerId::new("a")).unwrap();
        assert_eq!(w.url, "http://10.0.0.2:8000");
        assert_eq!(w.models, [ModelName::new("m")]);
        // The next sync in order still applies, and updates them.
        let mut next = old.clone();
        next.seq = Some(8);
        assert!(matches!(apply_sync(&state, &next, 2).unwrap().1, Push::Applied(_)));
        let w = state.workers.get(&WorkerId::new("a")).unwrap();
        assert_eq!((w.url.as_str(), w.models.len()), ("http://10.0.0.1:8000", 2));
    }

    #[test]
    fn the_routers_own_speculative_entries_leave_the_sidecar_its_whole_cap() {
        let raw = RawConfig { max_sync_keys: 4, ..RawConfig::default() };
        let state = crate::build_state(raw.validate().unwrap(), CancellationToken::new()).unwrap();
        let held: Vec<BlockKey> = (1..=4).map(BlockKey).collect();
        let (a, _) = apply_sync(&state, &sync_of("a", held), 2).unwrap();
        let slot = a.worker.slot;
        // Requests routed there: speculative entries of prompts it does not hold.
        state.map.write().index.record_routed(slot, &[BlockKey(50), BlockKey(51)], now_ms());
        assert_eq!(state.map.read().index.counts(slot).speculative, 2);
        let batch = |evicted: Vec<BlockKey>, stored: Vec<BlockKey>| EvictionBatch {
            worker_id: WorkerId::new("a"),
            epoch: None,
            seq: Some(2),
            evicted_hashes: evicted,
            stored_hashes: stored,
            cleared: false,
            load: None,
            digest: None,
        };
        // One evicted, one stored: the engine still holds 4.
        assert!(!over_cap(&state.map, slot, &batch(vec![BlockKey(1)], vec![BlockKey(9)]), 4));
        // One more than its cap is still refused.
        assert!(over_cap(&state.map, slot, &batch(vec![], vec![BlockKey(9)]), 4));
    }

    #[test]
    fn a_late_batch_for_a_replaced_worker_is_refused() {
        let state = crate::build_state(RawConfig::default().validate().unwrap(), CancellationToken::new()).unwrap();
        let (a, _) = apply_sync(&state, &sync_of("a", vec![BlockKey(1)]), 2).unwrap();
        // The handler looked a up; before it took the lock, a expired and b
        // registered in its slot.
        let looked_up = state.workers.get(&WorkerId::new("a")).unwrap();
        assert!(state.map.write().remove(&state.workers, &a.worker));
        let (b, _) = apply_sync(&state, &sync_of("b", vec![BlockKey(2)]), 2).unwrap();
        assert_eq!(b.worker.slot, looked_up.slot);
        let late = EvictionBatch {
            worker_id: WorkerId::new("a"),
            epoch: None,
            seq: Some(2),
            evicted_hashes: vec![BlockKey(2)],
            stored_hashes: vec![BlockKey(9)],
            cleared: true,
            load: None,
            digest: None,
        };
        assert_eq!(apply_eviction(&state, &looked_up, &late), Push::NotMember);
        let map = state.map.read();
        assert_eq!(map.index.keys_of(b.worker.slot).into_iter().map(|(k, _)| k).collect::<Vec<_>>(), [BlockKey(2)]);
    }

    #[test]
    fn a_worker_whose_sidecar_fell_silent_takes_a_sync_not_a_delta_and_is_exact_again() {
        let state = crate::build_state(RawConfig::default().validate().unwrap(), CancellationToken::new()).unwrap();
        let (a, _) = apply_sync(&state, &sync_of("a", vec![BlockKey(1)]), 2).unwrap();
        let w = a.worker;
        // What `health::expire` does when the sidecar is silent and the engine answers.
        w.live.has_sidecar.store(false, Ordering::Relaxed);
        {
            let mut map = state.map.write();
            map.index.clear_worker(w.slot);
            map.index.set_approximate(w.slot, Some(100));
            map.index.record_routed(w.slot, &[BlockKey(5)], now_ms());
        }
        let delta = EvictionBatch {
            worker_id: WorkerId::new("a"),
            epoch: None,
            seq: Some(2),
            evicted_hashes: vec![],
            stored_hashes: vec![BlockKey(9)],
            cleared: false,
            load: None,
            digest: None,
        };
        assert_eq!(apply_eviction(&state, &w, &delta), Push::NotMember, "the sidecar is asked for a sync");
        assert_eq!(state.map.read().index.counts(w.slot).confirmed, 0);
        let mut back = sync_of("a", vec![BlockKey(1), BlockKey(9)]);
        back.seq = Some(3);
        let (again, applied) = apply_sync(&state, &back, 2).unwrap();
        assert!(matches!(applied, Push::Applied(_)));
        assert_eq!(again.how, Upsert::Unchanged, "the same registration, exact again");
        assert!(w.live.has_sidecar.load(Ordering::Relaxed));
        let map = state.map.read();
        assert!(!map.index.is_approximate(w.slot));
        assert_eq!(map.index.counts(w.slot), crate::index::Counts { confirmed: 2, speculative: 0, approximate: 0 });
    }
}
