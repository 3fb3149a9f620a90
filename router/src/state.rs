//! Everything the router's handlers share.
//!
//! The index sits behind one `parking_lot::RwLock`: matching (every request)
//! takes the read side for a few microseconds; events, syncs and speculative
//! records take the write side for microseconds (a 100 k-key sync for a few
//! milliseconds, see BENCHMARKS.md). A single-owner task fed by a channel
//! would add a hop to every request's match for no gain at these hold times.
//!
//! The same lock makes membership atomic (see [`MapState`]): a worker's
//! registration, its index entries and its seq state change in one critical
//! section, never one after another where a push can slip in between.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_shared::WorkerId;
use kvroute_shared::tokenize::PromptTokenizer;
use parking_lot::RwLock;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::index::{Index, Slot};
use crate::metrics::Metrics;
use crate::policy::{ForeignTraffic, Policy};
use crate::replicas::Replicas;
use crate::sessions::Sessions;
use crate::workers::{Registry, RegistryError, Served, Source, Target, Upsert, Worker};

/// The last (epoch, seq) applied per worker: reordered or duplicated sidecar
/// batches are dropped.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SeqState {
    pub epoch: Option<String>,
    pub seq: Option<u64>,
}

impl SeqState {
    /// Accepts (and records) a message unless it is not newer than the last
    /// one of the same epoch.
    pub fn accept(&mut self, epoch: Option<&str>, seq: Option<u64>) -> bool {
        self.accept_as(epoch, seq, false)
    }

    /// As [`SeqState::accept`]; a full sync (`is_sync`) is also accepted from
    /// an epoch older than the one held. A delta from an older epoch is a
    /// replayed or forged push and is refused; a sync replaces the worker's
    /// whole state, and refusing it would lock out a sidecar whose clock is
    /// behind its predecessor's (a pod rescheduled on another node): its
    /// stale reply → new epoch → sync loop would never end.
    pub fn accept_as(&mut self, epoch: Option<&str>, seq: Option<u64>, is_sync: bool) -> bool {
        if !self.admits(epoch, seq, is_sync) {
            return false;
        }
        if let Some(seq) = seq {
            self.epoch = epoch.map(str::to_owned);
            self.seq = Some(seq);
        }
        true
    }

    /// Would [`SeqState::accept_as`] accept this message? Records nothing.
    pub fn admits(&self, epoch: Option<&str>, seq: Option<u64>, is_sync: bool) -> bool {
        let Some(seq) = seq else { return true };
        if self.epoch.as_deref() == epoch && self.seq.is_some_and(|last| seq <= last) {
            return false;
        }
        // Ordered epochs (20 hex digits, draw time first). Older sidecars'
        // random epochs are not ordered.
        !matches!(
            (self.epoch.as_deref(), epoch),
            (Some(held), Some(new)) if !is_sync && held.len() == 20 && new.len() == 20 && new < held
        )
    }
}

/// When every slot is taken, a sidecar registration takes the slot of the
/// sidecar-registered worker silent longest, once it has been silent this
/// long: four missed heartbeats (a live sidecar pushes at least every 500 ms,
/// `kvroute_sidecar::push::HEARTBEAT`), well under `worker_expiry`.
///
/// Who a registration flood can lock out:
/// - static workers (`--worker`) never: they take their slots at start-up and
///   are never expired or reclaimed;
/// - workers with their own token (`worker_tokens_file`) never, as long as
///   static workers plus listed ids fit in `MAX_WORKERS`: with per-worker
///   tokens only the listed ids can register at all (`internal::authorize_for`),
///   and the shared token is refused;
/// - with the shared token, every holder is trusted alike and ids are not
///   told apart: fakes that keep reporting hold their slots until they stop;
///   fakes that registered once give their slot to the next newcomer after
///   this silence (and, unless their url answers health probes, leave at
///   `worker_expiry` anyway). Deployments where not every pusher is trusted
///   use per-worker tokens.
///
/// Silence is the sidecar's: a worker whose sidecar died but whose engine
/// serves on (kept, indexed approximately, see `health`) can give its slot
/// to a newcomer whose sidecar reports.
pub const RECLAIM_AFTER_SILENCE: Duration = Duration::from_secs(2);

