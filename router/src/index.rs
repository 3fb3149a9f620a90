//! The router's global cache map (DESIGN.md §3): which worker holds which block.
//!
//! - forward: key → set of worker slots holding it (matching walks this);
//! - reverse: worker → its keys, each *confirmed* (an event or a sync said so),
//!   *speculative* (this router sent a request there and has not heard back) or
//!   *approximate* (a worker no sidecar reports for: the router's own routing
//!   history, LRU-bounded by the worker's block capacity).
//!
//! Both maps change together inside one `&mut self` call; the router holds the
//! whole index behind one lock (see `state.rs`), so no reader ever sees one map
//! updated and not the other. A sync rewrites one worker in O(its keys), never
//! scanning the whole forward map (the paper's reverse index).

mod approx;
mod compaction;
mod hasher;
mod sync;
mod workerset;

use std::collections::{HashMap, VecDeque};

use kvroute_shared::{BlockKey, KeyDigest};

use approx::ApproxLru;
pub use compaction::Compaction;
pub use hasher::KeyMap;
pub use sync::{Covers, SyncPlan};
pub use workerset::{MAX_WORKERS, Slot, SlotSet, WORDS};

/// What the index knows about one (key, worker) pair, packed in 8 bytes:
/// the top two bits are the [`Kind`], the next one [`Entry::wanted_again`],
/// the rest a stamp: for a speculative entry the index's causal clock when
/// it was recorded (see [`Index::clock`]), for an approximate one its last
/// use in milliseconds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Entry(u64);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Confirmed,
    Speculative,
    Approximate,
}

/// What a router knows of a worker's deepest matched block
/// ([`Index::match_kind`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MatchKind {
    /// Confirmed by its sidecar, or approximate (the router's own history).
    #[default]
    Held,
    /// Speculative: this router sent it there and no sidecar confirmed it
    /// yet; the worker may still be prefilling it.
    Sent,
    /// Speculative, and sent there more than once: several requests want
    /// this new prefix at once (a burst).
    SentAgain,
}

const STAMP_MASK: u64 = (1 << 61) - 1;
const WANTED_AGAIN: u64 = 1 << 61;

impl Entry {
    fn new(kind: Kind, stamp_ms: u64) -> Self {
        let k = match kind {
            Kind::Confirmed => 0,
            Kind::Speculative => 1,
            Kind::Approximate => 2,
        };
        Entry((k << 62) | (stamp_ms & STAMP_MASK))
    }
    fn kind(self) -> Kind {
        match self.0 >> 62 {
            0 => Kind::Confirmed,
            1 => Kind::Speculative,
            _ => Kind::Approximate,
        }
    }
    fn stamp(self) -> u64 {
        self.0 & STAMP_MASK
    }
    /// A speculative entry this router sent there again before any sidecar
    /// confirmed it: several requests want the block at once (a burst).
    fn wanted_again(self) -> bool {
        self.0 & WANTED_AGAIN != 0
    }
    fn and_wanted_again(self) -> Self {
        Entry(self.0 | WANTED_AGAIN)
    }
}

/// One worker's side of the index: the reverse map.
///
/// Memory is what bounds the index (millions of entries), so the reverse map
/// is a plain vector of keys with lazy deletion — 8 bytes an entry instead of
/// a hash-table slot with up to 2× slack. Whether the worker still holds a
/// key is the forward map's bit; stale items are dropped when the vector
/// grows past twice the live count. Only non-confirmed entries (speculative,
/// approximate: a minority) keep an [`Entry`] with their stamp.
#[derive(Debug, Default)]
struct WorkerKeys {
    /// Every key the worker holds, plus stale (since removed) items and
    /// possibly duplicates of re-added keys.
    keys: Vec<BlockKey>,
    /// Keys the worker holds.
    live: usize,
    /// Kind and stamp of every non-confirmed entry.
    marks: KeyMap<Entry>,
    /// Speculative insertions in time order, `(ms, tick, key)`; an item is
    /// stale (skipped) when its entry has since been confirmed, refreshed or
    /// removed (its entry's tick differs).
    speculative: VecDeque<(u64, u64, BlockKey)>,
    /// Present for workers indexed approximately.
    approx: Option<ApproxLru>,
    counts: Counts,
    /// Digest of the confirmed keys only: what the sidecar's key set must
    /// equal (protocol v2). Speculative and approximate entries are the
    /// router's own and never enter it.
    digest: KeyDigest,
    /// Bumped whenever `keys` is replaced or cleared: a [`Compaction`]
    /// planned against an older vector is abandoned.
    generation: u64,
}

