//! The set of workers: an immutable snapshot swapped whole (`arc-swap`), so a
//! request reads one consistent list without a lock, while each worker's live
//! figures (in-flight, reported load, health) are atomics shared across
//! snapshots.
//!
//! Membership changes go through `state::MapState`, which holds the index
//! lock while it changes the registry, the index and the seq table: the
//! registry alone does not know what a slot holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use kvroute_shared::wire::{Load, ModelAliases};
use kvroute_shared::{ModelName, WorkerId};
use parking_lot::Mutex;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::index::{MAX_WORKERS, Slot};
use crate::policy::{ArrivalRate, LoadView, Pace, ReportWatch};

/// Where a worker came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// `--worker ID=URL`: kept until the router stops.
    Static,
    /// Registered by a sidecar's sync. When its sidecar stops reporting it
    /// stays, indexed approximately, while its engine answers health probes;
    /// it is removed when the engine does not.
    Sidecar,
}

#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    pub slot: Slot,
    /// Which registration this is, unique per router: a worker removed and
    /// registered again, or another worker in its slot, has a new one. A
    /// snapshot's copy is still the slot's member only while the registry
    /// holds the same generation (checked under the index lock).
    pub generation: u64,
    /// Base URL without a trailing slash.
    pub url: String,
    /// A data-parallel rank behind `url` (vLLM's internal load balancing):
    /// its requests carry `X-data-parallel-rank: dp_rank`.
    pub dp_rank: Option<u32>,
    /// Served models; empty means unknown (a static worker before its first
    /// sync), which accepts any model.
    pub models: Vec<ModelName>,
    /// Which of them key as another (`--served-model-name a b`).
    pub aliases: ModelAliases,
    pub source: Source,
    /// Stable hash of the id, for rendezvous placement (same on every router).
    pub id_hash: u64,
    pub live: Arc<WorkerLive>,
}

impl Worker {
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m.as_str() == model)
    }
}

/// What a registration says a worker serves: its model names, and which of
/// them are aliases that key as another ([`ModelAliases`]).
#[derive(Clone, Copy, Debug)]
pub struct Served<'a> {
    pub models: &'a [ModelName],
    pub aliases: &'a ModelAliases,
}

impl<'a> Served<'a> {
    /// Names without aliases.
    pub fn names(models: &'a [ModelName]) -> Self {
        static NONE: ModelAliases = ModelAliases::new();
        Served { models, aliases: &NONE }
    }
}

#[cfg(test)]
impl Worker {
    /// A sidecar-registered worker in slot 0 with nothing in flight, for
    /// unit tests.
    pub fn for_test(id: &str) -> Arc<Worker> {
        let id = WorkerId::new(id);
        Arc::new(Worker {
            id_hash: id_hash(&id),
            id,
            slot: Slot(0),
            generation: 0,
            url: "http://w".into(),
            dp_rank: None,
            models: Vec::new(),
            aliases: ModelAliases::new(),
            source: Source::Sidecar,
            live: Arc::new(WorkerLive::default()),
        })
    }
}

/// What [`WorkerLive::note_moved`] made of a registration that moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Moved {
    /// The first move in a minute: logged as news.
    Once,
    /// Moved again within a minute: logged as an error.
    BackAndForth,
    /// Again, the error logged less than 10 s ago.
    BackAndForthLogged,
}