/// Membership and the cache map, changed together under one lock: the index,
/// the (epoch, seq) table and, through the methods below, the worker
/// registry, whose snapshot is only ever swapped while this state is locked
/// for writing (`build_state` excepted, before anything is served).
///
/// Whatever changes a slot — a batch, a sync, an expiry, an ejection — first
/// checks under that same lock that its worker is still the slot's member
/// ([`MapState::is_member`], by registration generation): a late batch from
/// a removed worker, or a removal decided from an old snapshot, cannot touch
/// the worker that has taken the slot since.
#[derive(Debug, Default)]
pub struct MapState {
    pub index: Index,
    /// Per slot, reset whenever the slot changes hands.
    seqs: HashMap<Slot, SeqState>,
}

/// What [`MapState::register_sidecar`] did.
#[derive(Debug)]
pub struct Registered {
    pub worker: Arc<Worker>,
    pub how: Upsert,
    /// The silent worker whose slot was taken, when every slot was.
    pub reclaimed: Option<Arc<Worker>>,
}

impl MapState {
    /// Is `worker` (from some registry snapshot) still registered, as the
    /// same registration? Holding `&self` means holding the lock, under which
    /// the answer cannot change.
    pub fn is_member(&self, registry: &Registry, worker: &Worker) -> bool {
        registry.is_current(worker)
    }

    /// The seq state of the slot's current member.
    pub fn seq(&mut self, slot: Slot) -> &mut SeqState {
        self.seqs.entry(slot).or_default()
    }

    /// Registers a worker a sidecar reports for, or updates its url and
    /// models. A new worker starts with an empty slot and seq state, and
    /// counts as reporting from `now_ms` (so it expires if it goes silent).
    /// When every slot is taken, the longest-silent sidecar-registered worker
    /// gives up its slot if silent for [`RECLAIM_AFTER_SILENCE`].
    pub fn register_sidecar(
        &mut self,
        registry: &Registry,
        id: &WorkerId,
        target: Option<Target<'_>>,
        served: Option<Served<'_>>,
        now_ms: u64,
    ) -> Result<Registered, RegistryError> {
        let mut reclaimed = None;
        let (worker, how) = match registry.upsert(id, target, served, Source::Sidecar) {
            Err(RegistryError::Full) => {
                let silence = RECLAIM_AFTER_SILENCE.as_millis() as u64;
                let victim = registry
                    .longest_silent_sidecar()
                    .filter(|w| now_ms.saturating_sub(w.live.last_report_ms.load(Ordering::Relaxed)) > silence)
                    .ok_or(RegistryError::Full)?;
                self.remove(registry, &victim);
                reclaimed = Some(victim);
                registry.upsert(id, target, served, Source::Sidecar)?
            }
            other => other?,
        };
        if how == Upsert::Added {
            // Whatever a previous member, a late push or a stale plan left in
            // the slot is not this worker's.
            self.index.remove_worker(worker.slot);
            self.seqs.remove(&worker.slot);
            worker.live.has_sidecar.store(true, Ordering::Relaxed);
            worker.live.last_report_ms.store(now_ms, Ordering::Relaxed);
        }
        Ok(Registered { worker, how, reclaimed })
    }

    /// Removes this registration of `worker` with its index entries and seq
    /// state, at once (a reclaimed slot is given to its next worker under the
    /// same lock); false (nothing changed) if it is not a member any more.
    /// [`AppState::remove_in_chunks`] drops the entries a chunk per lock.
    pub fn remove(&mut self, registry: &Registry, worker: &Worker) -> bool {
        if !registry.remove(worker) {
            return false;
        }
        self.index.remove_worker(worker.slot);
        self.seqs.remove(&worker.slot);
        true
    }
}