/// Reverse vectors up to this many items are compacted inline (a retain and
/// a sort: well under a millisecond); larger ones by a [`Compaction`] off the
/// write lock (`health::housekeeping`), unless they reach
/// [`HARD_SLACK`] × their live keys, which bounds memory where no
/// housekeeping runs (the lab).
const INLINE_COMPACT_MAX: usize = 16_384;
const HARD_SLACK: usize = 4;

impl WorkerKeys {
    /// Its keys' accounting, once its keys are gone: nothing held.
    fn forget_all(&mut self) {
        self.live = 0;
        self.marks = KeyMap::default();
        self.speculative.clear();
        self.counts = Counts::default();
        self.digest = KeyDigest::default();
        if let Some(lru) = &mut self.approx {
            lru.clear();
        }
    }

    fn kind_of(&self, key: &BlockKey) -> Kind {
        self.marks.get(key).map_or(Kind::Confirmed, |e| e.kind())
    }
}

/// Entry counts of one worker, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub confirmed: usize,
    pub speculative: usize,
    pub approximate: usize,
}

impl Counts {
    fn add(&mut self, kind: Kind, n: isize) {
        let c = match kind {
            Kind::Confirmed => &mut self.confirmed,
            Kind::Speculative => &mut self.speculative,
            Kind::Approximate => &mut self.approximate,
        };
        *c = c.saturating_add_signed(n);
    }
}

/// What a sync changed, for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncOutcome {
    pub added: usize,
    pub removed: usize,
    pub kept_speculative: usize,
}

/// The forward map: key → bitset of holders, one map per word of 64 slots.
/// A key is in word `w`'s map only while some slot of that word holds it, so
/// a cluster of up to 64 workers pays 8 bytes of bits per key, and larger
/// ones 8 bytes per key and word that holds it (the bits of 256 workers, 32
/// bytes, only for keys that all four words hold).
#[derive(Debug, Default)]
struct Forward {
    words: [KeyMap<u64>; WORDS],
}

impl Forward {
    fn part(&mut self, slot: Slot) -> (&mut KeyMap<u64>, u64) {
        (&mut self.words[slot.0 as usize / 64], 1u64 << (slot.0 % 64))
    }

    fn holds(&self, slot: Slot, key: &BlockKey) -> bool {
        let bit = 1u64 << (slot.0 % 64);
        self.words[slot.0 as usize / 64].get(key).is_some_and(|b| b & bit != 0)
    }

    /// Sets the bit; false if it was set already.
    fn set(&mut self, slot: Slot, key: BlockKey) -> bool {
        let (map, bit) = self.part(slot);
        let bits = map.entry(key).or_insert(0);
        let fresh = *bits & bit == 0;
        *bits |= bit;
        fresh
    }

    /// Clears the bit; false if it was not set.
    fn clear(&mut self, slot: Slot, key: &BlockKey) -> bool {
        let (map, bit) = self.part(slot);
        let Some(bits) = map.get_mut(key) else { return false };
        let was = *bits & bit != 0;
        *bits &= !bit;
        if *bits == 0 {
            map.remove(key);
        }
        was
    }

    fn holders(&self, key: &BlockKey) -> SlotSet {
        // Words no worker uses are empty maps: skipped without hashing.
        SlotSet::from_words(std::array::from_fn(|w| {
            let map = &self.words[w];
            if map.is_empty() { 0 } else { map.get(key).copied().unwrap_or(0) }
        }))
    }

    /// Distinct keys: each counted in the first word whose map holds it. A
    /// word with no used word before it counts its map's length: with up to
    /// 64 workers (one word) this is O(1), not a scan of every key under the
    /// lock at each scrape.
    fn key_count(&self) -> usize {
        (0..WORDS)
            .map(|w| {
                let earlier = &self.words[..w];
                if earlier.iter().all(HashMap::is_empty) {
                    self.words[w].len()
                } else {
                    self.words[w].keys().filter(|k| !earlier.iter().any(|m| m.contains_key(k))).count()
                }
            })
            .sum()
    }
}

