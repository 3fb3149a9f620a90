//! The worker's state: translation tables plus every router's pending delta,
//! behind one lock.
//!
//! Why one `parking_lot::Mutex` rather than a task fed by a channel: every
//! writer (the per-rank subscribers) and reader (the per-router pushers) needs
//! the translator and the pending maps *together* — a sync must read the key set
//! and reset that router's delta atomically, or a change could be lost or sent
//! twice. Critical sections are short: applying one batch (≈ 0.3 µs per block)
//! or copying the key set for a sync (≈ 1 ms per million keys; with protocol
//! v2 only on a digest mismatch or at the safety interval).
//! No lock is ever held across an `.await`.
//!
//! The same lock keeps the key set's digest ([`KeyDigest`], protocol v2)
//! current, so a delta and the digest it is sent with are always read
//! together.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_shared::{BlockKey, KeyDigest};
use parking_lot::Mutex;
use rand::Rng;
use tokio::sync::watch;

use crate::coalesce::{Delta, Pending};
use crate::decode::EventBatch;
use crate::metrics::Metrics;
use crate::translate::{KeySink, Rank, Reconciled, Translator};

/// Identifies this sidecar-and-engine incarnation to routers; a new one is
/// drawn at start, whenever the engine restarts or events were lost, and when
/// a router calls a push stale. Ordered: the draw time in milliseconds, then
/// 32 random bits, as fixed-width hex, so a later epoch compares greater.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Epoch(String);

impl Epoch {
    pub fn draw() -> Self {
        Self::at(WallClock::system().now_ms())
    }

    fn at(ms: u64) -> Self {
        Epoch(format!("{ms:012x}{:08x}", rand::thread_rng().r#gen::<u32>()))
    }

    /// A new epoch ordered after `self`, even within one millisecond or if
    /// the wall clock stepped back.
    pub fn next(&self, now_ms: u64) -> Self {
        let prev = self.0.get(..12).and_then(|h| u64::from_str_radix(h, 16).ok()).unwrap_or(0);
        Self::at(now_ms.max(prev + 1))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The sidecar's wall clock (ms since the Unix epoch), injectable so tests
/// can skew it. It stamps epochs, and `as_of_ms` only on links to v1
/// routers: protocol v2 never compares it with a router's clock.
#[derive(Clone)]
pub struct WallClock(Arc<dyn Fn() -> u64 + Send + Sync>);

impl WallClock {
    pub fn system() -> Self {
        WallClock(Arc::new(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)))
    }

    /// The system clock shifted by `skew_ms` (tests).
    pub fn skewed(skew_ms: i64) -> Self {
        let system = Self::system();
        WallClock(Arc::new(move || system.now_ms().saturating_add_signed(skew_ms)))
    }

    pub fn now_ms(&self) -> u64 {
        (self.0)()
    }
}

impl fmt::Debug for WallClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WallClock({})", self.now_ms())
    }
}

/// One router address the sidecar pushes to (a resolved base URL).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct RouterTarget(pub String);

/// What a full sync carries, read atomically with resetting the delta.
#[derive(Debug)]
pub struct SyncContent {
    pub epoch: Epoch,
    pub keys: Vec<BlockKey>,
    pub digest: KeyDigest,
    /// The sidecar's clock when the set was read (v1 links only).
    pub as_of_ms: u64,
}

#[derive(Debug)]
struct Inner {
    translator: Translator,
    routers: BTreeMap<RouterTarget, Pending>,
    epoch: Epoch,
    /// Digest of `translator`'s key set.
    digest: KeyDigest,
}

/// Forwards key changes to every router's pending delta and the digest.
struct Fanout<'a> {
    routers: &'a mut BTreeMap<RouterTarget, Pending>,
    digest: &'a mut KeyDigest,
}