/// Figures that change per request; shared by every snapshot of a worker.
#[derive(Debug)]
pub struct WorkerLive {
    /// This router's own requests there, and their not-yet-prefilled tokens.
    pub inflight: AtomicU32,
    pub pending_prefill_tokens: AtomicU64,
    /// What the other replicas last reported of theirs, summed
    /// (`crate::replicas::Replicas::publish`).
    pub replica_inflight: AtomicU32,
    pub replica_pending_prefill_tokens: AtomicU64,
    running: AtomicU32,
    waiting: AtomicU32,
    kv_usage_bits: AtomicU64,
    pub healthy: AtomicBool,
    /// Requests failed there in a row (a request's success resets it).
    pub consecutive_failures: AtomicU32,
    /// Health probes failed in a row (a probe's success resets it).
    pub probe_failures: AtomicU32,
    /// Ejections for failed requests since a request there last succeeded:
    /// each doubles how long the worker is held out ([`Self::held_until_ms`]).
    pub request_ejections: AtomicU32,
    /// Unix ms before which a worker ejected for failed requests is not
    /// re-admitted by a probe that answers (its `/health` may answer while
    /// its requests fail); 0 when not held.
    pub held_until_ms: AtomicU64,
    /// Unix ms of the last sidecar message (sync or eviction).
    pub last_report_ms: AtomicU64,
    pub last_sync_ms: AtomicU64,
    /// Unix ms of the last health probe the engine answered (0: none yet).
    pub last_probe_ok_ms: AtomicU64,
    /// Unix ms the worker was last seen producing: an answer of this
    /// router's began there (a stream's first token, a whole answer), or its
    /// sidecar reported blocks filled.
    pub last_progress_ms: AtomicU64,
    /// Unix ms its sidecar last reported blocks filled (0: never): its
    /// engine reports what it produces ([`crate::proxy`] watches its
    /// non-streamed answers by it).
    pub last_blocks_ms: AtomicU64,
    /// Unix ms its registration last moved (URL or rank), and of the last
    /// error logged for moving back and forth (`note_moved`).
    moved_ms: AtomicU64,
    /// Its engine's tokenizer was compared with the router's (`crate::tokenizer_check`):
    /// once an answer settled it, match or not; cleared when the worker
    /// moves, changes models or is re-admitted (a restarted engine).
    pub tokenizer_checked: AtomicBool,
    /// A comparison is under way (it runs beside the health probes).
    pub tokenizer_checking: AtomicBool,
    /// Its health check (probe, `/metrics`, models) is under way.
    pub probing: AtomicBool,
    /// A tick came while it was: the next check starts as it ends.
    pub probe_due: AtomicBool,
    /// Unix ms before which a comparison that failed is not tried again.
    pub tokenizer_retry_ms: AtomicU64,
    conflict_logged_ms: AtomicU64,
    /// Is a sidecar reporting for this worker (exact index)?
    pub has_sidecar: AtomicBool,
    /// Its load reports against this router's requests there
    /// ([`crate::policy::ForeignTraffic`]).
    watch: Mutex<ReportWatch>,
    /// Requests this router sent there lately.
    arrivals: Mutex<ArrivalRate>,
    /// Its first tokens' measured time against the model's ([`Pace`]).
    pace: Mutex<Pace>,
    /// Its KV cache in blocks, from the engine's
    /// `vllm:cache_config_info{num_gpu_blocks}`: 0 not yet read,
    /// `u64::MAX` the engine does not publish it.
    capacity_blocks: AtomicU64,
}

impl Default for WorkerLive {
    fn default() -> Self {
        WorkerLive {
            inflight: AtomicU32::new(0),
            pending_prefill_tokens: AtomicU64::new(0),
            replica_inflight: AtomicU32::new(0),
            replica_pending_prefill_tokens: AtomicU64::new(0),
            running: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            kv_usage_bits: AtomicU64::new(0f64.to_bits()),
            healthy: AtomicBool::new(true),
            consecutive_failures: AtomicU32::new(0),
            probe_failures: AtomicU32::new(0),
            request_ejections: AtomicU32::new(0),
            held_until_ms: AtomicU64::new(0),
            last_report_ms: AtomicU64::new(0),
            last_sync_ms: AtomicU64::new(0),
            last_probe_ok_ms: AtomicU64::new(0),
            last_progress_ms: AtomicU64::new(0),
            last_blocks_ms: AtomicU64::new(0),
            moved_ms: AtomicU64::new(0),
            tokenizer_checked: AtomicBool::new(false),
            tokenizer_checking: AtomicBool::new(false),
            probing: AtomicBool::new(false),
            probe_due: AtomicBool::new(false),
            tokenizer_retry_ms: AtomicU64::new(0),
            conflict_logged_ms: AtomicU64::new(0),
            has_sidecar: AtomicBool::new(false),
            watch: Mutex::new(ReportWatch::default()),
            arrivals: Mutex::new(ArrivalRate::default()),
            pace: Mutex::new(Pace::default()),
            capacity_blocks: AtomicU64::new(0),
        }
    }
}