impl AppState {
    /// Drops `slot`'s index entries [`SYNC_WRITE_CHUNK`] at a time, taking
    /// the write lock again between chunks while `still(map)` holds; the
    /// guard once none are left (`None` if `still` failed first). Clearing a
    /// worker of a million keys under one hold stopped every routing
    /// decision for a few hundred milliseconds, and it happens when a worker
    /// is ejected or its sidecar goes quiet: when the cluster is already
    /// degraded. Between chunks the worker holds part of its keys, each still
    /// one its engine held.
    ///
    /// [`SYNC_WRITE_CHUNK`]: crate::internal::SYNC_WRITE_CHUNK
    pub fn clear_in_chunks<'a>(
        &'a self,
        mut map: parking_lot::RwLockWriteGuard<'a, MapState>,
        slot: Slot,
        still: impl Fn(&MapState) -> bool,
    ) -> Option<parking_lot::RwLockWriteGuard<'a, MapState>> {
        while map.index.clear_some(slot, crate::internal::SYNC_WRITE_CHUNK) {
            drop(map);
            map = self.map.write();
            if !still(&map) {
                return None;
            }
        }
        Some(map)
    }

    /// [`MapState::remove`], its index entries dropped a chunk per lock
    /// ([`Self::clear_in_chunks`]) once `worker` is out of the registry (no
    /// longer routed to), unless its slot is taken again meanwhile (the new
    /// worker's registration clears what is left); false if it is not a
    /// member any more.
    pub fn remove_in_chunks(&self, map: parking_lot::RwLockWriteGuard<'_, MapState>, worker: &Worker) -> bool {
        if !self.workers.remove(worker) {
            return false;
        }
        let slot = worker.slot;
        let free = |_: &MapState| !self.workers.snapshot().iter().any(|w| w.slot == slot);
        if let Some(mut map) = self.clear_in_chunks(map, slot, free) {
            map.index.remove_worker(slot);
            map.seqs.remove(&slot);
        }
        true
    }
}

/// Full syncs applied concurrently (see [`AppState::sync_slots`]).
pub const SYNCS_AT_ONCE: usize = 8;

/// Tokenizers by served model name, with a default for other models.
#[derive(Debug)]
pub struct Tokenizers {
    pub by_model: BTreeMap<String, Arc<PromptTokenizer>>,
    pub default: Arc<PromptTokenizer>,
}

impl Tokenizers {
    pub fn for_model(&self, model: &str) -> &Arc<PromptTokenizer> {
        self.named(model).unwrap_or(&self.default)
    }

    /// The tokenizer given for `model` by name (`--model-tokenizer`), if any.
    pub fn named(&self, model: &str) -> Option<&Arc<PromptTokenizer>> {
        self.by_model.get(model)
    }
}

#[derive(Debug)]
pub struct AppState {
    pub config: Config,
    pub workers: Registry,
    pub map: RwLock<MapState>,
    pub tokenizers: Tokenizers,
    pub policy: Box<dyn Policy>,
    pub metrics: Metrics,
    pub sessions: Sessions,
    /// What the other replicas last reported (`crate::replicas`).
    pub replicas: Replicas,
    /// Requests the workers report that no router this one hears from sent.
    pub foreign: ForeignTraffic,
    pub client: reqwest::Client,
    /// Random per process start: sidecars resync at once when it changes.
    pub router_epoch: String,
    pub concurrency: Arc<Semaphore>,
    /// Client requests whose bodies are being read, before they take a
    /// concurrency slot: [`READING_PER_SLOT`] × `max_concurrent_requests`.
    pub reading: Arc<Semaphore>,
    /// Bytes of client bodies, from their first byte until their answer
    /// begins (`max_body_bytes_in_flight`).
    pub body_bytes: Arc<Semaphore>,
    /// Rendering + tokenizing jobs on the blocking pool at once: one per core.
    pub tokenize_slots: Arc<Semaphore>,
    /// Mean prompt tokens (EWMA, f64 bits), turning request counts into tokens.
    mean_prompt_tokens: AtomicU64,
    /// Mean uncached tokens of recent requests where they were sent (EWMA).
    mean_uncached_tokens: AtomicU64,
    pub started: Instant,
    pub shutdown: CancellationToken,
    /// Cancelled once the server has stopped, its requests drained (after
    /// `shutdown`): the replica exchange runs until then, so the other
    /// replicas keep counting what a draining router still has in flight.
    pub drained: CancellationToken,
    /// A stop was asked for: `/ready` answers 503 while the router drains
    /// (`drain_delay`, then `shutdown_grace`).
    pub draining: AtomicBool,
    /// The shutdown grace is over: every answer still streaming ends now,
    /// with an error event (not cut mid-body when the runtime ends).
    pub cut: CancellationToken,
    /// One full sync per worker id at a time (`internal::sync`): a sync is
    /// applied in chunks, and two of one worker's must not interleave.
    sync_gates: parking_lot::Mutex<HashMap<WorkerId, Arc<tokio::sync::Mutex<()>>>>,
    /// Full syncs applied at once, across workers: each holds its key set
    /// in a hash set while it is diffed (~40 MB per million keys), so a
    /// registration storm after a restart queues here instead of holding
    /// every worker's set in memory together.
    pub sync_slots: Arc<Semaphore>,
}

