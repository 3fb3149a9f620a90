//! Engine block hashes → router block keys (DESIGN.md §1, §5), per worker.
//!
//! A stored block's key is `BlockKey::chain(parent's key, its tokens)`; a block
//! without parent chains from `KeyRoot::new(model, cache_salt)` where `model` is
//! the event's `lora_name` or the worker's base model. The translator keeps, per
//! data-parallel rank, the engine hashes it could key, and reports every change
//! of the set of *router keys* to a [`KeySink`]: a key appears when its first
//! engine block is stored and leaves when its last one is removed.
//!
//! Memory: one 16-byte slot per engine hash (hash → key) plus one 8-byte slot
//! per distinct key (the key set). Counts above one — duplicate physical copies
//! of an engine hash (vLLM does not de-duplicate blocks), or several engine
//! blocks with the same key (data-parallel ranks) — are rare, so they live in
//! side maps instead of widening every slot: ≈ 26 bytes per tracked block at
//! full table load, ≈ 59 just after the tables double.

mod extras;

use std::collections::BTreeMap;
use std::collections::HashSet;

use kvroute_shared::hash::Seeded;
use kvroute_shared::{BlockKey, BlockSize, KeyRoot, ModelName};

pub use extras::SkipReason;

/// The translator's and the coalescer's maps. Their keys (engine block
/// hashes, router keys) derive from client prompts, so they are hashed with
/// the process seed: a client cannot grind prompts into one bucket (see
/// [`Seeded`]). Replaced a one-multiply fold whose low bits were the key's
/// low bits; measured in BENCHMARKS.md, "kvroute-sidecar".
pub type SeededMap<K, V> = std::collections::HashMap<K, V, Seeded>;

/// A set hashed as [`SeededMap`].
pub type SeededSet<K> = std::collections::HashSet<K, Seeded>;

use crate::decode::{BlockRemoved, BlockStored, KvEvent, Medium};
use crate::metrics::TranslateCounters;

/// A data-parallel rank of the engine (vLLM publishes each on base port + rank).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct Rank(pub u32);

/// Receives changes to the worker's set of router keys.
pub trait KeySink {
    fn stored(&mut self, key: BlockKey);
    fn evicted(&mut self, key: BlockKey);
    /// The worker holds no key any more; applies before later changes.
    fn cleared(&mut self);
}

/// A sink that ignores everything (for benchmarks and state rebuilds).
#[derive(Debug, Default)]
pub struct NullSink;

impl KeySink for NullSink {
    fn stored(&mut self, _: BlockKey) {}
    fn evicted(&mut self, _: BlockKey) {}
    fn cleared(&mut self) {}
}

#[derive(Debug, Default)]
struct RankBlocks {
    /// engine hash id → router key.
    keys: SeededMap<u64, BlockKey>,
    /// engine hash id → additional physical copies beyond the first.
    extra_copies: SeededMap<u64, u32>,
}

/// The translation state of one worker.
#[derive(Debug)]
pub struct Translator {
    base_model: ModelName,
    base_root: KeyRoot,
    block_size: BlockSize,
    ranks: BTreeMap<Rank, RankBlocks>,
    /// Every router key held by at least one (rank, engine hash) entry.
    key_set: SeededSet<BlockKey>,
    /// router key → entries holding it beyond the first.
    key_extra: SeededMap<BlockKey, u32>,
    /// Engine hashes stored while an engine snapshot is in flight: the snapshot
    /// may predate them, so reconciliation must not drop them.
    fresh: Option<SeededMap<u64, ()>>,
    counters: TranslateCounters,
}

/// What an engine snapshot did to a rank's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// These many blocks the engine no longer holds were dropped.
    Dropped(usize),
    /// The snapshot would drop more than half the rank's blocks: nothing
    /// dropped until the next snapshot agrees.
    Deferred { would_drop: usize, tracked: usize },
}

impl Translator {
    pub fn new(base_model: ModelName, block_size: BlockSize, counters: TranslateCounters) -> Self {
        let base_root = KeyRoot::new(base_model.as_str(), None);
        Translator {
            base_model,
            base_root,
            block_size,
            ranks: BTreeMap::new(),
            key_set: SeededSet::default(),
            key_extra: SeededMap::default(),
            fresh: None,
            counters,
        }
    }

    /// Applies one event from `rank`, reporting key-set changes to `sink`.
    pub fn apply(&mut self, rank: Rank, event: &KvEvent, sink: &mut impl KeySink) {
        match event {
            KvEvent::BlockStored(ev) => {
                self.counters.stored.inc();
                self.store(rank, ev, sink);
            }
            KvEvent::BlockRemoved(ev) => {
                self.counters.removed.inc();
                self.remove(rank, ev, sink);
            }
            KvEvent::AllBlocksCleared => {
                self.counters.cleared.inc();
                self.clear_rank(rank, sink);
            }
            KvEvent::Unknown => {
                self.counters.unknown_events.inc();
            }
        }
    }