impl WorkerLive {
    /// Takes the engine's reported load at `now_ms`; returns how many of its
    /// requests no router this one hears from accounts for
    /// ([`crate::policy::ForeignTraffic`]).
    pub fn set_reported(&self, load: &Load, now_ms: u64) -> u32 {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        self.kv_usage_bits.store(load.kv_usage.to_bits(), Ordering::Relaxed);
        let routed =
            self.inflight.load(Ordering::Relaxed).saturating_add(self.replica_inflight.load(Ordering::Relaxed));
        self.watch.lock().report(load.running, load.waiting, load.kv_usage, routed, now_ms)
    }

    /// The engine's KV cache in blocks, if it published it.
    pub fn capacity_blocks(&self) -> Option<u64> {
        match self.capacity_blocks.load(Ordering::Relaxed) {
            0 | u64::MAX => None,
            blocks => Some(blocks),
        }
    }

    /// Has the engine's `/metrics` been read for its capacity (whether or
    /// not it published one)?
    pub fn capacity_read(&self) -> bool {
        self.capacity_blocks.load(Ordering::Relaxed) != 0
    }

    /// What the engine's `/metrics` said of its capacity; `forget` (a
    /// worker re-admitted, perhaps restarted with another configuration)
    /// has it read again.
    pub fn set_capacity_blocks(&self, blocks: Option<u64>) {
        self.capacity_blocks.store(blocks.filter(|&b| b > 0).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Forgets the engine's last reported load: its sidecar stopped
    /// reporting, and figures that no push will refresh would make the
    /// worker look as loaded as it was then, for as long as it stays
    /// routable (the spill gate, foreign queue and KV knee all read them).
    /// The worker is then weighed by this router's own requests, as one
    /// without a sidecar is.
    pub fn forget_reported(&self) {
        self.running.store(0, Ordering::Relaxed);
        self.waiting.store(0, Ordering::Relaxed);
        self.kv_usage_bits.store(0f64.to_bits(), Ordering::Relaxed);
        *self.watch.lock() = ReportWatch::default();
    }

    /// Its registration moved from `from` to `to` (URL, rank): logged, and
    /// as an error when it moved within the last minute too (at most every
    /// 10 s): two sidecars reporting under one worker id (data-parallel ranks
    /// given the same `--worker-id`) move it back and forth with every sync,
    /// each sync refused the other's next push, up to ten full syncs a
    /// second, and the router said nothing.
    fn note_moved(&self, id: &WorkerId, from: (&str, Option<u32>), to: (&str, Option<u32>)) -> Moved {
        let now = crate::state::now_ms();
        let previous = self.moved_ms.swap(now, Ordering::Relaxed);
        if previous == 0 || now.saturating_sub(previous) > 60_000 {
            tracing::info!(worker.id = %id, from = from.0, from_rank = from.1, to = to.0, to_rank = to.1, "worker moved");
            Moved::Once
        } else if now.saturating_sub(self.conflict_logged_ms.load(Ordering::Relaxed)) > 10_000 {
            self.conflict_logged_ms.store(now, Ordering::Relaxed);
            tracing::error!(
                worker.id = %id, from = from.0, from_rank = from.1, to = to.0, to_rank = to.1,
                "worker moves back and forth: two sidecars report under this worker id (give each engine, and each data-parallel rank, its own --worker-id)"
            );
            Moved::BackAndForth
        } else {
            Moved::BackAndForthLogged
        }
    }

    pub fn forget_capacity(&self) {
        self.capacity_blocks.store(0, Ordering::Relaxed);
    }

    /// One of this router's requests there ended at `now_ms`.
    pub fn record_end(&self, now_ms: u64) {
        self.watch.lock().ended(now_ms);
        self.inflight.fetch_sub(1, Ordering::Relaxed);
    }

    /// A request was sent there at `now_ms`.
    pub fn record_arrival(&self, now_ms: u64) {
        self.arrivals.lock().record(now_ms);
    }

    /// A streamed answer's first token came `measured_us` after dispatch;
    /// the timing model predicted `predicted_us`.
    pub fn record_first_token(&self, measured_us: f64, predicted_us: f64) {
        self.pace.lock().record(measured_us, predicted_us);
    }

    /// The worker's load as of `now_ms` (unix ms): this router's figures
    /// with the other replicas' added, and its cache fill with the index
    /// holding `held_blocks` of its blocks.
    pub fn load(&self, now_ms: u64, held_blocks: usize) -> LoadView {
        let others_pending = self.replica_pending_prefill_tokens.load(Ordering::Relaxed);
        LoadView {
            inflight: self.inflight.load(Ordering::Relaxed),
            pending_prefill_tokens: self.pending_prefill_tokens.load(Ordering::Relaxed).saturating_add(others_pending),
            replica_pending_prefill_tokens: others_pending,
            replica_inflight: self.replica_inflight.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_usage: f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed)),
            arrival_rate: self.arrivals.lock().at(now_ms),
            pace: self.pace.lock().get(),
            held_blocks: held_blocks as u64,
            capacity_blocks: self.capacity_blocks(),
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// Stable across routers and restarts: the first 8 bytes of SHA-256(id).
pub fn id_hash(id: &WorkerId) -> u64 {
    let d = Sha256::digest(id.as_str().as_bytes());
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error("this router already indexes {MAX_WORKERS} workers")]
    Full,
    #[error("worker {0} is not registered and its sync carries no url")]
    NoUrl(WorkerId),
    #[error("url {url:?} is not an http:// or https:// URL with a host: {why}")]
    BadUrl { url: String, why: String },
}

/// A worker's base URL, checked and normalised (no trailing `/`): `http(s)`,
/// a host, no credentials, query or fragment
/// ([`kvroute_shared::wire::check_http_url`], the sidecar's rule too).
pub fn checked_url(url: &str) -> Result<String, RegistryError> {
    kvroute_shared::wire::check_http_url(url)
        .map_err(|why| RegistryError::BadUrl { url: url.chars().take(200).collect(), why })
}

/// Where a worker's requests go: a base URL and, for a data-parallel rank
/// behind a URL that serves every rank, that rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target<'a> {
    pub url: &'a str,
    pub dp_rank: Option<u32>,
}

impl<'a> From<&'a str> for Target<'a> {
    fn from(url: &'a str) -> Self {
        Target { url, dp_rank: None }
    }
}

