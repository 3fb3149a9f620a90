//! One sidecar, modelled: it turns its engine's KV events into router keys
//! (as the real sidecar's `translate` does: a stored block's key is chained
//! from its parent's, duplicates are refcounted), coalesces them into the next
//! 100 ms batch, and hands routers a full sync every 5 s.
//!
//! Delivery is decided by the cluster with a seeded loss rate. As the real
//! sidecar does after a failed push, a router that lost a batch is marked for
//! a full sync; a sync to a router that lost nothing since the last one would
//! only re-confirm what it already holds (its only other effect, dropping
//! unconfirmed speculative entries, the router's own TTL expiry also does),
//! so the lab skips those to keep 256-worker runs fast.

use std::collections::HashMap;

use kvroute_shared::{BlockKey, KeyRoot};
use kvroute_sim::events::{BlockHash, KvEvent};

use crate::engine::EngineLoad;

/// What one push carries (`/internal/eviction`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    pub cleared: bool,
    pub evicted: Vec<BlockKey>,
    pub stored: Vec<BlockKey>,
    pub load: Option<EngineLoad>,
}

#[derive(Debug)]
pub struct Sidecar {
    root: KeyRoot,
    /// Engine hash → (router key, physical copies).
    keys: HashMap<BlockHash, (BlockKey, u32)>,
    /// Net change since the last batch: key → held at the end?
    delta: HashMap<BlockKey, bool>,
    cleared: bool,
    /// The last scraped load, sent with the next batch.
    load: Option<EngineLoad>,
    /// Per router: lost a batch since its last delivered sync.
    stale: Vec<bool>,
    /// Stores whose parent was never seen (cannot be keyed).
    pub orphans: u64,
}

impl Sidecar {
    pub fn new(model: &str, routers: usize) -> Sidecar {
        Sidecar {
            root: KeyRoot::new(model, None),
            keys: HashMap::new(),
            delta: HashMap::new(),
            cleared: false,
            load: None,
            stale: vec![false; routers],
            orphans: 0,
        }
    }

    pub fn ingest(&mut self, events: &[KvEvent]) {
        for ev in events {
            match ev {
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, .. } => {
                    let bs = *block_size as usize;
                    let mut parent = match parent_block_hash {
                        None => Some(self.root.0),
                        Some(p) => self.keys.get(p).map(|(k, _)| *k),
                    };
                    for (i, h) in block_hashes.iter().enumerate() {
                        let Some(p) = parent else {
                            self.orphans += 1;
                            break;
                        };
                        let entry = self
                            .keys
                            .entry(*h)
                            .or_insert_with(|| (BlockKey::chain(p, &token_ids[i * bs..(i + 1) * bs]), 0));
                        entry.1 += 1;
                        let key = entry.0;
                        if entry.1 == 1 {
                            self.delta.insert(key, true);
                        }
                        parent = Some(key);
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        if let Some(e) = self.keys.get_mut(h) {
                            e.1 -= 1;
                            if e.1 == 0 {
                                let key = e.0;
                                self.keys.remove(h);
                                self.delta.insert(key, false);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.keys.clear();
                    self.delta.clear();
                    self.cleared = true;
                }
            }
        }
    }

    pub fn scrape(&mut self, load: EngineLoad) {
        self.load = Some(load);
    }

    /// The batch due now (empty deltas still carry the load), in a
    /// deterministic order.
    pub fn take_batch(&mut self) -> Batch {
        let mut stored = Vec::new();
        let mut evicted = Vec::new();
        for (k, held) in self.delta.drain() {
            if held { stored.push(k) } else { evicted.push(k) }
        }
        stored.sort_unstable();
        evicted.sort_unstable();
        Batch { cleared: std::mem::take(&mut self.cleared), evicted, stored, load: self.load }
    }

    pub fn mark_stale(&mut self, router: usize) {
        self.stale[router] = true;
    }

    /// Whether `router` needs the full sync that is due.
    pub fn needs_sync(&self, router: usize) -> bool {
        self.stale[router]
    }

    pub fn synced(&mut self, router: usize) {
        self.stale[router] = false;
    }

    /// Every key the engine holds, sorted.
    pub fn snapshot(&self) -> Vec<BlockKey> {
        let mut v: Vec<BlockKey> = self.keys.values().map(|(k, _)| *k).collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use kvroute_shared::{BlockSize, block_keys};
    use kvroute_sim::events::Medium;

    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens,
            block_size: 4,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: None,
        }
    }

    #[test]
    fn keys_match_the_routers_and_duplicates_are_counted() {
        let tokens: Vec<u32> = (1..=8).collect();
        let want = block_keys(KeyRoot::new("m", None), &tokens, BlockSize::new(4).unwrap());
        let mut s = Sidecar::new("m", 1);
        s.ingest(&[stored(&[10], None, tokens[..4].to_vec()), stored(&[11], Some(10), tokens[4..].to_vec())]);
        s.ingest(&[stored(&[11], Some(10), tokens[4..].to_vec())]);
        let b = s.take_batch();
        assert_eq!(b.stored, {
            let mut w = want.clone();
            w.sort();
            w
        });
        let removed = KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(11)], medium: Medium::Gpu };
        s.ingest(std::slice::from_ref(&removed));
        assert!(s.take_batch().evicted.is_empty(), "one copy of block 11 is still cached");
        s.ingest(&[removed]);
        assert_eq!(s.take_batch().evicted, vec![want[1]]);
        assert_eq!(s.snapshot(), vec![want[0]]);
    }
}