#[derive(Debug, Default)]
pub struct Index {
    forward: Forward,
    workers: HashMap<Slot, WorkerKeys>,
    /// The causal clock: one tick per [`Index::record_routed`]. Speculative
    /// entries carry the tick they were made at; routers send it in acks and
    /// a v2 sync names the last one its sidecar saw ([`Covers::Clock`]), so
    /// which speculative entries a sync drops never depends on comparing two
    /// machines' wall clocks.
    clock: u64,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Distinct keys held by any worker.
    pub fn key_count(&self) -> usize {
        self.forward.key_count()
    }

    /// (key, worker) entries over all workers.
    pub fn entry_count(&self) -> usize {
        self.workers.values().map(|w| w.live).sum()
    }

    /// Keys `slot` holds, of every kind: the KV blocks the router counts
    /// filled there.
    pub fn held(&self, slot: Slot) -> usize {
        self.workers.get(&slot).map_or(0, |w| w.live)
    }

    /// Does `slot` hold `key` (of any kind)?
    pub fn holds(&self, slot: Slot, key: &BlockKey) -> bool {
        self.forward.holds(slot, key)
    }

    pub fn counts(&self, slot: Slot) -> Counts {
        self.workers.get(&slot).map(|w| w.counts).unwrap_or_default()
    }

    /// Digest of `slot`'s confirmed keys (what its sidecar reported).
    pub fn digest(&self, slot: Slot) -> KeyDigest {
        self.workers.get(&slot).map(|w| w.digest).unwrap_or_default()
    }

    /// The causal clock's current tick.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Indexes `slot` approximately from now on, remembering at most
    /// `capacity_blocks` keys (its KV cache size); `None` makes it exact.
    pub fn set_approximate(&mut self, slot: Slot, capacity_blocks: Option<usize>) {
        let w = self.workers.entry(slot).or_default();
        match (capacity_blocks, &mut w.approx) {
            (Some(cap), Some(lru)) => lru.set_capacity(cap),
            (Some(cap), None) => w.approx = Some(ApproxLru::new(cap)),
            (None, _) => w.approx = None,
        }
        self.enforce_capacity(slot);
    }

    pub fn is_approximate(&self, slot: Slot) -> bool {
        self.workers.get(&slot).is_some_and(|w| w.approx.is_some())
    }

    fn put(&mut self, slot: Slot, key: BlockKey, entry: Entry) {
        let w = self.workers.entry(slot).or_default();
        let was = if self.forward.set(slot, key) {
            w.keys.push(key);
            w.live += 1;
            None
        } else {
            let old = w.kind_of(&key);
            w.counts.add(old, -1);
            Some(old)
        };
        match (was == Some(Kind::Confirmed), entry.kind() == Kind::Confirmed) {
            (false, true) => w.digest.insert(key),
            (true, false) => w.digest.remove(key),
            _ => {}
        }
        match entry.kind() {
            Kind::Confirmed => {
                w.marks.remove(&key);
            }
            _ => {
                w.marks.insert(key, entry);
            }
        }
        w.counts.add(entry.kind(), 1);
    }

    fn remove(&mut self, slot: Slot, key: BlockKey) -> bool {
        let removed = self.remove_uncompacted(slot, key);
        self.compact(slot);
        removed
    }

    /// Removes without compacting the reverse vector (bulk removals compact once).
    fn remove_uncompacted(&mut self, slot: Slot, key: BlockKey) -> bool {
        let Some(w) = self.workers.get_mut(&slot) else { return false };
        if !self.forward.clear(slot, &key) {
            return false;
        }
        w.live -= 1;
        let kind = w.marks.remove(&key).map_or(Kind::Confirmed, |e| e.kind());
        w.counts.add(kind, -1);
        if kind == Kind::Confirmed {
            w.digest.remove(key);
        }
        true
    }

    /// Drops stale and duplicate items once they outnumber the live keys:
    /// inline while the vector is small, else left to a [`Compaction`].
    fn compact(&mut self, slot: Slot) {
        let Some(w) = self.workers.get_mut(&slot) else { return };
        let n = w.keys.len();
        if n > 2 * w.live + 64 && (n <= INLINE_COMPACT_MAX || n > HARD_SLACK * w.live + INLINE_COMPACT_MAX) {
            let forward = &self.forward;
            w.keys.retain(|k| forward.holds(slot, k));
            w.keys.sort_unstable();
            w.keys.dedup();
            w.generation += 1;
        }
    }