/// What a registration changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upsert {
    Added,
    Updated,
    Unchanged,
}

#[derive(Debug, Default)]
pub struct Registry {
    snapshot: ArcSwap<Vec<Arc<Worker>>>,
    /// Serialises writers (readers never take it) and holds the next generation.
    write: Mutex<u64>,
}

impl Registry {
    pub fn snapshot(&self) -> Arc<Vec<Arc<Worker>>> {
        self.snapshot.load_full()
    }

    pub fn get(&self, id: &WorkerId) -> Option<Arc<Worker>> {
        self.snapshot.load().iter().find(|w| &w.id == id).cloned()
    }

    /// Is this snapshot's copy of a worker still the registered one (same
    /// registration, possibly with a newer url or models)? Stable only while
    /// the index lock is held, as every registry change happens under it.
    pub fn is_current(&self, worker: &Worker) -> bool {
        self.snapshot.load().iter().any(|w| w.id == worker.id && w.generation == worker.generation)
    }

    /// The sidecar-registered worker whose last report is oldest: the one a
    /// registration may take the slot of when every slot is taken.
    pub fn longest_silent_sidecar(&self) -> Option<Arc<Worker>> {
        self.snapshot
            .load()
            .iter()
            .filter(|w| w.source == Source::Sidecar)
            .min_by_key(|w| w.live.last_report_ms.load(Ordering::Relaxed))
            .cloned()
    }