impl KeySink for Fanout<'_> {
    fn stored(&mut self, key: BlockKey) {
        self.digest.insert(key);
        self.routers.values_mut().for_each(|p| p.stored(key));
    }
    fn evicted(&mut self, key: BlockKey) {
        self.digest.remove(key);
        self.routers.values_mut().for_each(|p| p.evicted(key));
    }
    fn cleared(&mut self) {
        *self.digest = KeyDigest::default();
        self.routers.values_mut().for_each(|p| p.cleared());
    }
}

/// Shared handle to the worker state.
#[derive(Debug)]
pub struct WorkerState {
    inner: Mutex<Inner>,
    metrics: Arc<Metrics>,
    max_pending: usize,
    /// Bumped when every router must get a full sync now (a rank reset):
    /// push tasks watch it and send at once instead of at their next tick.
    resync: watch::Sender<u64>,
    /// The engine's replay buffer has been read once (or there is none):
    /// what the engine cached before this sidecar started is in the set.
    caught_up: watch::Sender<bool>,
    clock: WallClock,
    /// What this state last added to the shared block and key gauges (the
    /// targets of a data-parallel engine share one sidecar's gauges).
    shown: (AtomicI64, AtomicI64),
}

impl WorkerState {
    pub fn new(translator: Translator, metrics: Arc<Metrics>, max_pending: usize) -> Self {
        Self::with_clock(translator, metrics, max_pending, WallClock::system())
    }