    /// Slots whose reverse vector is due a compaction too large to do inline.
    pub fn compaction_due(&self) -> Vec<Slot> {
        self.workers.iter().filter(|(_, w)| w.keys.len() > 2 * w.live + 64).map(|(s, _)| *s).collect()
    }

    /// Drops every entry of `slot` (engine cleared, worker dead or removed).
    pub fn clear_worker(&mut self, slot: Slot) -> usize {
        let Some(w) = self.workers.get_mut(&slot) else { return 0 };
        let removed = w.live;
        w.generation += 1;
        for key in std::mem::take(&mut w.keys) {
            self.forward.clear(slot, &key);
        }
        w.forget_all();
        removed
    }

    /// [`Index::clear_worker`] a piece at a time: drops up to `n` of
    /// `slot`'s keys and says whether any remain (call again, under a fresh
    /// lock). Once none do, the worker is left as `clear_worker` leaves it.
    pub fn clear_some(&mut self, slot: Slot, n: usize) -> bool {
        let Some(w) = self.workers.get_mut(&slot) else { return false };
        // A compaction under way read the vector this shortens.
        w.generation += 1;
        let cut = w.keys.len().saturating_sub(n.max(1));
        let chunk: Vec<BlockKey> = w.keys.drain(cut..).collect();
        for key in chunk {
            self.remove_uncompacted(slot, key);
        }
        let Some(w) = self.workers.get_mut(&slot) else { return false };
        if !w.keys.is_empty() {
            return true;
        }
        w.forget_all();
        false
    }

    /// Applies up to `n` more changes of a delta (`cleared` as `cursor` was
    /// made, then `evicted`, then `stored`, as [`Index::apply_events`] does
    /// at once); says whether any remain. A large delta applied so holds
    /// the write lock a chunk at a time, as a sync does.
    pub fn apply_some(
        &mut self,
        slot: Slot,
        cursor: &mut DeltaCursor,
        evicted: &[BlockKey],
        stored: &[BlockKey],
        n: usize,
    ) -> bool {
        let n = n.max(1);
        if cursor.clearing {
            cursor.clearing = self.clear_some(slot, n);
        } else if cursor.evicted < evicted.len() {
            let end = (cursor.evicted + n).min(evicted.len());
            for &k in &evicted[cursor.evicted..end] {
                self.remove(slot, k);
            }
            cursor.evicted = end;
        } else {
            let end = (cursor.stored + n).min(stored.len());
            for &k in &stored[cursor.stored..end] {
                self.put(slot, k, Entry::new(Kind::Confirmed, 0));
            }
            cursor.stored = end;
        }
        cursor.clearing || cursor.evicted < evicted.len() || cursor.stored < stored.len()
    }

    /// Forgets `slot`'s worker entirely (it left the cluster). Its emptied
    /// entry stays, its generation past any [`Compaction`] planned against
    /// the old vector: the slot's next occupant must not start again at
    /// generation 0, where such a compaction would read its vector as the
    /// old one (out of range, or dropping its keys from the reverse map).
    pub fn remove_worker(&mut self, slot: Slot) {
        self.clear_worker(slot);
        if let Some(w) = self.workers.get_mut(&slot) {
            w.approx = None;
        }
    }

    /// The fast path: `cleared` first, then evictions, then stores.
    pub fn apply_events(&mut self, slot: Slot, cleared: bool, evicted: &[BlockKey], stored: &[BlockKey]) {
        if cleared {
            self.clear_worker(slot);
        }
        for &k in evicted {
            self.remove(slot, k);
        }
        for &k in stored {
            self.put(slot, k, Entry::new(Kind::Confirmed, 0));
        }
    }

    /// The slow path in one step (the lab, tests, and v1 syncs whose
    /// sidecar named only a wall-clock time): `hashes` is the worker's whole
    /// key set as of `as_of_ms`. Keys not in it go, except speculative
    /// entries made after `as_of_ms` (their prefill may still be running);
    /// keys in it become confirmed. The router's HTTP path applies a sync in
    /// chunks instead ([`SyncPlan`]).
    pub fn sync(&mut self, slot: Slot, hashes: &[BlockKey], as_of_ms: u64) -> SyncOutcome {
        let covers = self.covers_ms(slot, as_of_ms);
        let mut plan = SyncPlan::new(slot, hashes, covers);
        plan.scan_held(self, usize::MAX);
        plan.scan_fresh(self, usize::MAX);
        while plan.apply_some(self, usize::MAX) {}
        plan.finish(self)
    }

