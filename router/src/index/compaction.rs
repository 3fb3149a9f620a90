//! Compacting a large reverse vector without holding the write lock.
//!
//! A worker's reverse vector keeps removed keys until they outnumber the
//! live ones. For a million-key worker, dropping them (a retain over two
//! million items and a sort) takes a few hundred milliseconds: inline, every
//! routing decision would wait for it. A [`Compaction`] scans the vector in
//! slices under the read lock, collecting the keys still held, once each;
//! then, under the write lock, takes what was appended meanwhile and swaps
//! the vector — O(what was appended), not O(the vector). A key removed
//! after the scan is a stale item in the new vector, as any removed key is
//! until the next compaction.

use kvroute_shared::BlockKey;

use super::{Index, KeyMap, Slot};

#[derive(Debug)]
pub struct Compaction {
    slot: Slot,
    generation: u64,
    /// Items of the vector as it was when planned; later ones are the tail.
    planned_len: usize,
    scanned: usize,
    kept: Vec<BlockKey>,
    seen: KeyMap<()>,
}

impl Compaction {
    /// Plans a compaction of `slot`'s vector (read lock).
    pub fn new(ix: &Index, slot: Slot) -> Option<Self> {
        let w = ix.workers.get(&slot)?;
        Some(Compaction {
            slot,
            generation: w.generation,
            planned_len: w.keys.len(),
            scanned: 0,
            kept: Vec::with_capacity(w.live),
            seen: KeyMap::with_capacity_and_hasher(w.live, Default::default()),
        })
    }

    /// Scans up to `budget` items (read lock); `Some(true)` while more
    /// remain, `None` if the vector was replaced meanwhile (abandon it).
    pub fn scan(&mut self, ix: &Index, budget: usize) -> Option<bool> {
        let w = ix.workers.get(&self.slot).filter(|w| w.generation == self.generation)?;
        let end = self.scanned.saturating_add(budget).min(self.planned_len);
        for &k in &w.keys[self.scanned..end] {
            if ix.forward.holds(self.slot, &k) && self.seen.insert(k, ()).is_none() {
                self.kept.push(k);
            }
        }
        self.scanned = end;
        Some(end < self.planned_len)
    }

    /// Swaps in the compacted vector plus what was appended since it was
    /// planned (write lock); false if the vector was replaced meanwhile.
    pub fn install(mut self, ix: &mut Index) -> bool {
        let slot = self.slot;
        let Some(w) = ix.workers.get_mut(&slot).filter(|w| w.generation == self.generation) else { return false };
        for &k in &w.keys[self.planned_len..] {
            if ix.forward.holds(slot, &k) && self.seen.insert(k, ()).is_none() {
                self.kept.push(k);
            }
        }
        w.keys = self.kept;
        w.generation += 1;
        true
    }
}
