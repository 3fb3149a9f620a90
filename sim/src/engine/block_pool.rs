//! The paged KV cache: vLLM v1's `BlockPool` (vllm/v1/core/block_pool.py).
//!
//! - Block 0 is vLLM's null block: taken out of the free queue at start and
//!   never handed out, so `--num-blocks N` leaves N − 1 blocks for requests,
//!   exactly as `--num-gpu-blocks-override N` does in vLLM.
//! - Blocks are reference counted while requests use them.
//! - Every full block a request computes, prompt or generated, gets its hash
//!   registered ("cached") when the step that computes it is scheduled
//!   (`allocate_slots` → `cache_full_blocks`); each such call emits one
//!   `BlockStored` covering all the blocks it registered.
//! - Hashes are not deduplicated: when a block is computed again while an
//!   identical one is cached (a prompt whose last full block may not hit, a
//!   resumed request), the second physical block is registered under the same
//!   hash and stored (and later removed) with its own events. A lookup takes
//!   the first block registered under a hash, as `BlockHashToBlockMap` does.
//! - Freeing walks a request's blocks in reverse: blocks with a hash join the
//!   free-queue tail (least recently used is evicted first, a request's tail
//!   before its head); blocks without one go to the head, to be reused first.
//! - Allocation pops the queue head; a block that still holds a hash is
//!   evicted (`BlockRemoved`, one event per block as vLLM emits them).
//! - `/reset_prefix_cache` is refused while any block is in use.

use std::collections::HashMap;

use kvroute_shared::{BlockKey, KeyRoot};

use super::free_queue::FreeQueue;
use super::hashing::BlockExtras;
use crate::events::{BlockHash, KvEvent, Medium};

/// A physical block's index in the pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockId(pub u32);

impl BlockId {
    /// vLLM's placeholder block, never allocated.
    pub const NULL: BlockId = BlockId(0);

    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Clone, Debug, Default)]
struct Block {
    hash: Option<BlockHash>,
    refs: u32,
}

/// The physical blocks registered under one hash, oldest first. Almost always
/// one, so that case does not allocate (vLLM keeps the same union for GC cost).
#[derive(Clone, Debug)]
enum Holders {
    One(BlockId),
    Many(Vec<BlockId>),
}

impl Holders {
    fn first(&self) -> BlockId {
        match self {
            Holders::One(b) => *b,
            Holders::Many(v) => v[0],
        }
    }

    fn len(&self) -> usize {
        match self {
            Holders::One(_) => 1,
            Holders::Many(v) => v.len(),
        }
    }

    fn contains(&self, b: BlockId) -> bool {
        match self {
            Holders::One(x) => *x == b,
            Holders::Many(v) => v.contains(&b),
        }
    }

    fn push(&mut self, b: BlockId) {
        match self {
            Holders::One(x) => *self = Holders::Many(vec![*x, b]),
            Holders::Many(v) => v.push(b),
        }
    }

    /// Removes `b`; true if it was there.
    fn remove(&mut self, b: BlockId) -> bool {
        match self {
            Holders::One(x) => *x == b,
            Holders::Many(v) => match v.iter().position(|x| *x == b) {
                Some(i) => {
                    v.remove(i);
                    true
                }
                None => false,
            },
        }
    }
}

/// What a `BlockStored` event says about who owns the blocks.
#[derive(Clone, Copy, Debug)]
pub struct StoreMeta<'a> {
    pub lora_id: Option<u32>,
    pub extras: &'a BlockExtras,
}

