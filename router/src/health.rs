//! Worker health and the index's housekeeping.
//!
//! - Active checks: `GET {worker}/health` every interval; a worker that fails
//!   is ejected after consecutive failures (passive failures from the proxy
//!   count too) and re-admitted when it answers again.
//! - Housekeeping, every second: expire unconfirmed speculative entries and
//!   sessions, fall back to the approximate index for workers whose sidecar
//!   went silent (static ones always, sidecar-registered ones while their
//!   engine still answers its health probe), drop sidecar-registered workers
//!   whose sidecar and engine are both gone, refresh the gauges.
//!
//! A sidecar can die while its engine serves on: the worker stays routable,
//! and the router records its own routing decisions for it as it does for
//! a worker with no sidecar. The sidecar's exact entries are dropped at the
//! switch (nothing keeps them true any more); its next full sync makes the
//! worker exact again (`internal::apply_sync`).
//!
//! Each works from a registry snapshot, which may be out of date by the time
//! it acts: every change to a worker's slot is made under the index lock
//! after checking there that the worker is still the slot's member
//! (`state::MapState`), so it never lands on a worker registered since.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvroute_shared::body::{MAX_ENGINE_METRICS_BYTES, read_within};

use crate::index::Compaction;
use crate::metrics::{ENGINE_KINDS, INDEX_KINDS, WorkerKind, WorkerLabel};
use crate::state::{AppState, MapState, now_ms};
use crate::workers::{Served, Source, Worker};

/// Takes an unhealthy worker out of the index: its cache state is unknown
/// (it may come back restarted and empty).
pub fn eject(state: &AppState, worker: &Worker, why: &str) {
    let purged = {
        let map = state.map.write();
        if !map.is_member(&state.workers, worker) {
            return;
        }
        let held = map.index.counts(worker.slot);
        drop(state.clear_in_chunks(map, worker.slot, |m| m.is_member(&state.workers, worker)));
        held.confirmed + held.speculative
    };
    state.metrics.ejections.get_or_create(&WorkerLabel { worker: worker.id.to_string() }).inc();
    tracing::warn!(worker.id = %worker.id, purged, why, "worker ejected");
}

/// How long a worker ejected for failed requests (its `k`-th such ejection
/// since a request there succeeded) stays out while its `/health` answers:
/// 5 s, doubling to 5 min. An engine that answers its probes and fails its
/// requests (a wedged GPU, a broken model) was re-admitted by the next probe,
/// 2 s later, and ejected again after costing its next requests their
/// first-token deadline, for ever. Probes failing as many times in a row as
/// ejection takes end the hold: the engine went away, and answering again
/// it is re-admitted at once.
pub fn request_hold(k: u32) -> Duration {
    Duration::from_secs(5 << k.saturating_sub(1).min(6)).min(Duration::from_secs(300))
}

/// A health probe failed.
/// `failure`: what the probe got (a status, or the connection's error),
/// named in the ejection's log with the URL probed: a worker registered
/// at an address this router cannot reach (an `advertise_url` only its own
/// host resolves, a gateway's path) said only "health probes failed".
fn probe_failed(state: &AppState, worker: &Worker, failure: &str) {
    let n = worker.live.probe_failures.fetch_add(1, Ordering::Relaxed) + 1;
    if n < state.config.raw.eject_after_failures {
        return;
    }
    // Judged gone (not one slow probe of a struggling engine): answering
    // again, it is re-admitted at once.
    worker.live.held_until_ms.store(0, Ordering::Relaxed);
    if worker.live.healthy.swap(false, Ordering::Relaxed) {
        let url = format!("{}/health", worker.url);
        eject(state, worker, &format!("{n} health probes of {url} failed in a row, the last: {failure}"));
    }
}

