//! A full sync, planned and applied in chunks (protocol v2, DESIGN.md §3).
//!
//! A sync of a million keys used to rewrite its worker under one write lock
//! (6.1 ms per 100 k keys): every routing decision waited behind it. A
//! [`SyncPlan`] splits the work so that the caller can release the lock in
//! between:
//! - [`SyncPlan::scan_held`] and [`SyncPlan::scan_fresh`] compute the diff
//!   (what the worker holds that the sync lacks, and what the sync has that
//!   is not yet confirmed) under a *read* lock, in slices;
//! - [`SyncPlan::apply_some`] applies that diff a bounded number of keys at a
//!   time under the write lock. Each step re-checks what it changes, so
//!   whatever happened between steps (a speculative record, an expiry) is
//!   respected; usually the diff is tiny (a lost batch's worth of keys).
//!
//! Between steps a worker may hold part of the old and part of the new set:
//! matching stays valid (each key is still a real prefix some engine held
//! recently), and the sidecar's next push compares digests again.

use kvroute_shared::BlockKey;

use super::{Index, KeyMap, Kind, Slot, SyncOutcome};

/// The router clock tick a sync's key set accounts for: speculative entries
/// stamped after it survive the sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Covers(pub u64);

impl Index {
    /// The tick of the last speculative entry `slot` got at or before
    /// `as_of_ms` (the wall-clock form, for v1 sidecars and the lab): the
    /// per-worker record of speculative entries is in time order.
    pub fn covers_ms(&self, slot: Slot, as_of_ms: u64) -> Covers {
        let Some(w) = self.workers.get(&slot) else { return Covers(self.clock) };
        let q = &w.speculative;
        let n = q.partition_point(|&(ms, _, _)| ms <= as_of_ms);
        match n {
            0 => Covers(q.front().map_or(self.clock, |&(_, tick, _)| tick - 1)),
            n => Covers(q[n - 1].1),
        }
    }
}

/// One worker's full sync, in progress.
#[derive(Debug)]
pub struct SyncPlan {
    slot: Slot,
    covers: Covers,
    fresh: KeyMap<()>,
    /// The sync's keys, each once, in arrival order.
    distinct: Vec<BlockKey>,
    held_cursor: usize,
    /// The generation of the worker's vector `held_cursor` indexes: a
    /// compaction swaps the vector between two slices, and the cursor would
    /// then point past (or into the middle of) another order of keys.
    held_generation: Option<u64>,
    fresh_cursor: usize,
    /// Held keys the sync lacks (speculative ones are re-checked on apply).
    remove: Vec<BlockKey>,
    /// Sync keys not yet confirmed.
    add: Vec<BlockKey>,
    applied: usize,
    out: SyncOutcome,
}

impl SyncPlan {
    /// Builds the key set (no lock needed).
    pub fn new(slot: Slot, hashes: &[BlockKey], covers: Covers) -> Self {
        let mut fresh: KeyMap<()> = KeyMap::with_capacity_and_hasher(hashes.len(), Default::default());
        let mut distinct = Vec::with_capacity(hashes.len());
        for &k in hashes {
            if fresh.insert(k, ()).is_none() {
                distinct.push(k);
            }
        }
        SyncPlan {
            slot,
            covers,
            fresh,
            distinct,
            held_cursor: 0,
            held_generation: None,
            fresh_cursor: 0,
            remove: Vec::new(),
            add: Vec::new(),
            applied: 0,
            out: SyncOutcome::default(),
        }
    }

    /// Scans up to `budget` of the worker's held keys for ones the sync
    /// lacks; `true` while there is more to scan.
    pub fn scan_held(&mut self, ix: &Index, budget: usize) -> bool {
        let Some(w) = ix.workers.get(&self.slot) else { return false };
        // Replaced since the last slice (compacted): scanned again from its
        // start; a key found twice is removed once.
        if self.held_generation.is_some_and(|g| g != w.generation) {
            self.held_cursor = 0;
        }
        self.held_generation = Some(w.generation);
        let end = self.held_cursor.saturating_add(budget).min(w.keys.len());
        for k in &w.keys[self.held_cursor.min(end)..end] {
            if !self.fresh.contains_key(k) && ix.forward.holds(self.slot, k) {
                self.remove.push(*k);
            }
        }
        self.held_cursor = end;
        end < w.keys.len()
    }

    /// Scans up to `budget` of the sync's keys for ones not yet confirmed;
    /// `true` while there is more to scan.
    pub fn scan_fresh(&mut self, ix: &Index, budget: usize) -> bool {
        let end = self.fresh_cursor.saturating_add(budget).min(self.distinct.len());
        let w = ix.workers.get(&self.slot);
        for &k in &self.distinct[self.fresh_cursor..end] {
            let confirmed = ix.forward.holds(self.slot, &k) && w.is_some_and(|w| w.kind_of(&k) == Kind::Confirmed);
            if !confirmed {
                self.add.push(k);
            }
        }
        self.fresh_cursor = end;
        end < self.distinct.len()
    }

    /// Keys the diff changes (removals and additions).
    pub fn diff_len(&self) -> usize {
        self.remove.len() + self.add.len()
    }

    /// Applies up to `budget` keys of the diff; `true` while more remain.
    pub fn apply_some(&mut self, ix: &mut Index, budget: usize) -> bool {
        let slot = self.slot;
        let mut left = budget;
        while left > 0 && self.applied < self.remove.len() {
            let k = self.remove[self.applied];
            self.applied += 1;
            left -= 1;
            let Some(w) = ix.workers.get(&slot) else { continue };
            if !ix.forward.holds(slot, &k) {
                continue;
            }
            let keep = w.marks.get(&k).is_some_and(|e| e.kind() == Kind::Speculative && e.stamp() > self.covers.0);
            if keep {
                self.out.kept_speculative += 1;
            } else {
                self.out.removed += usize::from(ix.remove_uncompacted(slot, k));
            }
        }
        while left > 0 && self.applied < self.remove.len() + self.add.len() {
            let k = self.add[self.applied - self.remove.len()];
            self.applied += 1;
            left -= 1;
            self.out.added += usize::from(!ix.forward.holds(slot, &k));
            ix.put(slot, k, super::Entry::new(Kind::Confirmed, 0));
        }
        self.applied < self.remove.len() + self.add.len()
    }

    /// Compacts the worker's reverse vector if the removals left it sparse.
    pub fn finish(self, ix: &mut Index) -> SyncOutcome {
        ix.compact(self.slot);
        self.out
    }
}