    /// Whether an event concerns this engine's GPU prefix cache, group 0: the
    /// blocks a request routed here can hit. Offload tiers, remote blocks and
    /// other KV-cache groups (which repeat group 0's hashes) are counted and ignored.
    fn is_routed(&self, medium: &Option<Medium>, remote: bool, group: Option<u32>) -> bool {
        if remote || !matches!(medium, None | Some(Medium::Gpu)) {
            self.counters.offload_events.inc();
            return false;
        }
        if group.unwrap_or(0) != 0 {
            self.counters.other_group_events.inc();
            return false;
        }
        true
    }

    fn store(&mut self, rank: Rank, ev: &BlockStored, sink: &mut impl KeySink) {
        if !self.is_routed(&ev.medium, ev.remote, ev.group_idx) {
            return;
        }
        let n = ev.block_hashes.len();
        let bs = ev.block_size as usize;
        if bs == 0 || ev.token_ids.len() != n * bs {
            self.counters.skipped(SkipReason::BadLength).inc_by(n as u64);
            return;
        }
        if bs != self.block_size.get() {
            // The router chunks requests by the configured size: keys computed
            // from a different size would never match. Key them anyway (they are
            // correct for this engine) but make the misconfiguration visible,
            // in the log once (the engine was not up to be asked at start).
            if self.counters.block_size_mismatches.inc() == 0 {
                tracing::error!(
                    engine = bs,
                    configured = self.block_size.get(),
                    "the engine's KV events have another block size than --block-size: no router key will match \
                     a request; set --block-size (and the routers' block_size) to the engine's"
                );
            }
        }
        if ev.lora_id.is_some() && ev.lora_name.is_none() {
            self.counters.skipped(SkipReason::UnnamedLora).inc_by(n as u64);
            return;
        }
        let blocks = self.ranks.entry(rank).or_default();
        // vLLM's `kv_cache_report_mode: "full"` (a per-request `vllm_xargs`, so
        // any client can ask for it) re-sends `BlockStored` for the blocks a
        // request *hit*: a chain from the root, every block already held. Those
        // are the same physical blocks, and each will be removed once; counting
        // them as new copies would leave phantom keys after eviction. A genuine
        // duplicate (two requests computing the same blocks from the root in one
        // step) looks the same and is under-counted instead: its key goes one
        // eviction early, a missed hit the next engine snapshot restores.
        // The chain may go on past what this sidecar keyed (a multimodal
        // block it skips, or blocks stored while its replay did not reach
        // back): the known leading run is a re-report all the same, and the
        // rest chains from its end. Counting the run as copies left keys no
        // eviction removes, one more copy per such request.
        let known = match ev.parent_block_hash {
            None => ev.block_hashes.iter().take_while(|h| blocks.keys.contains_key(&h.id())).count(),
            Some(_) => 0,
        };
        if known > 0 {
            self.counters.rereported_stores.inc();
            if known == n {
                return;
            }
        }
        let mut parent = match &ev.parent_block_hash {
            Some(p) => match blocks.keys.get(&p.id()) {
                Some(k) => Some(*k),
                None => {
                    self.counters.unanchored_stores.inc();
                    return;
                }
            },
            None => known.checked_sub(1).map(|last| blocks.keys[&ev.block_hashes[last].id()]),
        };
        let chunks = ev.block_hashes.iter().zip(ev.token_ids.chunks_exact(bs)).enumerate().skip(known);
        for (i, (hash, tokens)) in chunks {
            let extras = ev.extra_keys.as_ref().and_then(|e| e.get(i)).and_then(|k| k.as_deref());
            let salt = match extras::classify(extras, ev.lora_name.as_deref(), parent.is_none()) {
                Ok(salt) => salt,
                Err(reason) => {
                    // Later blocks chain through this one: none of them can be keyed.
                    self.counters.skipped(reason).inc_by((n - i) as u64);
                    return;
                }
            };
            let parent_key = match parent {
                Some(k) => k,
                None => match (ev.lora_name.as_deref(), salt) {
                    (None, None) => self.base_root.0,
                    (lora, salt) => KeyRoot::new(lora.unwrap_or(self.base_model.as_str()), salt).0,
                },
            };
            let key = BlockKey::chain(parent_key, tokens);
            let id = hash.id();
            match blocks.keys.get(&id) {
                Some(existing) => {
                    *blocks.extra_copies.entry(id).or_insert(0) += 1;
                    parent = Some(*existing);
                    continue;
                }
                None => {
                    blocks.keys.insert(id, key);
                    if let Some(fresh) = &mut self.fresh {
                        fresh.insert(id, ());
                    }
                }
            }
            if self.key_set.insert(key) {
                sink.stored(key);
            } else {
                *self.key_extra.entry(key).or_insert(0) += 1;
            }
            parent = Some(key);
        }
    }