/// Client requests reading their bodies at once, per concurrency slot. A
/// body is read before its request takes a slot (a slow sender must not
/// hold one), and the byte budget counts only bytes that arrived: an
/// HTTP/2 client opening streams that send headers and no body held a task
/// and a header map per stream, 200 streams a connection on 10,000
/// connections, none of it counted anywhere. Past this, such a request is
/// shed (503) before its body is read.
pub const READING_PER_SLOT: usize = 4;

impl AppState {
    pub fn new(config: Config, tokenizers: Tokenizers, shutdown: CancellationToken, client: reqwest::Client) -> Self {
        let policy = config.policy.build();
        let metrics = Metrics::for_policy(policy.name());
        let concurrency = Arc::new(Semaphore::new(config.raw.max_concurrent_requests));
        let reading = Arc::new(Semaphore::new(
            config.raw.max_concurrent_requests.saturating_mul(READING_PER_SLOT).min(Semaphore::MAX_PERMITS),
        ));
        let body_bytes = Arc::new(Semaphore::new(config.raw.max_body_bytes_in_flight.min(Semaphore::MAX_PERMITS)));
        let sessions = Sessions::new(config.raw.max_sessions);
        AppState {
            workers: Registry::default(),
            map: RwLock::new(MapState::default()),
            tokenizers,
            policy,
            metrics,
            sessions,
            replicas: Replicas::new(config.raw.replica_exchange_interval),
            foreign: ForeignTraffic::default(),
            client,
            router_epoch: format!("{:016x}", rand::random::<u64>()),
            concurrency,
            reading,
            body_bytes,
            tokenize_slots: Arc::new(Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))),
            mean_prompt_tokens: AtomicU64::new(512f64.to_bits()),
            mean_uncached_tokens: AtomicU64::new(512f64.to_bits()),
            started: Instant::now(),
            shutdown,
            drained: CancellationToken::new(),
            draining: AtomicBool::new(false),
            cut: CancellationToken::new(),
            config,
            sync_gates: Default::default(),
            sync_slots: Arc::new(Semaphore::new(SYNCS_AT_ONCE)),
        }
    }

    /// The gate a full sync for `id` holds while it is applied. Gates nobody
    /// holds or waits for are dropped on the way, so ids that stopped
    /// syncing cost nothing.
    pub fn sync_gate(&self, id: &WorkerId) -> Arc<tokio::sync::Mutex<()>> {
        let mut gates = self.sync_gates.lock();
        gates.retain(|_, g| Arc::strong_count(g) > 1);
        gates.entry(id.clone()).or_default().clone()
    }

    pub fn mean_prompt_tokens(&self) -> f64 {
        f64::from_bits(self.mean_prompt_tokens.load(Ordering::Relaxed))
    }

    /// Is this router, as far as it knows at `now_ms`, the only one sending
    /// to its workers ([`crate::policy::RouteView::sole_router`])?
    pub fn sole_router(&self, now_ms: u64) -> bool {
        self.replicas.heard() == 0 && !self.foreign.seen(now_ms)
    }

    /// Does this router, as far as it knows at `now_ms`, count every
    /// router's requests in its workers' loads
    /// ([`crate::policy::RouteView::routers_counted`])? The sole router
    /// does, and so does one whose replicas report to it (their reports'
    /// lag shows as foreign traffic now and then, which is not another
    /// router's).
    pub fn routers_counted(&self, now_ms: u64) -> bool {
        self.replicas.heard() > 0 || !self.foreign.seen(now_ms)
    }

    /// A worker's engine reported `unaccounted` requests no router this one
    /// hears from sent. The first time in a while, it says so: replicas
    /// that do not exchange route on views that lag.
    pub fn observe_foreign(&self, worker: &WorkerId, unaccounted: u32) {
        if unaccounted == 0 {
            return;
        }
        self.metrics.foreign_reports.inc();
        if self.foreign.observe(unaccounted, now_ms()) && !self.replicas.exchanging() {
            tracing::warn!(
                worker.id = %worker,
                unaccounted,
                "the engine reports requests this router did not send: another router (configure replicas so that they exchange) or clients that bypass the routers"
            );
        }
    }

    pub fn mean_uncached_tokens(&self) -> f64 {
        f64::from_bits(self.mean_uncached_tokens.load(Ordering::Relaxed))
    }

    /// Folds one request's prompt size, and the part of it left uncached
    /// where it was sent, into the moving means (racy updates lose a sample
    /// at worst; they are estimates).
    pub fn observe_prompt_tokens(&self, tokens: usize, uncached: u64) {
        let fold = |mean: &AtomicU64, x: f64| {
            let old = f64::from_bits(mean.load(Ordering::Relaxed));
            mean.store((old * 0.95 + x * 0.05).to_bits(), Ordering::Relaxed);
        };
        fold(&self.mean_prompt_tokens, tokens as f64);
        fold(&self.mean_uncached_tokens, uncached as f64);
    }
}