    /// Adds a worker, or updates its url / models (keeping its slot, generation
    /// and live figures). Outside start-up, call it through
    /// `MapState::register_sidecar`, which also resets the slot's index and seqs.
    pub fn upsert(
        &self,
        id: &WorkerId,
        target: Option<Target<'_>>,
        served: Option<Served<'_>>,
        source: Source,
    ) -> Result<(Arc<Worker>, Upsert), RegistryError> {
        let mut next_generation = self.write.lock();
        let current = self.snapshot.load_full();
        let mut next: Vec<Arc<Worker>> = current.iter().cloned().collect();
        let target = target.map(|e| checked_url(e.url).map(|url| (url, e.dp_rank))).transpose()?;
        if let Some(pos) = next.iter().position(|w| &w.id == id) {
            let old = &next[pos];
            // A static worker's target (URL and rank) is the operator's: a push never moves it.
            let (url, dp_rank) = match target {
                Some((u, r)) if old.source == Source::Static && (u != old.url || r != old.dp_rank) => {
                    tracing::warn!(worker.id = %id, pushed = %u, kept = %old.url, "ignoring a pushed URL for a static worker");
                    (old.url.clone(), old.dp_rank)
                }
                Some(e) => e,
                None => (old.url.clone(), old.dp_rank),
            };
            let models = served.map_or_else(|| old.models.clone(), |s| s.models.to_vec());
            let aliases = served.map_or_else(|| old.aliases.clone(), |s| s.aliases.clone());
            if url == old.url && dp_rank == old.dp_rank && models == old.models && aliases == old.aliases {
                return Ok((old.clone(), Upsert::Unchanged));
            }
            if url != old.url || dp_rank != old.dp_rank {
                let _ = old.live.note_moved(id, (&old.url, old.dp_rank), (&url, dp_rank));
            }
            // Another engine or model: its tokenizer is compared again.
            old.live.tokenizer_checked.store(false, Ordering::Relaxed);
            let updated = Arc::new(Worker {
                id: old.id.clone(),
                slot: old.slot,
                generation: old.generation,
                url,
                dp_rank,
                models,
                aliases,
                source: old.source,
                id_hash: old.id_hash,
                live: old.live.clone(),
            });
            next[pos] = updated.clone();
            self.snapshot.store(Arc::new(next));
            return Ok((updated, Upsert::Updated));
        }
        let (url, dp_rank) = target.ok_or_else(|| RegistryError::NoUrl(id.clone()))?;
        if let Some(twin) = next.iter().find(|w| w.source == Source::Static && w.url == url && w.dp_rank == dp_rank) {
            // Kept (the operator may be moving from static workers to
            // sidecars), but the engine is now two workers, each with half
            // its traffic and one of them routed without its cache.
            tracing::error!(
                worker.id = %id, static_worker = %twin.id, url = %url,
                "a sidecar registered an engine that is also a static worker: remove the --worker entry"
            );
        }
        let slot = (0..MAX_WORKERS as u16)
            .map(Slot)
            .find(|s| !next.iter().any(|w| w.slot == *s))
            .ok_or(RegistryError::Full)?;
        let generation = *next_generation;
        *next_generation += 1;
        let worker = Arc::new(Worker {
            id: id.clone(),
            slot,
            generation,
            url,
            dp_rank,
            models: served.map(|s| s.models.to_vec()).unwrap_or_default(),
            aliases: served.map(|s| s.aliases.clone()).unwrap_or_default(),
            source,
            id_hash: id_hash(id),
            live: Arc::new(WorkerLive::default()),
        });
        next.push(worker.clone());
        next.sort_by(|a, b| a.id.cmp(&b.id));
        self.snapshot.store(Arc::new(next));
        Ok((worker, Upsert::Added))
    }