    /// Records that a request for `keys` was sent to `slot`: every key the
    /// worker does not hold yet becomes speculative (or, for an approximate
    /// worker, an approximate entry, touched in its LRU).
    ///
    /// Keys are touched last block first, so a chain's head is its most
    /// recent entry and the LRU evicts tails before heads, as vLLM does: a
    /// worker's approximate keys stay prefix-closed, which `match_depths`'s
    /// bisection relies on (a parent is touched after each of its children,
    /// every time any chain through it is routed).
    /// Returns the tick the entries carry ([`Self::withdraw_routed`]).
    pub fn record_routed(&mut self, slot: Slot, keys: &[BlockKey], now_ms: u64) -> u64 {
        let approximate = self.is_approximate(slot);
        self.clock += 1;
        let tick = self.clock;
        for &k in keys.iter().rev() {
            let existing = self
                .forward
                .holds(slot, &k)
                .then(|| self.workers.get(&slot).map_or(Kind::Confirmed, |w| w.kind_of(&k)));
            match (approximate, existing) {
                (_, Some(Kind::Confirmed)) => {}
                (true, _) => {
                    let lru = self.workers.get_mut(&slot).and_then(|w| w.approx.as_mut());
                    let stamp = lru.map_or(now_ms, |l| {
                        let s = l.next_stamp(now_ms);
                        l.touch(k, s);
                        s
                    });
                    self.put(slot, k, Entry::new(Kind::Approximate, stamp));
                }
                (false, existing) => {
                    let entry = Entry::new(Kind::Speculative, tick);
                    let entry = if existing == Some(Kind::Speculative) { entry.and_wanted_again() } else { entry };
                    self.put(slot, k, entry);
                    if let Some(w) = self.workers.get_mut(&slot) {
                        w.speculative.push_back((now_ms, tick, k));
                    }
                }
            }
        }
        if approximate {
            self.enforce_capacity(slot);
        } else {
            self.cap_speculative(slot);
        }
        tick
    }

    /// Takes back the speculative entries [`Self::record_routed`] made at
    /// `tick` for `keys` on `slot`, where nothing has replaced them since
    /// (a confirmation, a later send): the engine refused the request and
    /// computed nothing. An entry this send found already speculative (sent
    /// there before, [`Entry::wanted_again`]) stays: the earlier send may
    /// be computing it. Approximate entries stay too (their LRU order is
    /// not undone).
    pub fn withdraw_routed(&mut self, slot: Slot, keys: &[BlockKey], tick: u64) -> usize {
        let Some(w) = self.workers.get(&slot) else { return 0 };
        let ours: Vec<BlockKey> = keys
            .iter()
            .copied()
            .filter(|k| {
                w.marks.get(k).is_some_and(|e| e.kind() == Kind::Speculative && e.stamp() == tick && !e.wanted_again())
            })
            .collect();
        let removed = ours.iter().filter(|&&k| self.remove_uncompacted(slot, k)).count();
        if removed > 0 {
            self.compact(slot);
        }
        removed
    }

    /// Speculative insertions a worker remembers at most (its queue's
    /// items, so re-sends count too): 16 prompts of 262,144 tokens. Sends
    /// are confirmed or not within a push interval (100 ms), and expire
    /// after `speculative_ttl` (10 s); without a cap a client sending long
    /// prompts, the same one again and again, grew the queue by up to
    /// 16,384 items a request for those 10 s (several GB at a few hundred
    /// requests a second), and a worker's entries past `max_sync_keys` made
    /// its own sidecar's pushes too large to take.
    pub const MAX_SPECULATIVE: usize = 1 << 18;

    /// Drops the oldest of `slot`'s sends beyond [`Self::MAX_SPECULATIVE`]
    /// that nothing confirmed, as their expiry would.
    fn cap_speculative(&mut self, slot: Slot) {
        let Some(w) = self.workers.get_mut(&slot) else { return };
        let mut dropped = Vec::new();
        while w.speculative.len() > Self::MAX_SPECULATIVE {
            let Some((_, tick, key)) = w.speculative.pop_front() else { break };
            if w.marks.get(&key).is_some_and(|e| e.kind() == Kind::Speculative && e.stamp() == tick) {
                dropped.push(key);
            }
        }
        for key in dropped {
            self.remove_uncompacted(slot, key);
        }
        self.compact(slot);
    }