/// The router's clock, in milliseconds since the Unix epoch: the wall clock
/// read once, at its first use, and advanced by the monotonic clock since.
/// Every timing of the router's own (liveness, holds, speculative entries,
/// sessions) is a difference of two readings, so a wall clock stepped by NTP
/// or a resumed VM moves none of them: stepped forward 30 s, the system clock
/// took every idle sidecar's worker for silent at once; stepped back, it held
/// speculative entries and ejections that much longer. After a step it keeps
/// the old reckoning: what meets another process's clock (a v1 sidecar's
/// `as_of_ms`, an exported timestamp) goes through [`from_wall_ms`] and
/// [`to_wall_ms`].
pub fn now_ms() -> u64 {
    static CLOCK: std::sync::OnceLock<AnchoredClock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(AnchoredClock::system).at(Instant::now())
}

/// The wall clock now, ms since the Unix epoch.
fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A reading of [`now_ms`] as the wall clock tells it now: what is shown to
/// another process's clock (a timestamp Prometheus compares with `time()`).
pub fn to_wall_ms(ms: u64) -> u64 {
    shift(ms, now_ms(), wall_ms())
}

/// Another process's wall-clock time (a v1 sidecar's `as_of_ms`) on
/// [`now_ms`]'s reckoning.
pub fn from_wall_ms(ms: u64) -> u64 {
    shift(ms, wall_ms(), now_ms())
}

/// `ms`, read on a clock that says `from` now, on one that says `to`: as
/// long ago. A time ahead of `from` is taken as now.
fn shift(ms: u64, from: u64, to: u64) -> u64 {
    to.saturating_sub(from.saturating_sub(ms))
}

/// A wall-clock reading and the monotonic instant it was taken at.
#[derive(Clone, Copy, Debug)]
struct AnchoredClock {
    wall_ms: u64,
    at: Instant,
}

impl AnchoredClock {
    fn system() -> Self {
        AnchoredClock { wall_ms: wall_ms(), at: Instant::now() }
    }

