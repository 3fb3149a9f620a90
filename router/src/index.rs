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
mod hasher;
mod workerset;

use std::collections::{HashMap, VecDeque};

use kvroute_shared::BlockKey;

use approx::ApproxLru;
pub use hasher::KeyMap;
pub use workerset::{MAX_WORKERS, Slot, SlotSet};

/// What the index knows about one (key, worker) pair, packed in 8 bytes:
/// the top two bits are the [`Kind`], the rest a millisecond stamp (creation
/// time of a speculative entry, last use of an approximate one).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Entry(u64);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Confirmed,
    Speculative,
    Approximate,
}

const STAMP_MASK: u64 = (1 << 62) - 1;

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
}

/// One worker's side of the index.
#[derive(Debug, Default)]
struct WorkerKeys {
    keys: KeyMap<Entry>,
    /// Speculative insertions in time order; an item is stale (skipped) when
    /// its entry has since been confirmed, refreshed or removed.
    speculative: VecDeque<(u64, BlockKey)>,
    /// Present for workers indexed approximately.
    approx: Option<ApproxLru>,
    counts: Counts,
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
    pub fn total(&self) -> usize {
        self.confirmed + self.speculative + self.approximate
    }
}

/// What a sync changed, for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncOutcome {
    pub added: usize,
    pub removed: usize,
    pub kept_speculative: usize,
}

#[derive(Debug, Default)]
pub struct Index {
    forward: KeyMap<SlotSet>,
    workers: HashMap<Slot, WorkerKeys>,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Distinct keys held by any worker.
    pub fn key_count(&self) -> usize {
        self.forward.len()
    }

    /// (key, worker) entries over all workers.
    pub fn entry_count(&self) -> usize {
        self.workers.values().map(|w| w.keys.len()).sum()
    }

    pub fn counts(&self, slot: Slot) -> Counts {
        self.workers.get(&slot).map(|w| w.counts).unwrap_or_default()
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
        match w.keys.insert(key, entry) {
            Some(old) => w.counts.add(old.kind(), -1),
            None => self.forward.entry(key).or_default().insert(slot),
        }
        w.counts.add(entry.kind(), 1);
    }

    fn remove(&mut self, slot: Slot, key: BlockKey) -> bool {
        let Some(w) = self.workers.get_mut(&slot) else { return false };
        let Some(old) = w.keys.remove(&key) else { return false };
        w.counts.add(old.kind(), -1);
        if let Some(set) = self.forward.get_mut(&key) {
            set.remove(slot);
            if set.is_empty() {
                self.forward.remove(&key);
            }
        }
        true
    }

    /// Drops every entry of `slot` (engine cleared, worker dead or removed).
    pub fn clear_worker(&mut self, slot: Slot) -> usize {
        let Some(w) = self.workers.get_mut(&slot) else { return 0 };
        let keys = std::mem::take(&mut w.keys);
        w.speculative.clear();
        w.counts = Counts::default();
        if let Some(lru) = &mut w.approx {
            lru.clear();
        }
        for key in keys.keys() {
            if let Some(set) = self.forward.get_mut(key) {
                set.remove(slot);
                if set.is_empty() {
                    self.forward.remove(key);
                }
            }
        }
        keys.len()
    }

    /// Forgets `slot` entirely (the worker left the cluster).
    pub fn remove_worker(&mut self, slot: Slot) {
        self.clear_worker(slot);
        self.workers.remove(&slot);
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

    /// The slow path: `hashes` is the worker's whole key set as of `as_of_ms`.
    /// Keys not in it go, except speculative entries made after `as_of_ms`
    /// (their prefill may still be running); keys in it become confirmed.
    pub fn sync(&mut self, slot: Slot, hashes: &[BlockKey], as_of_ms: u64) -> SyncOutcome {
        let mut fresh: KeyMap<()> = KeyMap::with_capacity_and_hasher(hashes.len(), Default::default());
        fresh.extend(hashes.iter().map(|&k| (k, ())));
        let mut out = SyncOutcome::default();
        let w = self.workers.entry(slot).or_default();
        let stale: Vec<BlockKey> = w
            .keys
            .iter()
            .filter(|(k, e)| {
                if fresh.contains_key(k) {
                    return false;
                }
                let keep = e.kind() == Kind::Speculative && e.stamp() > as_of_ms;
                out.kept_speculative += usize::from(keep);
                !keep
            })
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            out.removed += usize::from(self.remove(slot, k));
        }
        let before = self.workers.get(&slot).map_or(0, |w| w.keys.len());
        for &k in fresh.keys() {
            self.put(slot, k, Entry::new(Kind::Confirmed, 0));
        }
        out.added = self.workers.get(&slot).map_or(0, |w| w.keys.len()) - before;
        out
    }

