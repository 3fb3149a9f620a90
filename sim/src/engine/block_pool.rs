//! The paged KV cache: vLLM v1's `BlockPool` semantics.
//!
//! - Blocks are reference counted while requests use them.
//! - A full prompt block gets its hash registered ("cached") when the step that
//!   computes it is scheduled, as vLLM's `allocate_slots` does; that emits
//!   `BlockStored`. Only prompt blocks are cached here (vLLM also caches full
//!   blocks of generated text; the simulator's filler output is never reused,
//!   so caching it would only churn the LRU).
//! - Freed blocks go to the LRU free queue tail, a sequence's blocks in reverse
//!   order, so its last block is evicted before its first.
//! - Allocation pops the queue head; if that block still holds a hash it is
//!   evicted (`BlockRemoved`, one event per block as vLLM emits them).
//! - A hash already registered by another block is not registered twice
//!   (vLLM would keep a duplicate); the simulator's set stays a plain set.

use std::collections::HashMap;

use kvroute_shared::{BlockKey, KeyRoot};

use super::free_queue::FreeQueue;
use super::hashing::BlockExtras;
use crate::events::{BlockHash, KvEvent, Medium};

/// A physical block's index in the pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockId(pub u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Clone, Debug, Default)]
struct Block {
    hash: Option<BlockHash>,
    refs: u32,
}

/// What a `BlockStored` event says about who owns the blocks.
#[derive(Clone, Copy, Debug)]
pub struct StoreMeta<'a> {
    pub lora_id: Option<u32>,
    pub extras: &'a BlockExtras,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: FreeQueue,
    cached: HashMap<BlockHash, BlockId>,
    /// kvroute's router key of every cached block: the ground truth tests
    /// compare the router's map against (`GET /sim/cache`). One SHA-256 per
    /// newly stored block.
    router_keys: HashMap<BlockHash, BlockKey>,
    /// The served model: the key root of blocks without a LoRA adapter.
    model: String,
    events: Vec<KvEvent>,
    block_size: usize,
    used: usize,
}