    /// Removes this registration of the worker; false if it is gone already
    /// (a registration of the same id since is left alone). Call it through
    /// `MapState::remove`, which also empties the slot.
    pub fn remove(&self, worker: &Worker) -> bool {
        let _w = self.write.lock();
        let current = self.snapshot.load_full();
        let is_it = |w: &Arc<Worker>| w.id == worker.id && w.generation == worker.generation;
        if !current.iter().any(is_it) {
            return false;
        }
        let next: Vec<Arc<Worker>> = current.iter().filter(|w| !is_it(w)).cloned().collect();
        self.snapshot.store(Arc::new(next));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upsert_keeps_slot_and_live_figures() {
        let r = Registry::default();
        let id = WorkerId::new("w1");
        let (w, how) = r.upsert(&id, Some("http://a/".into()), None, Source::Sidecar).unwrap();
        assert_eq!((how, w.url.as_str()), (Upsert::Added, "http://a"));
        w.live.inflight.store(3, Ordering::Relaxed);
        let (w2, how) = r
            .upsert(&id, Some("http://b".into()), Some(Served::names(&[ModelName::new("m")])), Source::Sidecar)
            .unwrap();
        assert_eq!(how, Upsert::Updated);
        assert_eq!(w2.slot, w.slot);
        assert_eq!(w2.live.inflight.load(Ordering::Relaxed), 3);
        assert!(w2.serves("m") && !w2.serves("other"));
        assert_eq!(r.upsert(&id, None, None, Source::Sidecar).unwrap().1, Upsert::Unchanged);
    }

    /// A registration that moves back and forth (two sidecars under one
    /// id) is told from one that moved once, and the error is not repeated
    /// at every sync.
    #[test]
    fn a_registration_moving_back_and_forth_is_an_error_logged_now_and_then() {
        let live = WorkerLive::default();
        let id = WorkerId::new("w1");
        let (a, b) = (("http://a", None), ("http://b", None));
        assert_eq!(live.note_moved(&id, a, b), Moved::Once);
        assert_eq!(live.note_moved(&id, b, a), Moved::BackAndForth);
        assert_eq!(live.note_moved(&id, a, b), Moved::BackAndForthLogged);
        live.moved_ms.store(crate::state::now_ms() - 61_000, Ordering::Relaxed);
        assert_eq!(live.note_moved(&id, b, a), Moved::Once, "a minute later it is news again");
    }

    #[test]
    fn slots_are_reused_and_urls_required() {
        let r = Registry::default();
        let (a, _) = r.upsert(&WorkerId::new("a"), Some("http://a".into()), None, Source::Static).unwrap();
        assert!(r.remove(&a));
        let (b, _) = r.upsert(&WorkerId::new("b"), Some("http://b".into()), None, Source::Static).unwrap();
        assert_eq!(a.slot, b.slot);
        assert_ne!(a.generation, b.generation);
        assert_eq!(
            r.upsert(&WorkerId::new("c"), None, None, Source::Sidecar).unwrap_err(),
            RegistryError::NoUrl(WorkerId::new("c"))
        );
    }

    #[test]
    fn removal_takes_only_the_registration_it_names() {
        let r = Registry::default();
        let id = WorkerId::new("a");
        let (old, _) = r.upsert(&id, Some("http://a".into()), None, Source::Sidecar).unwrap();
        assert!(r.remove(&old));
        let (new, _) = r.upsert(&id, Some("http://a".into()), None, Source::Sidecar).unwrap();
        assert!(!r.is_current(&old) && r.is_current(&new));
        assert!(!r.remove(&old), "a stale copy of the old registration removes nothing");
        assert!(r.get(&id).is_some());
        // An update keeps the registration: a copy from before it is current.
        let (moved, how) = r.upsert(&id, Some("http://b".into()), None, Source::Sidecar).unwrap();
        assert_eq!((how, moved.generation), (Upsert::Updated, new.generation));
        assert!(r.is_current(&new));
    }
}