/// A health probe answered at `now`: an ejected worker is re-admitted unless
/// it is held out for failed requests. Returns whether it was re-admitted.
fn probe_answered(worker: &Worker, now: u64) -> bool {
    worker.live.probe_failures.store(0, Ordering::Relaxed);
    worker.live.last_probe_ok_ms.store(now, Ordering::Relaxed);
    if worker.live.is_healthy() || now < worker.live.held_until_ms.load(Ordering::Relaxed) {
        return false;
    }
    worker.live.consecutive_failures.store(0, Ordering::Relaxed);
    !worker.live.healthy.swap(true, Ordering::Relaxed)
}

pub async fn run_health_checks(state: Arc<AppState>) {
    // A check that panicked: its panic goes on here, and stops the router
    // as this task's end does.
    let panicked: Arc<parking_lot::Mutex<Option<Box<dyn std::any::Any + Send>>>> = Arc::default();
    let mut tick = tokio::time::interval(state.config.raw.health_check_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = state.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some(payload) = panicked.lock().take() {
            std::panic::resume_unwind(payload);
        }
        // Each worker's check runs on its own, one at a time per worker: a
        // round waited for every worker's, and an engine whose `/metrics`
        // stalled (up to three timeouts) stretched every other worker's
        // probe period, and its ejection, threefold. A tick that comes
        // while a worker's check runs has the next one start as it ends
        // (a probe timing out at the interval would otherwise wait a whole
        // interval more each time).
        for worker in state.workers.snapshot().iter() {
            if worker.live.probing.swap(true, Ordering::Relaxed) {
                worker.live.probe_due.store(true, Ordering::Relaxed);
                continue;
            }
            let (state, worker, panicked) = (state.clone(), worker.clone(), panicked.clone());
            let checks = async move {
                let mut worker = worker;
                loop {
                    let run = std::panic::AssertUnwindSafe(check(&state, &worker));
                    if let Err(payload) = futures::FutureExt::catch_unwind(run).await {
                        worker.live.probing.store(false, Ordering::Relaxed);
                        *panicked.lock() = Some(payload);
                        return;
                    }
                    if !worker.live.probe_due.swap(false, Ordering::Relaxed) {
                        worker.live.probing.store(false, Ordering::Relaxed);
                        // A tick between the swap and the store found it
                        // still under way: its check is this one's to run.
                        if !worker.live.probe_due.swap(false, Ordering::Relaxed)
                            || worker.live.probing.swap(true, Ordering::Relaxed)
                        {
                            return;
                        }
                    }
                    // The worker as it is now (its URL may have moved; its
                    // `live` is the same): gone, there is nothing to check.
                    match current(&state, &worker) {
                        Some(now) => worker = now,
                        None => {
                            worker.live.probing.store(false, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            };
            tokio::spawn(tracing::Instrument::instrument(checks, tracing::Span::current()));
        }
    }
}

/// The registry's worker that `worker` is now: the same `live` (a move of
/// its URL keeps it), if it is still registered.
fn current(state: &AppState, worker: &Worker) -> Option<Arc<Worker>> {
    state.workers.snapshot().iter().find(|w| Arc::ptr_eq(&w.live, &worker.live)).cloned()
}

async fn check(state: &Arc<AppState>, worker: &Arc<Worker>) {
    let timeout = state.config.raw.health_check_timeout;
    let failure = match state.client.get(format!("{}/health", worker.url)).timeout(timeout).send().await {
        Ok(r) if r.status().is_success() => None,
        Ok(r) => Some(format!("answered {}", r.status())),
        Err(e) => Some(kvroute_shared::logging::error_chain(&e)),
    };
    if let Some(failure) = failure {
        probe_failed(state, worker, &failure);
        return;
    }
    if probe_answered(worker, now_ms()) {
        tracing::info!(worker.id = %worker.id, "worker re-admitted");
        worker.live.forget_capacity();
        // It may have come back another engine (restarted with another model).
        worker.live.tokenizer_checked.store(false, Ordering::Relaxed);
    }
    if !worker.live.has_sidecar.load(Ordering::Relaxed) || !worker.live.capacity_read() {
        learn_capacity(state, worker).await;
    }
    if worker.source == Source::Static && !worker.live.has_sidecar.load(Ordering::Relaxed) {
        learn_models(state, worker).await;
    }
    crate::tokenizer_check::start(state, worker);
}

/// The engine's page at `path`, read within the probe's timeout and up to
/// `max` bytes; `None` if it does not answer it whole and with a success.
async fn engine_page(state: &AppState, worker: &Worker, path: &str, max: usize) -> Option<Vec<u8>> {
    let timeout = state.config.raw.health_check_timeout;
    let r = state.client.get(format!("{}{path}", worker.url)).timeout(timeout).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    read_within(reqwest::Body::from(r), max).await.ok().flatten()
}

/// A static worker without a sidecar (whose syncs name its models) learns
/// them from the engine's `/v1/models` at each probe, adapters loaded since
/// included: without them `GET /v1/models` listed nothing, and a request for
/// any model could go to any static worker, engines serving other models
/// included (their 404s are passed on, not retried). An engine that does not
/// answer the list (an API key the router lacks) keeps what was known; with
/// nothing known, the worker takes any model.
async fn learn_models(state: &AppState, worker: &Worker) {
    use kvroute_shared::wire::{MAX_MODELS_BYTES, model_aliases, parse_served_models};
    let Some(body) = engine_page(state, worker, "/v1/models", MAX_MODELS_BYTES).await else { return };
    match parse_served_models(&body) {
        Ok(served) if !served.is_empty() => {
            // Keyed by the router alone: its aliases key as the first name
            // vLLM lists (the first `--served-model-name`).
            let aliases = model_aliases(&served, &served[0].name);
            let models: Vec<_> = served.into_iter().map(|m| m.name).collect();
            let served = Served { models: &models, aliases: &aliases };
            if let Err(e) = state.workers.upsert(&worker.id, None, Some(served), Source::Static) {
                tracing::warn!(worker.id = %worker.id, error = %e, "could not take the engine's model list");
            }
        }
        Ok(_) => {}
        Err(e) => {
            tracing::debug!(worker.id = %worker.id, error = %e, "the engine's /v1/models is not a list the router takes")
        }
    }
}

/// The worker's KV capacity in blocks from
/// `vllm:cache_config_info{num_gpu_blocks="…"}`, read once (again after the
/// worker was ejected and re-admitted): the policy weighs the blocks it has
/// never used ([`crate::policy::LoadView::capacity_blocks`]). An approximately
/// indexed worker's index remembers that many keys (the configured default
/// if the engine does not say), and is read at every probe: a sidecar may
/// have taken over.
async fn learn_capacity(state: &AppState, worker: &Worker) {
    let Some(body) = engine_page(state, worker, "/metrics", MAX_ENGINE_METRICS_BYTES).await else { return };
    let text = String::from_utf8_lossy(&body);
    // Once a registration (and re-admission): a sidecar checks its own.
    if !worker.live.capacity_read() && !worker.live.has_sidecar.load(Ordering::Relaxed) {
        check_cache_config(state, worker, &text);
    }
    let published = parse_num_gpu_blocks(&text, state.config.raw.max_sync_keys);
    worker.live.set_capacity_blocks(published.map(|b| b as u64));
    let blocks = published.unwrap_or(state.config.raw.approx_capacity_blocks);
    // A sidecar may have registered or synced while /metrics was read.
    let mut map = state.map.write();
    if map.is_member(&state.workers, worker) && !worker.live.has_sidecar.load(Ordering::Relaxed) {
        map.index.set_approximate(worker.slot, Some(blocks));
    }
}

/// A worker without a sidecar whose engine's cache is not the router's
/// (another block size: its blocks are not the keys routed on; prefix
/// caching off: nothing is reused) is logged as an error. A sidecar refuses
/// both at its start; a static worker was routed on for ever, in silence.
fn check_cache_config(state: &AppState, worker: &Worker, metrics: &str) {
    use kvroute_shared::engine_metrics::{parse_block_size, parse_prefix_caching};
    let ours = state.config.block_size.get();
    if let Some(engine) = parse_block_size(metrics).filter(|b| *b as usize != ours) {
        tracing::error!(
            worker.id = %worker.id, url = %worker.url, engine_block_size = engine, block_size = ours,
            "the engine's block size is not the router's: the keys routed on are not its blocks; set the \
             router's block_size to the engine's --block-size"
        );
    }
    if parse_prefix_caching(metrics) == Some(false) {
        tracing::error!(
            worker.id = %worker.id, url = %worker.url,
            "the engine runs without prefix caching (vllm:cache_config_info): it reuses nothing the router \
             routes for; start vLLM with --enable-prefix-caching"
        );
    }
}

/// `num_gpu_blocks`, read as at most `max` (`max_sync_keys`, the keys a
/// worker's index may hold): whatever answers at a worker's URL writes
/// this page, and an approximately indexed worker keeps as many keys of
/// the prompts sent there.
pub fn parse_num_gpu_blocks(metrics: &str, max: usize) -> Option<usize> {
    let blocks: u64 = kvroute_shared::engine_metrics::cache_config_label(metrics, "num_gpu_blocks")?.parse().ok()?;
    Some(usize::try_from(blocks).unwrap_or(usize::MAX).min(max))
}

pub async fn run_housekeeping(state: Arc<AppState>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = state.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        housekeeping(&state);
        // Off the async workers: a million-key scan takes a while.
        let st = state.clone();
        let _ = tokio::task::spawn_blocking(move || compact_reverse_vectors(&st)).await;
    }
}

/// One housekeeping pass (public for tests).
pub fn housekeeping(state: &AppState) {
    let now = now_ms();
    let ttl = state.config.raw.speculative_ttl.as_millis() as u64;
    // A chunk per write lock: routing goes on between them.
    loop {
        let (expired, more) =
            state.map.write().index.expire_speculative_some(now, ttl, crate::internal::SYNC_WRITE_CHUNK);
        state.metrics.speculative_expired.inc_by(expired as u64);
        if !more {
            break;
        }
    }
    state.sessions.sweep(Instant::now());

    for w in state.workers.snapshot().iter() {
        if is_silent(state, w, now) {
            expire(state, w, now);
        }
    }
    housekeeping_gauges(state, true);
}

/// Compacts the reverse vectors too large to compact inline, each scanned
/// in slices under the read lock and swapped under the write lock
/// (`index::Compaction`), so no routing decision waits for one.
pub fn compact_reverse_vectors(state: &AppState) {
    let due = state.map.read().index.compaction_due();
    for slot in due {
        let Some(mut c) = Compaction::new(&state.map.read().index, slot) else { continue };
        let scanned = loop {
            match c.scan(&state.map.read().index, crate::internal::SYNC_READ_CHUNK) {
                Some(true) => continue,
                Some(false) => break true,
                None => break false,
            }
        };
        if scanned {
            c.install(&mut state.map.write().index);
        }
    }
}

/// Is something to be done about a worker going quiet: a sidecar silent for
/// longer than `worker_expiry`, or, for a sidecar-registered worker already
/// back on the approximate index, an engine that stopped answering its health
/// probe (ejected, and no answer for `worker_expiry`)?
fn is_silent(state: &AppState, w: &Worker, now: u64) -> bool {
    let expiry = state.config.raw.worker_expiry.as_millis() as u64;
    let last = w.live.last_report_ms.load(Ordering::Relaxed);
    if w.live.has_sidecar.load(Ordering::Relaxed) {
        return now.saturating_sub(last) > expiry;
    }
    let probed = w.live.last_probe_ok_ms.load(Ordering::Relaxed);
    w.source == Source::Sidecar && !w.live.is_healthy() && now.saturating_sub(last.max(probed)) > expiry
}

/// Did the worker's engine answer its health probe after its sidecar's last
/// report, and has it not failed enough probes since to be ejected? Without
/// such a sign of life (health checks less frequent than `worker_expiry`,
/// say), a silent sidecar's worker is taken for gone.
fn engine_answers(w: &Worker) -> bool {
    let probed = w.live.last_probe_ok_ms.load(Ordering::Relaxed);
    w.live.is_healthy() && probed >= w.live.last_report_ms.load(Ordering::Relaxed)
}

/// A worker gone quiet (see [`is_silent`]): it goes back to the approximate
/// index if it is static or its engine still answers, else (a
/// sidecar-registered worker whose engine is unreachable too) it leaves:
/// registry, index, seqs and metric series. `w` comes from a snapshot, so
/// under the lock it is checked again that it is still registered and still
/// silent: a push may have arrived, or the worker been replaced in its slot,
/// since.
fn expire(state: &AppState, w: &Worker, now: u64) {
    let map = state.map.write();
    if !map.is_member(&state.workers, w) || !is_silent(state, w, now) {
        return;
    }
    let sidecar = w.live.has_sidecar.load(Ordering::Relaxed);
    if w.source == Source::Static || (sidecar && engine_answers(w)) {
        // From here its sidecar's pushes are refused (not a member's).
        w.live.has_sidecar.store(false, Ordering::Relaxed);
        w.live.forget_reported();
        let held = map.index.counts(w.slot);
        // A sidecar back meanwhile (a sync between two chunks) has made the
        // index exact again: it is left so, its set the sync's.
        let still = |m: &MapState| m.is_member(&state.workers, w) && !w.live.has_sidecar.load(Ordering::Relaxed);
        if let Some(mut map) = state.clear_in_chunks(map, w.slot, still) {
            map.index.set_approximate(w.slot, Some(state.config.raw.approx_capacity_blocks));
        }
        let dropped = held.confirmed + held.speculative;
        tracing::warn!(worker.id = %w.id, dropped, "sidecar stopped reporting: back to the approximate index");
        return;
    }
    state.remove_in_chunks(map, w);
    if sidecar {
        tracing::warn!(worker.id = %w.id, "sidecar stopped reporting and the engine does not answer: worker removed");
    } else {
        tracing::warn!(worker.id = %w.id, "engine stopped answering and no sidecar reports: worker removed");
    }
    state.metrics.retire_worker(w);
}

/// Brings the gauges up to date (also done right before each scrape).
/// `count_keys`: also the distinct keys, which past 64 workers is a scan of
/// the index under its read lock that every routed request waits on: done
/// by the once-a-second housekeeping, not by each scrape (`/metrics` needs
/// no token).
pub fn housekeeping_gauges(state: &AppState, count_keys: bool) {
    let m = &state.metrics;
    let workers = state.workers.snapshot();
    let map = state.map.read();
    if count_keys {
        m.index_keys.set(map.index.key_count() as i64);
    }
    m.index_entries.set(map.index.entry_count() as i64);
    for w in workers.iter() {
        let c = map.index.counts(w.slot);
        let id = w.id.to_string();
        for (kind, n) in INDEX_KINDS.into_iter().zip([c.confirmed, c.speculative, c.approximate]) {
            m.index_worker_entries.get_or_create(&WorkerKind { worker: id.clone(), kind }).set(n as i64);
        }
        let load = w.live.load(now_ms(), map.index.held(w.slot));
        let label = WorkerLabel { worker: id.clone() };
        m.init_worker_series(&id);
        m.worker_inflight.get_or_create(&label).set(i64::from(load.inflight));
        let own_pending = w.live.pending_prefill_tokens.load(Ordering::Relaxed);
        m.worker_pending_tokens.get_or_create(&label).set(own_pending as i64);
        m.worker_replica_pending_tokens.get_or_create(&label).set(load.replica_pending_prefill_tokens as i64);
        m.worker_kv_usage.get_or_create(&label).set(load.kv_usage);
        if let Some(pace) = load.pace {
            m.worker_pace.get_or_create(&label).set(pace);
        }
        if let Some(cap) = load.capacity_blocks {
            let free = cap.saturating_sub(load.held_blocks);
            m.worker_free_blocks.get_or_create(&label).set(free.min(i64::MAX as u64) as i64);
        }
        m.worker_healthy.get_or_create(&label).set(i64::from(w.live.is_healthy()));
        let last_sync = w.live.last_sync_ms.load(Ordering::Relaxed);
        if last_sync > 0 {
            m.worker_sync_age.get_or_create(&label).set(now_ms().saturating_sub(last_sync) as f64 / 1000.0);
            m.worker_sync_timestamp.get_or_create(&label).set(crate::state::to_wall_ms(last_sync) as f64 / 1000.0);
        }
        for (kind, n) in ENGINE_KINDS.into_iter().zip([load.running, load.waiting]) {
            m.worker_engine_requests.get_or_create(&WorkerKind { worker: id.clone(), kind }).set(i64::from(n));
        }
    }
    drop(map);
    // This refresh's snapshot is let go first, so it does not keep a removed
    // worker's series alive for another round.
    drop(workers);
    let current = state.workers.snapshot();
    m.sweep_departed(|id| current.iter().any(|w| w.id.as_str() == id));
}

#[cfg(test)]
mod tests {
    use kvroute_shared::{BlockKey, WorkerId};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::RawConfig;

    fn state() -> Arc<AppState> {
        crate::build_state(RawConfig::default().validate().unwrap(), CancellationToken::new()).unwrap()
    }

    /// Registers `id` as a sidecar would, its last report at `at_ms`, holding `keys`.
    fn registered(state: &AppState, id: &str, at_ms: u64, keys: &[BlockKey]) -> Arc<Worker> {
        let mut map = state.map.write();
        let w = map
            .register_sidecar(&state.workers, &WorkerId::new(id), Some("http://10.0.0.1:8000".into()), None, at_ms)
            .unwrap()
            .worker;
        map.index.sync(w.slot, keys, at_ms);
        w
    }

    #[test]
    fn an_expiry_decided_from_an_old_snapshot_spares_whoever_holds_the_slot_now() {
        let state = state();
        let now = now_ms();
        let long_ago = now - 60_000;
        let a = registered(&state, "a", long_ago, &[BlockKey(1)]);
        let old_snapshot = state.workers.snapshot();
        // Meanwhile a expired and b took its slot with a fresh sync.
        expire(&state, &a, now);
        let b = registered(&state, "b", now, &[BlockKey(2)]);
        assert_eq!(b.slot, a.slot);
        for w in old_snapshot.iter() {
            expire(&state, w, now);
        }
        assert!(state.workers.is_current(&b));
        assert_eq!(state.map.read().index.counts(b.slot).confirmed, 1, "b's sync survives");
    }

    #[test]
    fn an_expiry_decided_from_an_old_snapshot_spares_the_same_id_registered_again() {
        let state = state();
        let now = now_ms();
        let old = registered(&state, "a", now - 60_000, &[BlockKey(1)]);
        expire(&state, &old, now);
        let again = registered(&state, "a", now, &[BlockKey(2)]);
        expire(&state, &old, now);
        assert!(state.workers.is_current(&again));
        assert_eq!(state.map.read().index.counts(again.slot).confirmed, 1);
    }

    /// Ejecting, or expiring, a worker of more keys than one write-lock
    /// chunk clears all of them (a chunk at a time), and leaves its slot as
    /// one clear did: an expired sidecar's worker approximate, a removed one
    /// gone with its seqs.
    #[test]
    fn workers_of_many_keys_are_cleared_whole_a_chunk_at_a_time() {
        let state = state();
        let now = now_ms();
        let many: Vec<BlockKey> = (0..10_000).map(BlockKey).collect();
        let a = registered(&state, "a", now, &many);
        eject(&state, &a, "test");
        assert_eq!(state.map.read().index.counts(a.slot), Default::default());
        let b = registered(&state, "b", now - 60_000, &many);
        b.live.last_probe_ok_ms.store(now, Ordering::Relaxed);
        expire(&state, &b, now);
        let map = state.map.read();
        assert_eq!(map.index.counts(b.slot), Default::default());
        assert!(map.index.is_approximate(b.slot), "its engine answers: back to the approximate index");
        drop(map);
        let c = registered(&state, "c", now - 60_000, &many);
        c.live.healthy.store(false, Ordering::Relaxed);
        expire(&state, &c, now);
        assert!(!state.workers.snapshot().iter().any(|w| w.id == c.id), "removed");
        let map = state.map.read();
        assert_eq!(map.index.counts(c.slot), Default::default());
        map.index.check_consistency().unwrap();
    }

    #[test]
    fn a_report_after_the_snapshot_keeps_the_worker() {
        let state = state();
        let now = now_ms();
        let w = registered(&state, "a", now - 60_000, &[BlockKey(1)]);
        assert!(is_silent(&state, &w, now));
        w.live.last_report_ms.store(now, Ordering::Relaxed);
        expire(&state, &w, now);
        assert!(state.workers.is_current(&w));
    }

    /// Request failures count though probes answer between them; a worker
    /// ejected for them is held out, not re-admitted by the next probe, for
    /// 5 s, then 10 s the next time; the engine judged gone by its probes
    /// ends the hold.
    #[test]
    fn a_worker_whose_requests_fail_while_its_health_answers_is_held_out() {
        let state = state();
        let now = now_ms();
        let w = registered(&state, "a", now, &[BlockKey(1)]);
        let n = state.config.raw.eject_after_failures;
        for _ in 1..n {
            crate::proxy::note_failure(&state, &w);
            assert!(!probe_answered(&w, now_ms()), "a healthy worker is not re-admitted");
        }
        assert!(w.live.is_healthy());
        crate::proxy::note_failure(&state, &w);
        assert!(!w.live.is_healthy(), "ejected after {n} failed requests, probes answering between them");
        let held = w.live.held_until_ms.load(Ordering::Relaxed);
        assert!(held >= now + 5_000, "held 5 s");
        assert!(!probe_answered(&w, now_ms()), "the next probe does not re-admit it");
        assert!(probe_answered(&w, held), "re-admitted once the hold is over");
        // Ejected again before any request succeeded there: held twice as long.
        for _ in 0..n {
            crate::proxy::note_failure(&state, &w);
        }
        assert!(!w.live.is_healthy());
        let again = w.live.held_until_ms.load(Ordering::Relaxed);
        assert!(again >= now_ms() + 9_000, "held 10 s the second time");
        // One slow probe does not end the hold; the engine gone (as many
        // failed probes as ejection takes) and back is re-admitted at once.
        probe_failed(&state, &w, "refused");
        assert!(!probe_answered(&w, now_ms()), "one failed probe is not the engine gone");
        for _ in 0..n {
            probe_failed(&state, &w, "refused");
        }
        assert!(probe_answered(&w, now_ms()));
        assert_eq!(request_hold(1), Duration::from_secs(5));
        assert_eq!(request_hold(30), Duration::from_secs(300));
    }

    #[test]
    fn ejecting_a_replaced_worker_leaves_its_slot_alone() {
        let state = state();
        let now = now_ms();
        let a = registered(&state, "a", now - 60_000, &[BlockKey(1)]);
        expire(&state, &a, now);
        let b = registered(&state, "b", now, &[BlockKey(2)]);
        eject(&state, &a, "test");
        assert_eq!(state.map.read().index.counts(b.slot).confirmed, 1);
    }

    #[test]
    fn a_silent_sidecar_whose_engine_answers_leaves_its_worker_routable_and_approximate() {
        let state = state();
        let now = now_ms();
        let w = registered(&state, "a", now - 60_000, &[BlockKey(1), BlockKey(2)]);
        // The sidecar's last report: a busy engine.
        let busy = kvroute_shared::wire::Load { running: 40, waiting: 25, kv_usage: 0.95 };
        w.live.set_reported(&busy, now - 60_000);
        w.live.last_probe_ok_ms.store(now - 1_000, Ordering::Relaxed);
        housekeeping(&state);
        assert!(state.workers.is_current(&w), "still registered");
        assert!(!w.live.has_sidecar.load(Ordering::Relaxed));
        // No push will refresh those figures: they are not kept.
        let load = w.live.load(now, 0);
        assert_eq!(
            (load.running, load.waiting, load.kv_usage),
            (0, 0, 0.0),
            "a silent sidecar's last load is forgotten"
        );
        let map = state.map.read();
        assert!(map.index.is_approximate(w.slot));
        assert_eq!(map.index.counts(w.slot), crate::index::Counts::default(), "the unverifiable entries are gone");
        drop(map);
        // Routed to, it is indexed as the router routes, like a worker without a sidecar.
        crate::routing::record_dispatch(&state, &w, &[BlockKey(7)]);
        assert_eq!(state.map.read().index.counts(w.slot).approximate, 1);
        // Its engine answering on, it stays.
        housekeeping(&state);
        assert!(state.workers.is_current(&w));
    }

    #[test]
    fn a_fallen_back_worker_leaves_once_its_engine_stops_answering() {
        let state = state();
        let now = now_ms();
        let w = registered(&state, "a", now - 120_000, &[BlockKey(1)]);
        w.live.last_probe_ok_ms.store(now - 100_000, Ordering::Relaxed);
        expire(&state, &w, now - 60_000);
        assert!(state.workers.is_current(&w) && !w.live.has_sidecar.load(Ordering::Relaxed));
        // Ejected: health probes failed; the last answer is long ago.
        w.live.healthy.store(false, Ordering::Relaxed);
        housekeeping(&state);
        assert!(!state.workers.is_current(&w));
        assert!(state.workers.get(&WorkerId::new("a")).is_none());
    }

    #[test]
    fn a_silent_sidecar_whose_engine_was_not_heard_since_takes_its_worker_along() {
        let state = state();
        let now = now_ms();
        // The engine last answered before the sidecar's last report.
        let w = registered(&state, "a", now - 60_000, &[BlockKey(1)]);
        w.live.last_probe_ok_ms.store(now - 61_000, Ordering::Relaxed);
        housekeeping(&state);
        assert!(!state.workers.is_current(&w));
        // Answering but ejected (failed probes since) counts as gone too.
        let w = registered(&state, "b", now - 60_000, &[BlockKey(1)]);
        w.live.last_probe_ok_ms.store(now - 1_000, Ordering::Relaxed);
        w.live.healthy.store(false, Ordering::Relaxed);
        housekeeping(&state);
        assert!(!state.workers.is_current(&w));
    }

    #[test]
    fn reads_num_gpu_blocks_from_vllm_metrics() {
        let text =
            "# HELP x\nvllm:cache_config_info{block_size=\"16\",model_name=\"m\",num_gpu_blocks=\"27000\"} 1.0\n";
        assert_eq!(parse_num_gpu_blocks(text, 4_000_000), Some(27000));
        assert_eq!(parse_num_gpu_blocks("vllm:num_requests_running 3", 4_000_000), None);
        // A made-up capacity is held to the index's per-worker bound.
        let huge = "vllm:cache_config_info{num_gpu_blocks=\"99999999999999\"} 1.0\n";
        assert_eq!(parse_num_gpu_blocks(huge, 4_000_000), Some(4_000_000));
    }
}