impl BlockPool {
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        BlockPool {
            blocks: vec![Block::default(); num_blocks as usize],
            free: FreeQueue::full(num_blocks),
            cached: HashMap::new(),
            router_keys: HashMap::new(),
            model: String::new(),
            events: Vec::new(),
            block_size,
            used: 0,
        }
    }

    /// Names the served model (the key root of blocks without an adapter).
    pub fn with_model(mut self, model: &str) -> Self {
        self.model = model.to_owned();
        self
    }

    /// Router keys of every cached block.
    pub fn router_keys(&self) -> Vec<BlockKey> {
        self.router_keys.values().copied().collect()
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Fraction of blocks referenced by running requests (vLLM's
    /// `kv_cache_usage_perc`: cached-but-free blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() { 0.0 } else { self.used as f64 / self.blocks.len() as f64 }
    }

    /// The physical blocks holding the longest cached prefix of `hashes`.
    pub fn longest_hit(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// How many new blocks could be allocated after touching `hits` (hit
    /// blocks that sit in the free queue stop being allocatable).
    pub fn allocatable_after(&self, hits: &[BlockId]) -> usize {
        let free_hits = hits.iter().filter(|b| self.free.contains(**b)).count();
        self.free.len() - free_hits
    }

    /// Takes a reference on each hit block, pulling free ones out of the LRU.
    pub fn touch(&mut self, hits: &[BlockId]) {
        for &b in hits {
            let block = &mut self.blocks[b.index()];
            if block.refs == 0 {
                self.free.remove(b);
                self.used += 1;
            }
            block.refs += 1;
        }
    }

    /// Pops `n` blocks from the free-queue head, evicting cached ones; `None`
    /// (and nothing changed) if fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.free.pop_front()?;
            let block = &mut self.blocks[b.index()];
            if let Some(h) = block.hash.take() {
                self.cached.remove(&h);
                self.router_keys.remove(&h);
                self.events.push(KvEvent::BlockRemoved { block_hashes: vec![h], medium: Medium::Gpu });
            }
            block.refs = 1;
            self.used += 1;
            out.push(b);
        }
        Some(out)
    }

    /// Registers the hashes of a sequence's full blocks `from..to` (`blocks[i]`
    /// holds the block with `hashes[i]`), emitting one `BlockStored` per run of
    /// newly registered blocks.
    pub fn cache(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        tokens: &[u32],
        range: std::ops::Range<usize>,
        meta: StoreMeta<'_>,
    ) {
        let mut run_start: Option<usize> = None;
        for i in range.clone() {
            let b = blocks[i];
            let fresh = self.blocks[b.index()].hash.is_none() && !self.cached.contains_key(&hashes[i]);
            if fresh {
                self.blocks[b.index()].hash = Some(hashes[i]);
                self.cached.insert(hashes[i], b);
                run_start.get_or_insert(i);
            } else if let Some(s) = run_start.take() {
                self.stored(hashes, tokens, s..i, meta);
            }
        }
        if let Some(s) = run_start {
            self.stored(hashes, tokens, s..range.end, meta);
        }
    }

    fn stored(&mut self, hashes: &[BlockHash], tokens: &[u32], run: std::ops::Range<usize>, meta: StoreMeta<'_>) {
        let bs = self.block_size;
        let root =
            KeyRoot::new(meta.extras.lora_name.as_deref().unwrap_or(&self.model), meta.extras.cache_salt.as_deref());
        let mut parent = match run.start.checked_sub(1) {
            None => Some(root.0),
            Some(p) => self.router_keys.get(&hashes[p]).copied(),
        };
        for i in run.clone() {
            if let Some(key) = parent.map(|p| BlockKey::chain(p, &tokens[i * bs..(i + 1) * bs])) {
                self.router_keys.insert(hashes[i], key);
                parent = Some(key);
            }
        }
        let extra_keys: Vec<_> = run.clone().map(|i| meta.extras.keys_for(i)).collect();
        let any_extra = extra_keys.iter().any(Option::is_some);
        self.events.push(KvEvent::BlockStored {
            block_hashes: hashes[run.clone()].to_vec(),
            parent_block_hash: run.start.checked_sub(1).map(|p| hashes[p]),
            token_ids: tokens[run.start * bs..run.end * bs].to_vec(),
            block_size: bs as u32,
            lora_id: meta.lora_id,
            medium: Medium::Gpu,
            lora_name: meta.extras.lora_name.clone(),
            extra_keys: any_extra.then_some(extra_keys),
        });
    }

    /// Drops one reference per block; blocks reaching zero join the free-queue
    /// tail in reverse order (the sequence's tail is evicted first).
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let block = &mut self.blocks[b.index()];
            if block.refs == 0 {
                // A double free would corrupt the LRU; refuse it loudly in
                // debug builds and harmlessly in release.
                debug_assert!(false, "block {b:?} freed with no reference");
                continue;
            }
            block.refs -= 1;
            if block.refs == 0 {
                self.used -= 1;
                self.free.push_back(b);
            }
        }
    }

    /// `/reset_prefix_cache`: forgets every hash. Blocks in use keep serving
    /// their requests but are no longer shared (vLLM refuses the reset while
    /// blocks are in use; forgetting is the same from the outside and never fails).
    pub fn reset(&mut self) {
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        self.router_keys.clear();
        self.events.push(KvEvent::AllBlocksCleared);
    }

    /// Events produced since the last call, in the order they happened.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn cached_hashes(&self) -> impl Iterator<Item = &BlockHash> {
        self.cached.keys()
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.blocks[b.index()].refs
    }

    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.order()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::hashing::{HashMode, prompt_hashes};

    fn meta(extras: &BlockExtras) -> StoreMeta<'_> {
        StoreMeta { lora_id: None, extras }
    }

    /// Allocates and caches a whole prompt, the way admission does.
    fn admit(pool: &mut BlockPool, tokens: &[u32]) -> (Vec<BlockId>, usize) {
        let ex = BlockExtras::default();
        let hashes = prompt_hashes(tokens, pool.block_size(), &ex, HashMode::Int);
        let hits = pool.longest_hit(&hashes[..(tokens.len() - 1) / pool.block_size()]);
        pool.touch(&hits);
        let n_hits = hits.len();
        let mut blocks = hits;
        let total = tokens.len().div_ceil(pool.block_size());
        blocks.extend(pool.allocate(total - n_hits).expect("room"));
        pool.cache(&blocks, &hashes, tokens, n_hits..hashes.len(), meta(&ex));
        (blocks, n_hits)
    }

    #[test]
    fn freed_blocks_are_evicted_tail_first() {
        let mut pool = BlockPool::new(4, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4]);
        pool.free(&a);
        // Blocks 2 and 3 were never used; then a's blocks, last block first.
        assert_eq!(pool.free_order(), vec![BlockId(2), BlockId(3), a[1], a[0]]);
        pool.take_events();
        let got = pool.allocate(3).expect("room");
        assert_eq!(got, vec![BlockId(2), BlockId(3), a[1]]);
        let ev = pool.take_events();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert!(matches!(&ev[0], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1));
        assert_eq!(pool.cached_hashes().count(), 1, "the first block survives");
    }

    #[test]
    fn refcounts_keep_shared_blocks_out_of_the_free_queue() {
        let mut pool = BlockPool::new(8, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4, 5]);
        let (b, hits) = admit(&mut pool, &[1, 2, 3, 4, 9]);
        assert_eq!(hits, 2);
        assert_eq!(pool.refs(a[0]), 2);
        assert_eq!(&b[..2], &a[..2]);
        pool.free(&a);
        assert_eq!(pool.refs(a[0]), 1);
        assert!(!pool.free_order().contains(&a[0]));
        assert!(pool.free_order().contains(&a[2]));
        pool.free(&b);
        assert_eq!(pool.refs(a[0]), 0);
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn a_hit_never_covers_the_last_token() {
        let mut pool = BlockPool::new(8, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4]);
        pool.free(&a);
        // The same 4 tokens again: both blocks are cached, but only one may hit.
        let (_, hits) = admit(&mut pool, &[1, 2, 3, 4]);
        assert_eq!(hits, 1);
    }

    #[test]
    fn allocation_fails_whole_when_short() {
        let mut pool = BlockPool::new(2, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3]);
        assert_eq!(a.len(), 2);
        assert!(pool.allocate(1).is_none());
        assert_eq!(pool.allocatable_after(&[]), 0);
        pool.free(&a);
        assert_eq!(pool.allocatable_after(&a[..1]), 1);
    }

    #[test]
    fn stored_events_chain_parents() {
        let mut pool = BlockPool::new(8, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4]);
        let (_, hits) = admit(&mut pool, &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(hits, 2);
        let ev = pool.take_events();
        assert_eq!(ev.len(), 2);
        let KvEvent::BlockStored { block_hashes: first, parent_block_hash: None, .. } = &ev[0] else {
            panic!("{ev:?}")
        };
        let KvEvent::BlockStored { block_hashes, parent_block_hash: Some(p), token_ids, .. } = &ev[1] else {
            panic!("{ev:?}")
        };
        assert_eq!(p, &first[1]);
        assert_eq!(block_hashes.len(), 1);
        assert_eq!(token_ids, &vec![5, 6]);
        pool.reset();
        assert_eq!(pool.cached_hashes().count(), 0);
        assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
        pool.free(&a);
    }
}