    /// Records that a request for `keys` was sent to `slot`: every key the
    /// worker does not hold yet becomes speculative (or, for an approximate
    /// worker, an approximate entry, touched in its LRU).
    pub fn record_routed(&mut self, slot: Slot, keys: &[BlockKey], now_ms: u64) {
        let approximate = self.is_approximate(slot);
        for &k in keys {
            let existing = self.workers.get(&slot).and_then(|w| w.keys.get(&k)).copied();
            match (approximate, existing.map(Entry::kind)) {
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
                (false, _) => {
                    self.put(slot, k, Entry::new(Kind::Speculative, now_ms));
                    if let Some(w) = self.workers.get_mut(&slot) {
                        w.speculative.push_back((now_ms, k));
                    }
                }
            }
        }
        if approximate {
            self.enforce_capacity(slot);
        }
    }

    fn enforce_capacity(&mut self, slot: Slot) {
        loop {
            let victim = match self.workers.get_mut(&slot) {
                Some(WorkerKeys { approx: Some(lru), keys, .. }) => lru.pop_over_capacity(keys.len(), |k, stamp| {
                    keys.get(&k).is_some_and(|e| e.kind() == Kind::Approximate && e.stamp() == stamp)
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
        let mut expired = Vec::new();
        for (&slot, w) in &mut self.workers {
            while let Some(&(at, key)) = w.speculative.front() {
                if at.saturating_add(ttl_ms) > now_ms {
                    break;
                }
                w.speculative.pop_front();
                if w.keys.get(&key).is_some_and(|e| e.kind() == Kind::Speculative && e.stamp() == at) {
                    expired.push((slot, key));
                }
            }
        }
        for &(slot, key) in &expired {
            self.remove(slot, key);
        }
        expired.len()
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

    fn holders(&self, key: BlockKey) -> SlotSet {
        self.forward.get(&key).copied().unwrap_or(SlotSet::EMPTY)
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

    /// All keys of `slot` (for tests and the property checks).
    pub fn keys_of(&self, slot: Slot) -> Vec<(BlockKey, Kind)> {
        self.workers.get(&slot).map(|w| w.keys.iter().map(|(k, e)| (*k, e.kind())).collect()).unwrap_or_default()
    }

    /// Checks that forward and reverse agree (tests and debug builds).
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut entries = 0;
        for (key, set) in &self.forward {
            if set.is_empty() {
                return Err(format!("{key} has an empty worker set"));
            }
            for slot in set.iter() {
                entries += 1;
                if !self.workers.get(&slot).is_some_and(|w| w.keys.contains_key(key)) {
                    return Err(format!("{key} → {slot:?} has no reverse entry"));
                }
            }
        }
        for (slot, w) in &self.workers {
            for key in w.keys.keys() {
                if !self.holders(*key).contains(*slot) {
                    return Err(format!("reverse {slot:?} → {key} has no forward entry"));
                }
            }
            let mut c = Counts::default();
            for e in w.keys.values() {
                c.add(e.kind(), 1);
            }
            if c != w.counts {
                return Err(format!("{slot:?}: counts {:?} but entries say {c:?}", w.counts));
            }
        }
        if entries != self.entry_count() {
            return Err(format!("forward has {entries} entries, reverse {}", self.entry_count()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