    /// The time at `now`: the anchor's wall time plus the monotonic time since.
    fn at(&self, now: Instant) -> u64 {
        self.wall_ms + now.saturating_duration_since(self.at).as_millis() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a step of the wall clock the router's reckoning and the wall
    /// clock differ: a time goes from one to the other as long ago.
    #[test]
    fn times_go_between_the_routers_clock_and_the_wall_clock_as_long_ago() {
        // The router's clock reads 1_000_000, the wall clock (stepped 30 s
        // forward) 1_030_000.
        let (router, wall) = (1_000_000, 1_030_000);
        assert_eq!(shift(999_000, router, wall), 1_029_000, "a sync 1 s ago, exported");
        assert_eq!(shift(1_029_500, wall, router), 999_500, "a v1 as_of_ms 0.5 s ago, taken");
        assert_eq!(shift(1_040_000, wall, router), router, "ahead of the clock: now");
    }

    #[test]
    fn the_clock_moves_with_the_monotonic_clock_from_its_anchor() {
        let start = Instant::now();
        let clock = AnchoredClock { wall_ms: 1_000_000, at: start };
        assert_eq!(clock.at(start), 1_000_000);
        assert_eq!(clock.at(start + Duration::from_millis(2_500)), 1_002_500);
        // An instant before the anchor (none is) reads as the anchor.
        assert_eq!(clock.at(start.checked_sub(Duration::from_secs(1)).unwrap_or(start)), 1_000_000);
        // The process's clock starts at the wall clock and never goes back.
        let wall = || SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        let (before, a, after) = (wall(), now_ms(), wall());
        let b = now_ms();
        assert!(b >= a, "{b} < {a}");
        assert!(a + 60_000 >= before && a <= after + 60_000, "now_ms {a} far from the wall clock {before}..{after}");
    }

    #[test]
    fn seq_drops_reordered_and_duplicated_batches_within_an_epoch() {
        let mut s = SeqState::default();
        assert!(s.accept(Some("a"), Some(5)));
        assert!(!s.accept(Some("a"), Some(5)));
        assert!(!s.accept(Some("a"), Some(4)));
        assert!(s.accept(Some("a"), Some(6)));
        // A new epoch (sidecar restart) starts over.
        assert!(s.accept(Some("b"), Some(0)));
        // No seq: always applied (the paper's minimal body).
        assert!(s.accept(None, None));
    }

    #[test]
    fn ordered_epochs_never_go_back() {
        let (old, new) = ("0190000000000000aaaa", "0190000000010000bbbb");
        let mut s = SeqState::default();
        assert!(s.accept(Some(old), Some(7)));
        assert!(s.accept(Some(new), Some(8)), "a later epoch is a restart");
        assert!(!s.accept(Some(old), Some(u64::MAX)), "an earlier epoch's delta is a replay or a forgery");
        assert!(s.accept(Some(new), Some(9)));
        // A sync replaces everything: accepted even from an older epoch (a
        // sidecar whose clock is behind its predecessor's), and it then holds.
        let skewed = "018f000000000000cccc";
        assert!(s.accept_as(Some(skewed), Some(1), true));
        assert!(s.accept(Some(skewed), Some(2)));
    }

    fn sidecar(map: &mut MapState, r: &Registry, id: &str, now_ms: u64) -> Result<Registered, RegistryError> {
        map.register_sidecar(r, &WorkerId::new(id), Some("http://10.0.0.1:8000".into()), None, now_ms)
    }

    #[test]
    fn a_new_member_starts_with_an_empty_slot_and_seq() {
        let (mut map, r) = (MapState::default(), Registry::default());
        let a = sidecar(&mut map, &r, "a", 1_000).unwrap().worker;
        assert!(map.remove(&r, &a));
        // What a stale plan or a late push could leave in the free slot.
        map.index.record_routed(a.slot, &[kvroute_shared::BlockKey(7)], 2_000);
        assert!(map.seq(a.slot).accept(Some("0190000000010000bbbb"), Some(50)));
        let b = sidecar(&mut map, &r, "b", 3_000).unwrap();
        assert_eq!((b.how, b.worker.slot), (Upsert::Added, a.slot));
        assert_eq!(map.index.counts(b.worker.slot), crate::index::Counts::default());
        assert!(map.seq(b.worker.slot).accept(Some("0190000000000000aaaa"), Some(1)), "b's seqs are its own");
        assert_eq!(b.worker.live.last_report_ms.load(Ordering::Relaxed), 3_000, "silent from now on, it expires");
    }

    #[test]
    fn a_full_table_reclaims_the_longest_silent_sidecar_slot_never_a_static_one() {
        let (mut map, r) = (MapState::default(), Registry::default());
        let now = 100_000;
        let (stat, _) =
            r.upsert(&WorkerId::new("static"), Some("http://10.0.0.9:8000".into()), None, Source::Static).unwrap();
        let fakes: Vec<Arc<Worker>> = (0..crate::index::MAX_WORKERS - 1)
            .map(|i| sidecar(&mut map, &r, &format!("fake{i}"), now).unwrap().worker)
            .collect();
        // All reported half a second ago: a newcomer waits.
        assert_eq!(sidecar(&mut map, &r, "real", now + 500).unwrap_err(), RegistryError::Full);
        // Two went silent; the static worker never reported (it is oldest of all).
        fakes[5].live.last_report_ms.store(now - 10_000, Ordering::Relaxed);
        fakes[6].live.last_report_ms.store(now - 5_000, Ordering::Relaxed);
        map.index.apply_events(fakes[5].slot, false, &[], &[kvroute_shared::BlockKey(1)]);
        let real = sidecar(&mut map, &r, "real", now + 500).unwrap();
        assert_eq!(real.reclaimed.as_ref().map(|w| w.id.as_str()), Some("fake5"));
        assert_eq!(real.worker.slot, fakes[5].slot);
        assert_eq!(map.index.counts(real.worker.slot), crate::index::Counts::default());
        assert!(r.get(&WorkerId::new("fake5")).is_none());
        let next = sidecar(&mut map, &r, "real2", now + 500).unwrap();
        assert_eq!(next.reclaimed.map(|w| w.slot), Some(fakes[6].slot));
        assert_eq!(sidecar(&mut map, &r, "real3", now + 500).unwrap_err(), RegistryError::Full);
        assert!(r.is_current(&stat));
    }
}
