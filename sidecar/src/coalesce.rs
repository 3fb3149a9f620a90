//! Per-router net delta of the worker's key set since the last message.
//!
//! Each router gets its own [`Pending`]: a map from key to its *net* change, so
//! a store and an eviction of the same key within one window cancel, and memory
//! is bounded by the number of distinct keys that changed — never by the number
//! of events. When a router cannot be reached, or its pending map grows past a
//! cap, the map is dropped and the router is marked for a full sync instead:
//! the next message it gets is the whole key set, whatever happened meanwhile.

use std::collections::VecDeque;
use std::collections::hash_map::Entry;

use kvroute_shared::BlockKey;

use crate::translate::{KeySink, SeededMap};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Change {
    Stored,
    Evicted,
}

/// What one eviction message carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    pub cleared: bool,
    pub stored: Vec<BlockKey>,
    pub evicted: Vec<BlockKey>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        !self.cleared && self.stored.is_empty() && self.evicted.is_empty()
    }
}

/// How many of the last deltas' keys a router's [`Pending`] remembers for a
/// repair (protocol v2): a lost push shows at the next one, so the lost
/// delta is among the last two; four leave room for a retry.
pub const REPAIR_WINDOW: usize = 4;

/// One router's unsent changes.
#[derive(Debug)]
pub struct Pending {
    cleared: bool,
    changes: SeededMap<BlockKey, Change>,
    needs_sync: bool,
    max_changes: usize,
    /// The keys of the last [`REPAIR_WINDOW`] deltas taken: a push that was
    /// lost, or that the router's digest says went wrong, is repaired by
    /// re-sending the *current* state of these keys instead of a full sync.
    recent: VecDeque<Vec<BlockKey>>,
}

impl Pending {
    /// A new router starts with a full sync (that is its registration).
    pub fn new(max_changes: usize) -> Self {
        Pending {
            cleared: false,
            changes: SeededMap::default(),
            needs_sync: true,
            max_changes,
            recent: VecDeque::new(),
        }
    }

    pub fn needs_sync(&self) -> bool {
        self.needs_sync
    }

    /// Drops the unsent changes: the next message to this router is a full sync.
    pub fn require_sync(&mut self) {
        self.needs_sync = true;
        self.cleared = false;
        self.recent.clear();
        // A fresh map, so a burst's worth of capacity is returned.
        self.changes = SeededMap::default();
    }

    /// Marks the full sync as taken (the caller read the key set under the same
    /// lock): changes from now on are relative to it.
    pub fn sync_taken(&mut self) {
        self.needs_sync = false;
        self.cleared = false;
        self.recent.clear();
        self.changes = SeededMap::default();
    }

    /// Takes the net changes since the last message.
    pub fn take(&mut self) -> Delta {
        let mut delta = Delta { cleared: std::mem::take(&mut self.cleared), ..Delta::default() };
        for (key, change) in self.changes.drain() {
            match change {
                Change::Stored => delta.stored.push(key),
                Change::Evicted => delta.evicted.push(key),
            }
        }
        if delta.cleared {
            // Keys from before a clear need no repair: the clear is in this
            // delta, and if it is lost the digest asks for a full sync.
            self.recent.clear();
        }
        if !delta.stored.is_empty() || !delta.evicted.is_empty() {
            if self.recent.len() == REPAIR_WINDOW {
                self.recent.pop_front();
            }
            self.recent.push_back(delta.stored.iter().chain(&delta.evicted).copied().collect());
        }
        delta
    }

    /// Takes the net changes plus a repair: every key of the last few
    /// deltas, sent again as it stands now (`holds` says whether the worker
    /// holds it). Re-sending a key's current state is idempotent, so it
    /// heals a lost or misapplied delta whether or not the router had it.
    /// `None` when nothing is remembered (a full sync must do).
    pub fn take_repair(&mut self, holds: impl Fn(BlockKey) -> bool) -> Option<Delta> {
        if self.recent.is_empty() {
            return None;
        }
        let recent: Vec<Vec<BlockKey>> = self.recent.iter().cloned().collect();
        let mut delta = self.take();
        let mut seen: crate::translate::SeededSet<BlockKey> =
            delta.stored.iter().chain(&delta.evicted).copied().collect();
        for key in recent.into_iter().flatten() {
            if seen.insert(key) {
                if holds(key) { delta.stored.push(key) } else { delta.evicted.push(key) }
            }
        }
        Some(delta)
    }

    pub fn is_empty(&self) -> bool {
        !self.cleared && self.changes.is_empty()
    }

    /// Unsent changes held (for memory accounting and tests).
    pub fn len(&self) -> usize {
        self.changes.len()
    }

    fn record(&mut self, key: BlockKey, change: Change) {
        if self.needs_sync {
            return;
        }
        match self.changes.entry(key) {
            // The opposite change since the last message: the router's view is
            // already right.
            Entry::Occupied(e) if *e.get() != change => {
                e.remove();
            }
            Entry::Occupied(_) => {}
            Entry::Vacant(e) => {
                e.insert(change);
            }
        }
        if self.changes.len() > self.max_changes {
            self.require_sync();
        }
    }
}

impl KeySink for Pending {
    fn stored(&mut self, key: BlockKey) {
        self.record(key, Change::Stored);
    }

    fn evicted(&mut self, key: BlockKey) {
        self.record(key, Change::Evicted);
    }

    fn cleared(&mut self) {
        if self.needs_sync {
            return;
        }
        self.changes.clear();
        self.cleared = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opposite_changes_cancel() {
        let mut p = Pending::new(100);
        p.sync_taken();
        p.stored(BlockKey(1));
        p.evicted(BlockKey(1));
        p.evicted(BlockKey(2));
        p.stored(BlockKey(2));
        assert!(p.is_empty());
        p.stored(BlockKey(3));
        assert_eq!(p.take(), Delta { cleared: false, stored: vec![BlockKey(3)], evicted: vec![] });
        assert!(p.is_empty());
    }

    #[test]
    fn clear_drops_earlier_changes() {
        let mut p = Pending::new(100);
        p.sync_taken();
        p.stored(BlockKey(1));
        p.cleared();
        p.stored(BlockKey(2));
        assert_eq!(p.take(), Delta { cleared: true, stored: vec![BlockKey(2)], evicted: vec![] });
    }

    #[test]
    fn a_repair_resends_recent_keys_as_they_stand_now() {
        let mut p = Pending::new(100);
        p.sync_taken();
        p.stored(BlockKey(1));
        p.stored(BlockKey(2));
        p.take(); // lost on the way
        p.evicted(BlockKey(1));
        p.stored(BlockKey(3));
        let held = [BlockKey(2), BlockKey(3)];
        let mut repair = p.take_repair(|k| held.contains(&k)).unwrap();
        repair.stored.sort();
        repair.evicted.sort();
        assert_eq!(repair.stored, vec![BlockKey(2), BlockKey(3)]);
        assert_eq!(repair.evicted, vec![BlockKey(1)]);
        p.require_sync();
        p.sync_taken();
        assert!(p.take_repair(|_| true).is_none(), "nothing remembered across a sync");
    }

    #[test]
    fn over_cap_turns_into_sync_and_stays_bounded() {
        let mut p = Pending::new(10);
        p.sync_taken();
        for k in 0..1000 {
            p.stored(BlockKey(k));
        }
        assert!(p.needs_sync());
        assert_eq!(p.len(), 0);
    }
}