    pub fn with_clock(translator: Translator, metrics: Arc<Metrics>, max_pending: usize, clock: WallClock) -> Self {
        let digest = KeyDigest::of(translator.keys());
        WorkerState {
            inner: Mutex::new(Inner { translator, routers: BTreeMap::new(), epoch: Epoch::at(clock.now_ms()), digest }),
            metrics,
            max_pending,
            resync: watch::Sender::new(0),
            caught_up: watch::Sender::new(false),
            clock,
            shown: (AtomicI64::new(0), AtomicI64::new(0)),
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Applies a decoded batch from `rank`.
    pub fn apply(&self, rank: Rank, batch: &EventBatch) {
        self.metrics.event_batches.inc();
        self.metrics.unknown_fields.inc_by(u64::from(batch.unknown_fields));
        let mut inner = self.inner.lock();
        let Inner { translator, routers, digest, .. } = &mut *inner;
        let mut sink = Fanout { routers, digest };
        for event in &batch.events {
            translator.apply(rank, event, &mut sink);
        }
        self.update_gauges(translator);
    }

    /// Forgets `rank`'s blocks, draws a new epoch and has a full sync sent to
    /// every router at once (engine gone or restarted, or events lost beyond
    /// replay): until it arrives, routers send requests to blocks that may
    /// be gone, so it does not wait for the next fast-path tick.
    pub fn reset(&self, rank: Rank) {
        let mut inner = self.inner.lock();
        let Inner { translator, routers, epoch, digest } = &mut *inner;
        translator.clear_rank(rank, &mut Fanout { routers, digest });
        *epoch = epoch.next(self.clock.now_ms());
        routers.values_mut().for_each(Pending::require_sync);
        self.update_gauges(translator);
        drop(inner);
        self.resync.send_modify(|n| *n += 1);
    }

    /// The subscriber has read what the engine published before this
    /// sidecar started (its replay buffer), or found it has none to read.
    pub fn mark_caught_up(&self) {
        self.caught_up.send_replace(true);
    }

    /// Resolves once [`Self::mark_caught_up`] has been called.
    pub async fn caught_up(&self) {
        let _ = self.caught_up.subscribe().wait_for(|&done| done).await;
    }

    /// Changes whenever a full sync to every router is due at once.
    pub fn resync_due(&self) -> watch::Receiver<u64> {
        self.resync.subscribe()
    }

    /// A router refused a push as stale (its epoch/seq is ahead of ours: a
    /// replayed or forged push, or a seq that went back): continue under a
    /// new epoch, with a full sync to every router.
    pub fn renew_epoch(&self) {
        let mut inner = self.inner.lock();
        inner.epoch = inner.epoch.next(self.clock.now_ms());
        inner.routers.values_mut().for_each(Pending::require_sync);
    }

    /// Called with `inner` locked, so the swaps of one state never race.
    fn update_gauges(&self, translator: &Translator) {
        let (blocks, keys) = (translator.block_count() as i64, translator.key_count() as i64);
        self.metrics.tracked_blocks.inc_by(blocks - self.shown.0.swap(blocks, Ordering::Relaxed));
        self.metrics.tracked_keys.inc_by(keys - self.shown.1.swap(keys, Ordering::Relaxed));
    }

    pub fn epoch(&self) -> Epoch {
        self.inner.lock().epoch.clone()
    }

    /// Makes the router set exactly `targets`; new routers start with a sync.
    pub fn set_routers(&self, targets: &[RouterTarget]) {
        let mut inner = self.inner.lock();
        inner.routers.retain(|t, _| targets.contains(t));
        for t in targets {
            inner.routers.entry(t.clone()).or_insert_with(|| Pending::new(self.max_pending));
        }
    }

    /// Whether `target` is among the routers pushed to now.
    pub fn has_router(&self, target: &RouterTarget) -> bool {
        self.inner.lock().routers.contains_key(target)
    }

    pub fn require_sync(&self, target: &RouterTarget) {
        if let Some(p) = self.inner.lock().routers.get_mut(target) {
            p.require_sync();
        }
    }

    pub fn require_sync_all(&self) {
        self.inner.lock().routers.values_mut().for_each(Pending::require_sync);
    }

    pub fn needs_sync(&self, target: &RouterTarget) -> bool {
        self.inner.lock().routers.get(target).is_some_and(Pending::needs_sync)
    }

    /// Takes `target`'s net delta with the digest of the key set it leads
    /// to (`None` when it needs a sync instead, or is gone).
    pub fn take_delta(&self, target: &RouterTarget) -> Option<(Epoch, Delta, KeyDigest)> {
        let mut inner = self.inner.lock();
        let (epoch, digest) = (inner.epoch.clone(), inner.digest);
        let pending = inner.routers.get_mut(target)?;
        if pending.needs_sync() {
            return None;
        }
        Some((epoch, pending.take(), digest))
    }

    /// As [`WorkerState::take_delta`], plus the current state of every key
    /// of `target`'s last few deltas (a repair, protocol v2). `None` when
    /// `target` needs a sync, is gone, or nothing is remembered.
    pub fn take_repair(&self, target: &RouterTarget) -> Option<(Epoch, Delta, KeyDigest)> {
        let mut inner = self.inner.lock();
        let Inner { translator, routers, epoch, digest } = &mut *inner;
        let pending = routers.get_mut(target)?;
        if pending.needs_sync() {
            return None;
        }
        let delta = pending.take_repair(|k| translator.contains_key(k))?;
        Some((epoch.clone(), delta, *digest))
    }

    /// Reads the full key set for `target` and resets its delta, atomically.
    pub fn take_sync(&self, target: &RouterTarget) -> Option<SyncContent> {
        let mut inner = self.inner.lock();
        let Inner { translator, routers, epoch, digest } = &mut *inner;
        let pending = routers.get_mut(target)?;
        pending.sync_taken();
        let as_of_ms = self.clock.now_ms();
        Some(SyncContent { epoch: epoch.clone(), keys: translator.keys().collect(), digest: *digest, as_of_ms })
    }

    /// The digest of the key set (tests, health).
    pub fn digest(&self) -> KeyDigest {
        self.inner.lock().digest
    }

    /// Unsent changes held for `target` (tests and memory accounting).
    pub fn pending_len(&self, target: &RouterTarget) -> Option<usize> {
        self.inner.lock().routers.get(target).map(Pending::len)
    }

    pub fn begin_snapshot(&self) {
        self.inner.lock().translator.begin_snapshot();
    }

    /// Drops blocks of `rank` the engine's own snapshot no longer holds
    /// (more than half of them only when `confirmed`: see
    /// [`Translator::retain_engine_hashes`]).
    pub fn reconcile(&self, rank: Rank, held: &HashSet<u64>, confirmed: bool) -> Reconciled {
        let mut inner = self.inner.lock();
        let Inner { translator, routers, digest, .. } = &mut *inner;
        let done = translator.retain_engine_hashes(rank, held, confirmed, &mut Fanout { routers, digest });
        if let Reconciled::Dropped(n) = done {
            self.metrics.snapshot_dropped_blocks.inc_by(n as u64);
        }
        self.update_gauges(translator);
        done
    }

    /// Every key currently held (tests, health).
    pub fn keys(&self) -> Vec<BlockKey> {
        self.inner.lock().translator.keys().collect()
    }

    pub fn counts(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (inner.translator.block_count(), inner.translator.key_count())
    }
}

#[cfg(test)]
mod tests {
    use kvroute_shared::{BlockSize, ModelName};

    use super::*;
    use crate::decode::{BlockStored, EngineHash, KvEvent};

    fn store(hash: u64) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash::Int(hash)],
            parent_block_hash: None,
            token_ids: vec![hash as u32; 4],
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            remote: false,
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch { ts: 0.0, events, data_parallel_rank: None, encoding: None, unknown_fields: 0 }
    }