    fn remove(&mut self, rank: Rank, ev: &BlockRemoved, sink: &mut impl KeySink) {
        if !self.is_routed(&ev.medium, ev.remote, ev.group_idx) {
            return;
        }
        let Some(blocks) = self.ranks.get_mut(&rank) else {
            self.counters.unknown_removals.inc_by(ev.block_hashes.len() as u64);
            return;
        };
        for hash in &ev.block_hashes {
            let id = hash.id();
            if let Some(copies) = blocks.extra_copies.get_mut(&id) {
                *copies -= 1;
                if *copies == 0 {
                    blocks.extra_copies.remove(&id);
                }
                continue;
            }
            match blocks.keys.remove(&id) {
                Some(key) => release(&mut self.key_set, &mut self.key_extra, key, sink),
                None => {
                    self.counters.unknown_removals.inc();
                }
            }
        }
    }

    /// Forgets every block of `rank` (AllBlocksCleared, engine restart, lost gap).
    pub fn clear_rank(&mut self, rank: Rank, sink: &mut impl KeySink) {
        let Some(blocks) = self.ranks.remove(&rank) else {
            return;
        };
        if self.ranks.is_empty() {
            self.key_set.clear();
            self.key_extra.clear();
            sink.cleared();
            return;
        }
        for key in blocks.keys.into_values() {
            self.release(key, sink);
        }
    }

    /// Starts an engine snapshot: blocks stored from now on are kept by the
    /// next [`Translator::retain_engine_hashes`].
    pub fn begin_snapshot(&mut self) {
        self.fresh = Some(SeededMap::default());
    }

    /// Drops every block of `rank` whose engine hash id is not in `held` (the
    /// engine's own snapshot of its prefix cache, taken after the last
    /// [`Translator::begin_snapshot`]). A snapshot that would drop more than
    /// half the rank's blocks is held back unless `confirmed` (the previous
    /// snapshot wanted the same): a hook that answers empty, or another
    /// engine answering on its port, must not empty the worker at once.
    pub fn retain_engine_hashes(
        &mut self,
        rank: Rank,
        held: &HashSet<u64>,
        confirmed: bool,
        sink: &mut impl KeySink,
    ) -> Reconciled {
        let fresh = self.fresh.take().unwrap_or_default();
        let Some(blocks) = self.ranks.get_mut(&rank) else {
            return Reconciled::Dropped(0);
        };
        let gone: Vec<u64> =
            blocks.keys.keys().filter(|id| !held.contains(id) && !fresh.contains_key(id)).copied().collect();
        let tracked = blocks.keys.len();
        if gone.len() * 2 > tracked && !confirmed {
            return Reconciled::Deferred { would_drop: gone.len(), tracked };
        }
        for id in &gone {
            blocks.extra_copies.remove(id);
            if let Some(key) = blocks.keys.remove(id) {
                release(&mut self.key_set, &mut self.key_extra, key, sink);
            }
        }
        Reconciled::Dropped(gone.len())
    }

    /// Every router key the worker currently holds.
    pub fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.key_set.iter().copied()
    }

    pub fn contains_key(&self, key: BlockKey) -> bool {
        self.key_set.contains(&key)
    }

    /// Distinct router keys held.
    pub fn key_count(&self) -> usize {
        self.key_set.len()
    }

    fn release(&mut self, key: BlockKey, sink: &mut impl KeySink) {
        release(&mut self.key_set, &mut self.key_extra, key, sink);
    }

    /// Engine blocks tracked across ranks.
    pub fn block_count(&self) -> usize {
        self.ranks.values().map(|r| r.keys.len()).sum()
    }

    /// Bytes of table memory allocated for what is tracked (slots × slot size,
    /// including hashbrown's one control byte per slot): the figure behind
    /// "bytes per tracked block".
    pub fn table_bytes(&self) -> usize {
        fn slot_bytes<K, V>(capacity: usize) -> usize {
            // hashbrown keeps buckets ≥ capacity·8/7 (a power of two); estimate
            // from the reported capacity, which is what is usable.
            let buckets = (capacity * 8).div_ceil(7).next_power_of_two();
            buckets * (std::mem::size_of::<(K, V)>() + 1)
        }
        let ranks: usize = self
            .ranks
            .values()
            .map(|r| slot_bytes::<u64, BlockKey>(r.keys.capacity()) + slot_bytes::<u64, u32>(r.extra_copies.capacity()))
            .sum();
        ranks
            + slot_bytes::<BlockKey, ()>(self.key_set.capacity())
            + slot_bytes::<BlockKey, u32>(self.key_extra.capacity())
    }
}

fn release(
    key_set: &mut SeededSet<BlockKey>,
    key_extra: &mut SeededMap<BlockKey, u32>,
    key: BlockKey,
    sink: &mut impl KeySink,
) {
    if let Some(extra) = key_extra.get_mut(&key) {
        *extra -= 1;
        if *extra == 0 {
            key_extra.remove(&key);
        }
    } else if key_set.remove(&key) {
        sink.evicted(key);
    }
}

#[cfg(test)]
mod tests;