/// One request's view of a caching call: its blocks, the hashes and tokens of
/// its full blocks, and which of them to register.
#[derive(Clone, Copy, Debug)]
pub struct FullBlocks<'a> {
    pub blocks: &'a [BlockId],
    pub hashes: &'a [BlockHash],
    pub tokens: &'a [u32],
    pub meta: StoreMeta<'a>,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: FreeQueue,
    cached: HashMap<BlockHash, Holders>,
    /// kvroute's router key of every cached hash: the ground truth tests
    /// compare the router's map against (`GET /sim/cache`). One SHA-256 per
    /// newly stored hash.
    router_keys: HashMap<BlockHash, BlockKey>,
    /// The served model: the key root of blocks without a LoRA adapter.
    model: String,
    events: Vec<KvEvent>,
    block_size: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, block 0 reserved as the null block.
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        let mut free = FreeQueue::full(num_blocks);
        free.remove(BlockId::NULL);
        BlockPool {
            blocks: vec![Block::default(); num_blocks as usize],
            free,
            cached: HashMap::new(),
            router_keys: HashMap::new(),
            model: String::new(),
            events: Vec::new(),
            block_size,
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

    /// Blocks requests can use (all but the null block).
    pub fn usable_blocks(&self) -> usize {
        self.blocks.len().saturating_sub(1)
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Fraction of usable blocks referenced by requests (vLLM's
    /// `kv_cache_usage_perc`: cached-but-free blocks count as free).
    pub fn usage(&self) -> f64 {
        let usable = self.usable_blocks();
        if usable == 0 { 0.0 } else { 1.0 - self.free.len() as f64 / usable as f64 }
    }

    /// The physical blocks holding the longest cached prefix of `hashes`.
    pub fn longest_hit(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.cached.get(h).map(Holders::first)).collect()
    }

    /// How many of `blocks` sit in the free queue (touching them takes them
    /// out, so they count against the free blocks like new ones).
    pub fn evictable(&self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|b| self.blocks[b.index()].refs == 0).count()
    }

    /// Takes a reference on each hit block, pulling free ones out of the LRU.
    pub fn touch(&mut self, hits: &[BlockId]) {
        for &b in hits {
            let block = &mut self.blocks[b.index()];
            if block.refs == 0 {
                self.free.remove(b);
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
            if let Some(h) = self.blocks[b.index()].hash.take() {
                self.evict(h, b);
            }
            self.blocks[b.index()].refs = 1;
            out.push(b);
        }
        Some(out)
    }

    fn evict(&mut self, h: BlockHash, b: BlockId) {
        let Some(holders) = self.cached.get_mut(&h) else { return };
        let last = holders.len() == 1;
        if !holders.remove(b) {
            return;
        }
        if last {
            self.cached.remove(&h);
            self.router_keys.remove(&h);
        }
        self.events.push(KvEvent::BlockRemoved { block_hashes: vec![h], medium: Medium::Gpu });
    }

    /// Registers the hashes of a request's full blocks `range` (`blocks[i]`
    /// holds the block with `hashes[i]`) and emits one `BlockStored` for the
    /// whole range, duplicates included, as vLLM's `cache_full_blocks` does.
    pub fn cache_full_blocks(&mut self, req: FullBlocks<'_>, range: std::ops::Range<usize>) {
        if range.is_empty() {
            return;
        }
        let bs = self.block_size;
        let root = KeyRoot::new(
            req.meta.extras.lora_name.as_deref().unwrap_or(&self.model),
            req.meta.extras.cache_salt.as_deref(),
        );
        let mut parent = match range.start.checked_sub(1) {
            None => Some(root.0),
            Some(p) => self.router_keys.get(&req.hashes[p]).copied(),
        };
        for i in range.clone() {
            let (b, h) = (req.blocks[i], req.hashes[i]);
            let block = &mut self.blocks[b.index()];
            if block.hash.is_none() {
                block.hash = Some(h);
                match self.cached.get_mut(&h) {
                    Some(holders) if !holders.contains(b) => holders.push(b),
                    Some(_) => {}
                    None => {
                        self.cached.insert(h, Holders::One(b));
                    }
                }
            }
            parent = match self.router_keys.get(&h) {
                Some(k) => Some(*k),
                None => parent.map(|p| {
                    let key = BlockKey::chain(p, &req.tokens[i * bs..(i + 1) * bs]);
                    self.router_keys.insert(h, key);
                    key
                }),
            };
        }
        let extra_keys: Vec<_> = range.clone().map(|i| req.meta.extras.keys_for(i)).collect();
        let any_extra = extra_keys.iter().any(Option::is_some);
        self.events.push(KvEvent::BlockStored {
            block_hashes: req.hashes[range.clone()].to_vec(),
            parent_block_hash: range.start.checked_sub(1).map(|p| req.hashes[p]),
            token_ids: req.tokens[range.start * bs..range.end * bs].to_vec(),
            block_size: bs as u32,
            lora_id: req.meta.lora_id,
            medium: Medium::Gpu,
            lora_name: req.meta.extras.lora_name.clone(),
            extra_keys: any_extra.then_some(extra_keys),
        });
    }

    /// Drops one reference per block of a request (`blocks` in the request's
    /// order). Walking them in reverse, blocks reaching zero references go to
    /// the free-queue tail if they hold a hash, else to its head.
    pub fn free(&mut self, blocks: &[BlockId]) {
        let mut reuse_first = Vec::new();
        let mut evict_last = Vec::new();
        for &b in blocks.iter().rev() {
            let block = &mut self.blocks[b.index()];
            if block.refs == 0 || b == BlockId::NULL {
                // A double free would corrupt the LRU; refuse it loudly in
                // debug builds and harmlessly in release.
                debug_assert!(false, "block {b:?} freed with no reference");
                continue;
            }
            block.refs -= 1;
            if block.refs == 0 {
                if block.hash.is_none() { reuse_first.push(b) } else { evict_last.push(b) }
            }
        }
        self.free.push_front_n(&reuse_first);
        for b in evict_last {
            self.free.push_back(b);
        }
    }

    /// `/reset_prefix_cache`: forgets every hash and publishes
    /// `AllBlocksCleared`, or refuses (false, nothing changed) while any block
    /// is in use, as vLLM does.
    pub fn reset(&mut self) -> bool {
        if self.free.len() != self.usable_blocks() {
            return false;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        self.router_keys.clear();
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Events produced since the last call, in the order they happened.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached hash with the number of physical blocks holding it.
    pub fn cached_hashes(&self) -> impl Iterator<Item = (&BlockHash, usize)> {
        self.cached.iter().map(|(h, holders)| (h, holders.len()))
    }

    pub fn refs(&self, b: BlockId) -> u32 {
        self.blocks[b.index()].refs
    }

    /// Free-queue order, next to be allocated first.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.order()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::hashing::{HashMode, prompt_hashes};

    /// Allocates and caches a whole prompt, the way admission does (the hit
    /// may not cover the last token).
    fn admit(pool: &mut BlockPool, tokens: &[u32]) -> (Vec<BlockId>, usize) {
        let ex = BlockExtras::default();
        let bs = pool.block_size();
        let hashes = prompt_hashes(tokens, bs, &ex, HashMode::Int);
        let hits = pool.longest_hit(&hashes[..(tokens.len() - 1) / bs]);
        pool.touch(&hits);
        let n_hits = hits.len();
        let mut blocks = hits;
        blocks.extend(pool.allocate(tokens.len().div_ceil(bs) - n_hits).expect("room"));
        let meta = StoreMeta { lora_id: None, extras: &ex };
        pool.cache_full_blocks(FullBlocks { blocks: &blocks, hashes: &hashes, tokens, meta }, n_hits..hashes.len());
        (blocks, n_hits)
    }

    fn stored(ev: &KvEvent) -> (&[BlockHash], Option<BlockHash>) {
        match ev {
            KvEvent::BlockStored { block_hashes, parent_block_hash, .. } => (block_hashes, *parent_block_hash),
            other => panic!("not a store: {other:?}"),
        }
    }

    #[test]
    fn block_zero_is_the_null_block() {
        let pool = BlockPool::new(4, 2);
        assert_eq!(pool.usable_blocks(), 3);
        assert_eq!(pool.free_order(), vec![BlockId(1), BlockId(2), BlockId(3)]);
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn freed_cached_blocks_are_evicted_tail_first() {
        let mut pool = BlockPool::new(4, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4]);
        assert_eq!(a, vec![BlockId(1), BlockId(2)]);
        pool.free(&a);
        // Block 3 was never used; then a's blocks, last block first.
        assert_eq!(pool.free_order(), vec![BlockId(3), a[1], a[0]]);
        pool.take_events();
        let got = pool.allocate(2).expect("room");
        assert_eq!(got, vec![BlockId(3), a[1]]);
        let ev = pool.take_events();
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert!(matches!(&ev[0], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1));
        assert_eq!(pool.cached_hashes().count(), 1, "the first block survives");
    }

    #[test]
    fn freed_uncached_blocks_are_reused_first() {
        let mut pool = BlockPool::new(6, 2);
        // Two full blocks and a partial one.
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4, 5]);
        assert_eq!(a, vec![BlockId(1), BlockId(2), BlockId(3)]);
        pool.free(&a);
        assert_eq!(pool.free_order(), vec![BlockId(3), BlockId(4), BlockId(5), BlockId(2), BlockId(1)]);
        assert_eq!(pool.allocate(1), Some(vec![BlockId(3)]));
        assert!(pool.take_events().iter().all(|e| matches!(e, KvEvent::BlockStored { .. })), "nothing evicted");
    }

    #[test]
    fn refcounts_keep_shared_blocks_out_of_the_free_queue() {
        let mut pool = BlockPool::new(8, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4, 5]);
        let (b, hits) = admit(&mut pool, &[1, 2, 3, 4, 9]);
        assert_eq!(hits, 2);
        assert_eq!(pool.refs(a[0]), 2);
        assert_eq!(&b[..2], &a[..2]);
        assert_eq!(pool.evictable(&a), 0);
        pool.free(&a);
        assert_eq!(pool.refs(a[0]), 1);
        assert!(!pool.free_order().contains(&a[0]));
        assert!(pool.free_order().contains(&a[2]));
        pool.free(&b);
        assert_eq!(pool.refs(a[0]), 0);
        assert_eq!(pool.evictable(&a), 3);
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn a_recomputed_block_is_registered_twice_and_removed_twice() {
        let mut pool = BlockPool::new(8, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4]);
        // The same 4 tokens again: both blocks are cached, but only one may
        // hit, so the second block is computed again into another block.
        let (b, hits) = admit(&mut pool, &[1, 2, 3, 4]);
        assert_eq!(hits, 1);
        assert_ne!(a[1], b[1]);
        let ev = pool.take_events();
        assert_eq!(ev.len(), 2);
        let (first, _) = stored(&ev[0]);
        let (second, parent) = stored(&ev[1]);
        assert_eq!(second, &first[1..], "BlockStored again under the same hash");
        assert_eq!(parent, Some(first[0]));
        assert_eq!(pool.cached_hashes().find(|(h, _)| **h == first[1]).map(|(_, n)| n), Some(2));
        // A hit takes the block registered first.
        assert_eq!(pool.longest_hit(first), vec![a[0], a[1]]);
        pool.free(&a);
        pool.free(&b);
        // Never-used blocks, then a's tail, then b's tail and the shared head.
        assert_eq!(pool.free_order()[4..], [a[1], b[1], a[0]]);
        pool.allocate(7).expect("all");
        let removed: Vec<_> = pool
            .take_events()
            .into_iter()
            .map(|e| match e {
                KvEvent::BlockRemoved { block_hashes, .. } => block_hashes[0],
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(removed, vec![first[1], first[1], first[0]]);
        assert_eq!(pool.cached_hashes().count(), 0);
        assert!(pool.router_keys().is_empty());
    }

    #[test]
    fn allocation_fails_whole_when_short() {
        let mut pool = BlockPool::new(3, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3]);
        assert_eq!(a.len(), 2);
        assert!(pool.allocate(1).is_none());
        assert_eq!(pool.num_free(), 0);
        pool.free(&a);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn stored_events_chain_parents_and_reset_waits_for_free_blocks() {
        let mut pool = BlockPool::new(8, 2);
        let (a, _) = admit(&mut pool, &[1, 2, 3, 4]);
        let (b, hits) = admit(&mut pool, &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(hits, 2);
        let ev = pool.take_events();
        assert_eq!(ev.len(), 2);
        let (first, none) = stored(&ev[0]);
        assert_eq!(none, None);
        let (hashes, parent) = stored(&ev[1]);
        assert_eq!(parent, Some(first[1]));
        assert_eq!(hashes.len(), 1);
        let KvEvent::BlockStored { token_ids, .. } = &ev[1] else { unreachable!() };
        assert_eq!(token_ids, &vec![5, 6]);
        assert!(!pool.reset(), "blocks in use");
        assert!(pool.take_events().is_empty());
        pool.free(&a);
        pool.free(&b);
        assert!(pool.reset());
        assert_eq!(pool.cached_hashes().count(), 0);
        assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
    }
}