    fn enforce_capacity(&mut self, slot: Slot) {
        loop {
            let victim = match self.workers.get_mut(&slot) {
                Some(WorkerKeys { approx: Some(lru), marks, live, .. }) => lru.pop_over_capacity(*live, |k, stamp| {
                    marks.get(&k).is_some_and(|e| e.kind() == Kind::Approximate && e.stamp() == stamp)
                }),
                _ => None,
            };
            match victim {
                Some(k) => {
                    self.remove(slot, k);
                }
                None => return,
            }
        }
    }

    /// Drops speculative entries older than `ttl_ms` that nothing confirmed.
    pub fn expire_speculative(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let mut expired = 0;
        loop {
            let (n, more) = self.expire_speculative_some(now_ms, ttl_ms, usize::MAX);
            expired += n;
            if !more {
                return expired;
            }
        }
    }

    /// [`Self::expire_speculative`] a piece at a time: looks at up to
    /// `budget` old records and says whether more may remain (call again,
    /// under a fresh lock). Every worker's at once could be millions (a
    /// client sending prompts the engine refuses leaves each one's keys
    /// speculative, up to `MAX_SPECULATIVE` per worker), all dropped under
    /// one write lock every routing decision waits on.
    pub fn expire_speculative_some(&mut self, now_ms: u64, ttl_ms: u64, budget: usize) -> (usize, bool) {
        let mut expired = Vec::new();
        let mut looked = 0;
        'workers: for (&slot, w) in &mut self.workers {
            while let Some(&(at, tick, key)) = w.speculative.front() {
                if at.saturating_add(ttl_ms) > now_ms {
                    break;
                }
                if looked == budget {
                    break 'workers;
                }
                looked += 1;
                w.speculative.pop_front();
                if w.marks.get(&key).is_some_and(|e| e.kind() == Kind::Speculative && e.stamp() == tick) {
                    expired.push((slot, key));
                }
            }
        }
        let mut touched: Vec<Slot> = expired.iter().map(|&(slot, _)| slot).collect();
        touched.dedup();
        for &(slot, key) in &expired {
            self.remove_uncompacted(slot, key);
        }
        for slot in touched {
            self.compact(slot);
        }
        (expired.len(), looked == budget)
    }

    /// How many leading blocks of `keys` each worker holds: `(slot, depth)` for
    /// every worker with depth ≥ 1.
    ///
    /// The definition is the linear walk (a worker's depth is the first index
    /// where it drops out). Because a key names its whole prefix and vLLM
    /// evicts a sequence's tail before its head, a worker's keys for one chain
    /// are prefix-closed, so the walk is done by bisection: only the indices
    /// where the holder set changes are looked up, O(changes · log n) instead
    /// of O(n) lookups — a 512-block hit costs ~10 lookups, not 512.
    pub fn match_depths(&self, keys: &[BlockKey]) -> Vec<(Slot, usize)> {
        let mut out = Vec::new();
        let Some((&first, _)) = keys.split_first() else { return out };
        let set_first = self.holders(first);
        if set_first.is_empty() {
            return out;
        }
        let last = keys.len() - 1;
        let set_last = self.holders(keys[last]).and(set_first);
        out.extend(set_last.iter().map(|s| (s, keys.len())));
        self.bisect(keys, 0, set_first, last, set_last, &mut out);
        out
    }

    /// What this router knows of the deepest of `matched`, the leading keys
    /// of a request `slot` holds ([`Self::match_depths`]); `Held` when none.
    pub fn match_kind(&self, slot: Slot, matched: &[BlockKey]) -> MatchKind {
        let Some(deepest) = matched.last() else { return MatchKind::Held };
        match self.workers.get(&slot).and_then(|w| w.marks.get(deepest)) {
            Some(e) if e.kind() == Kind::Speculative && e.wanted_again() => MatchKind::SentAgain,
            Some(e) if e.kind() == Kind::Speculative => MatchKind::Sent,
            _ => MatchKind::Held,
        }
    }

    fn holders(&self, key: BlockKey) -> SlotSet {
        self.forward.holders(&key)
    }

    /// Workers in `set_lo` (holding keys[lo]) but not `set_hi` (holding
    /// keys[hi]) drop out somewhere in (lo, hi]; find where.
    fn bisect(
        &self,
        keys: &[BlockKey],
        lo: usize,
        set_lo: SlotSet,
        hi: usize,
        set_hi: SlotSet,
        out: &mut Vec<(Slot, usize)>,
    ) {
        if set_lo == set_hi {
            return;
        }
        if hi == lo + 1 {
            out.extend(set_lo.minus(set_hi).iter().map(|s| (s, lo + 1)));
            return;
        }
        let mid = lo + (hi - lo) / 2;
        // Holders of the last key hold every key before it (prefix closure).
        let set_mid = self.holders(keys[mid]).and(set_lo).union(set_hi);
        self.bisect(keys, lo, set_lo, mid, set_mid, out);
        self.bisect(keys, mid, set_mid, hi, set_hi, out);
    }

    /// All keys of `slot` with their kinds (for debug views and tests).
    pub fn keys_of(&self, slot: Slot) -> Vec<(BlockKey, Kind)> {
        sorted_keys(self.unsorted_keys_of(slot))
    }

    /// [`Index::keys_of`] unsorted, a key perhaps more than once: the part
    /// that needs the lock (the caller sorts after letting it go).
    pub fn unsorted_keys_of(&self, slot: Slot) -> Vec<(BlockKey, Kind)> {
        let Some(w) = self.workers.get(&slot) else { return Vec::new() };
        w.keys.iter().filter(|k| self.forward.holds(slot, k)).map(|&k| (k, w.kind_of(&k))).collect()
    }

    /// Checks that forward and reverse agree (tests and debug builds).
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut from_forward: HashMap<Slot, usize> = HashMap::new();
        for (w, map) in self.forward.words.iter().enumerate() {
            let base = w as u16 * 64;
            for (key, bits) in map {
                if *bits == 0 {
                    return Err(format!("{key} has an empty worker set"));
                }
                for b in 0..64u16 {
                    if bits & (1 << b) == 0 {
                        continue;
                    }
                    let slot = Slot(base + b);
                    *from_forward.entry(slot).or_default() += 1;
                    if !self.workers.get(&slot).is_some_and(|w| w.keys.contains(key)) {
                        return Err(format!("{key} → {slot:?} has no reverse entry"));
                    }
                }
            }
        }
        for (slot, w) in &self.workers {
            let held = self.keys_of(*slot);
            if held.len() != w.live || from_forward.get(slot).copied().unwrap_or(0) != w.live {
                return Err(format!("{slot:?}: live {} but {} keys held", w.live, held.len()));
            }
            for key in w.marks.keys() {
                if !self.forward.holds(*slot, key) {
                    return Err(format!("{slot:?}: mark for {key} which it does not hold"));
                }
            }
            let mut c = Counts::default();
            for (_, kind) in &held {
                c.add(*kind, 1);
            }
            if c != w.counts {
                return Err(format!("{slot:?}: counts {:?} but entries say {c:?}", w.counts));
            }
            let d = KeyDigest::of(held.iter().filter(|(_, kind)| *kind == Kind::Confirmed).map(|(k, _)| *k));
            if d != w.digest {
                return Err(format!("{slot:?}: digest {:?} but confirmed entries say {d:?}", w.digest));
            }
        }
        Ok(())
    }
}

/// What [`Index::unsorted_keys_of`] gave, sorted and each key once: what
/// [`Index::keys_of`] returns (sorted by a caller that let the lock go).
pub fn sorted_keys(mut keys: Vec<(BlockKey, Kind)>) -> Vec<(BlockKey, Kind)> {
    keys.sort_unstable_by_key(|(k, _)| *k);
    keys.dedup_by_key(|(k, _)| *k);
    keys
}

/// Where [`Index::apply_some`] is in a delta.
#[derive(Debug, Default)]
pub struct DeltaCursor {
    clearing: bool,
    evicted: usize,
    stored: usize,
}

impl DeltaCursor {
    /// At the start of a delta; `cleared`: it begins by clearing the worker.
    pub fn new(cleared: bool) -> Self {
        DeltaCursor { clearing: cleared, evicted: 0, stored: 0 }
    }
}

#[cfg(test)]
mod tests;