    #[test]
    fn an_unreachable_router_costs_no_memory_and_gets_a_full_sync() {
        let metrics = Arc::new(Metrics::new());
        let translator = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), metrics.translate.clone());
        let state = WorkerState::new(translator, metrics, 1000);
        let r = RouterTarget("http://r".into());
        state.set_routers(std::slice::from_ref(&r));
        assert!(state.take_sync(&r).unwrap().keys.is_empty());
        // A push failed: the router is marked for a sync and keeps no delta.
        state.require_sync(&r);
        for h in 0..10_000 {
            state.apply(Rank(0), &batch(vec![store(h)]));
        }
        assert_eq!(state.pending_len(&r), Some(0));
        assert!(state.take_delta(&r).is_none(), "no delta while a sync is due");
        let sync = state.take_sync(&r).unwrap();
        assert_eq!(sync.keys.len(), 10_000);
        assert!(!state.needs_sync(&r));
        state.apply(Rank(0), &batch(vec![store(20_000)]));
        assert_eq!(state.take_delta(&r).unwrap().1.stored.len(), 1);
    }

    #[test]
    fn the_digest_follows_the_key_set_through_stores_evictions_and_resets() {
        let metrics = Arc::new(Metrics::new());
        let translator = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), metrics.translate.clone());
        let state = WorkerState::new(translator, metrics, 1000);
        let r = RouterTarget("http://r".into());
        state.set_routers(std::slice::from_ref(&r));
        for h in 0..100 {
            state.apply(Rank(0), &batch(vec![store(h)]));
        }
        // A second copy of a block is no new key.
        state.apply(Rank(0), &batch(vec![store(5)]));
        let (_, _, digest) = state.take_delta(&r).unwrap_or_else(|| {
            state.take_sync(&r);
            state.take_delta(&r).unwrap()
        });
        assert_eq!(digest, KeyDigest::of(state.keys()));
        assert_eq!(digest.count, 100);
        let sync = state.take_sync(&r).unwrap();
        assert_eq!(sync.digest, KeyDigest::of(sync.keys.iter().copied()));
        state.reset(Rank(0));
        assert_eq!(state.digest(), KeyDigest::default());
    }

    #[test]
    fn a_healthy_router_past_the_cap_switches_to_a_sync() {
        let metrics = Arc::new(Metrics::new());
        let translator = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), metrics.translate.clone());
        let state = WorkerState::new(translator, metrics, 100);
        let r = RouterTarget("http://r".into());
        state.set_routers(std::slice::from_ref(&r));
        state.take_sync(&r);
        for h in 0..1_000 {
            state.apply(Rank(0), &batch(vec![store(h)]));
        }
        assert!(state.needs_sync(&r));
        assert_eq!(state.pending_len(&r), Some(0));
    }
}
