//! Translator tests: hand-written cases, and a property test driving a model
//! engine (vLLM's prefix-cache semantics) with random stores, duplicate stores,
//! evictions and clears.

use std::collections::HashSet;

use kvroute_shared::{BlockKey, BlockSize, KeyRoot, ModelName, block_keys};
use proptest::prelude::*;

use super::*;
use crate::coalesce::Pending;
use crate::decode::{BlockRemoved, BlockStored, EngineHash, ExtraKey, KvEvent, Medium};

const BS: u32 = 4;

fn translator() -> Translator {
    Translator::new(ModelName::new("m"), BlockSize::new(BS).unwrap(), TranslateCounters::default())
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        parent_block_hash: parent.map(EngineHash::Int),
        token_ids: tokens,
        block_size: BS,
        lora_id: None,
        medium: Some(Medium::Gpu),
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        remote: false,
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        medium: None,
        group_idx: None,
        remote: false,
    })
}

fn keys_of(t: &Translator) -> HashSet<BlockKey> {
    t.keys().collect()
}

fn expected(model: &str, salt: Option<&str>, tokens: &[u32]) -> Vec<BlockKey> {
    block_keys(KeyRoot::new(model, salt), tokens, BlockSize::new(BS).unwrap())
}

#[test]
fn chained_stores_match_router_keys() {
    let mut t = translator();
    let tokens: Vec<u32> = (0..12).collect();
    t.apply(Rank(0), &stored(&[1, 2], None, tokens[..8].to_vec()), &mut NullSink);
    t.apply(Rank(0), &stored(&[3], Some(2), tokens[8..].to_vec()), &mut NullSink);
    assert_eq!(keys_of(&t), expected("m", None, &tokens).into_iter().collect());
}

#[test]
fn unanchored_store_is_skipped_and_counted() {
    let mut t = translator();
    t.apply(Rank(0), &stored(&[3], Some(99), vec![1, 2, 3, 4]), &mut NullSink);
    assert_eq!(t.key_count(), 0);
    assert_eq!(t.counters.unanchored_stores.get(), 1);
}

#[test]
fn events_of_another_block_size_are_keyed_at_theirs_and_counted() {
    // The engine runs 8-token blocks where the sidecar was told 4 (DESIGN §6):
    // each such event counts, and its keys are the engine's, chained at 8.
    let mut t = translator();
    let tokens: Vec<u32> = (0..16).collect();
    let eight = |hashes: &[u64], parent, tokens: &[u32]| match stored(hashes, parent, tokens.to_vec()) {
        KvEvent::BlockStored(ev) => KvEvent::BlockStored(BlockStored { block_size: 8, ..ev }),
        _ => unreachable!(),
    };
    t.apply(Rank(0), &eight(&[1], None, &tokens[..8]), &mut NullSink);
    t.apply(Rank(0), &eight(&[2], Some(1), &tokens[8..]), &mut NullSink);
    assert_eq!(t.counters.block_size_mismatches.get(), 2);
    let at_eight = block_keys(KeyRoot::new("m", None), &tokens, BlockSize::new(8).unwrap());
    assert_eq!(keys_of(&t), at_eight.into_iter().collect());
    // Events of the configured size are not counted.
    t.apply(Rank(0), &stored(&[3], None, vec![0, 1, 2, 3]), &mut NullSink);
    assert_eq!(t.counters.block_size_mismatches.get(), 2);
}

#[test]
fn a_rereported_chain_that_goes_on_past_the_known_blocks_adds_no_copies() {
    // vLLM's `kv_cache_report_mode: "full"` re-sends a hit's blocks from the
    // root: here a cached prefix [1, 2] and a multimodal block after it.
    let mut t = translator();
    t.apply(Rank(0), &stored(&[1, 2], None, (0..8).collect()), &mut NullSink);
    let KvEvent::BlockStored(mut ev) = stored(&[1, 2, 3], None, (0..12).collect()) else { unreachable!() };
    ev.extra_keys = Some(vec![None, None, Some(vec![ExtraKey::Tuple])]);
    t.apply(Rank(0), &KvEvent::BlockStored(ev), &mut NullSink);
    assert_eq!(t.key_count(), 2);
    t.apply(Rank(0), &removed(&[1]), &mut NullSink);
    t.apply(Rank(0), &removed(&[2]), &mut NullSink);
    assert_eq!(t.key_count(), 0, "each block removed once is gone");
    // A chain re-reported past a known run keys the rest from the run's end.
    let mut t = translator();
    let tokens: Vec<u32> = (0..12).collect();
    t.apply(Rank(0), &stored(&[1], None, tokens[..4].to_vec()), &mut NullSink);
    t.apply(Rank(0), &stored(&[1, 2, 3], None, tokens.clone()), &mut NullSink);
    assert_eq!(keys_of(&t), expected("m", None, &tokens).into_iter().collect());
    t.apply(Rank(0), &removed(&[1]), &mut NullSink);
    assert_eq!(t.key_count(), 2, "block 1 was one copy");
}

#[test]
fn duplicates_are_refcounted() {
    let mut t = translator();
    t.apply(Rank(0), &stored(&[1, 2], None, (0..8).collect()), &mut NullSink);
    t.apply(Rank(0), &stored(&[2], Some(1), (4..8).collect()), &mut NullSink);
    t.apply(Rank(0), &removed(&[2]), &mut NullSink);
    assert_eq!(t.key_count(), 2, "one physical copy of block 2 left");
    t.apply(Rank(0), &removed(&[2]), &mut NullSink);
    assert_eq!(t.key_count(), 1);
}

#[test]
fn rereported_hits_leave_no_phantom_after_eviction() {
    // vLLM with kv_cache_report_mode "full": a request hitting blocks 1, 2
    // gets them re-sent from the root. Each is still evicted once.
    let mut t = translator();
    t.apply(Rank(0), &stored(&[1, 2], None, (0..8).collect()), &mut NullSink);
    t.apply(Rank(0), &stored(&[1, 2], None, (0..8).collect()), &mut NullSink);
    t.apply(Rank(0), &stored(&[1], None, (0..4).collect()), &mut NullSink);
    assert_eq!(t.counters.rereported_stores.get(), 2);
    t.apply(Rank(0), &removed(&[2]), &mut NullSink);
    t.apply(Rank(0), &removed(&[1]), &mut NullSink);
    assert_eq!(t.key_count(), 0, "no phantom keys");
    assert_eq!(t.block_count(), 0);
}

#[test]
fn other_groups_and_remote_blocks_are_ignored() {
    let mut t = translator();
    let KvEvent::BlockStored(mut ev) = stored(&[1], None, vec![1, 2, 3, 4]) else { unreachable!() };
    ev.group_idx = Some(1);
    t.apply(Rank(0), &KvEvent::BlockStored(ev.clone()), &mut NullSink);
    ev.group_idx = Some(0);
    ev.remote = true;
    t.apply(Rank(0), &KvEvent::BlockStored(ev.clone()), &mut NullSink);
    assert_eq!(t.key_count(), 0);
    ev.remote = false;
    t.apply(Rank(0), &KvEvent::BlockStored(ev), &mut NullSink);
    assert_eq!(t.key_count(), 1, "group 0, local: routed on");
    let KvEvent::BlockRemoved(mut rm) = removed(&[1]) else { unreachable!() };
    rm.group_idx = Some(1);
    t.apply(Rank(0), &KvEvent::BlockRemoved(rm), &mut NullSink);
    assert_eq!(t.key_count(), 1, "a group-1 removal leaves group 0 alone");
    assert_eq!((t.counters.other_group_events.get(), t.counters.offload_events.get()), (2, 1));
}

#[test]
fn cpu_medium_does_not_touch_gpu_state() {
    let mut t = translator();
    let KvEvent::BlockStored(mut ev) = stored(&[1], None, vec![1, 2, 3, 4]) else { unreachable!() };
    ev.medium = Some(Medium::Cpu);
    t.apply(Rank(0), &KvEvent::BlockStored(ev), &mut NullSink);
    assert_eq!(t.key_count(), 0);
    assert_eq!(t.counters.offload_events.get(), 1);
}

#[test]
fn lora_and_salt_choose_the_root() {
    let mut t = translator();
    let KvEvent::BlockStored(mut ev) = stored(&[1, 2], None, (0..8).collect()) else { unreachable!() };
    ev.lora_id = Some(3);
    ev.lora_name = Some("sql".into());
    ev.extra_keys = Some(vec![Some(vec![ExtraKey::Text("sql".into()), ExtraKey::Text("tenant".into())]), None]);
    t.apply(Rank(0), &KvEvent::BlockStored(ev), &mut NullSink);
    let want: HashSet<_> = expected("sql", Some("tenant"), &(0..8).collect::<Vec<_>>()).into_iter().collect();
    assert_eq!(keys_of(&t), want);
}

#[test]
fn multimodal_blocks_and_their_successors_are_skipped() {
    let mut t = translator();
    let KvEvent::BlockStored(mut ev) = stored(&[1, 2, 3], None, (0..12).collect()) else { unreachable!() };
    ev.extra_keys = Some(vec![None, Some(vec![ExtraKey::Tuple]), None]);
    t.apply(Rank(0), &KvEvent::BlockStored(ev), &mut NullSink);
    assert_eq!(t.key_count(), 1);
    assert_eq!(t.counters.skipped(SkipReason::Multimodal).get(), 2);
}

#[test]
fn clear_of_one_rank_keeps_the_other() {
    let mut t = translator();
    t.apply(Rank(0), &stored(&[1], None, vec![1, 1, 1, 1]), &mut NullSink);
    t.apply(Rank(1), &stored(&[1], None, vec![2, 2, 2, 2]), &mut NullSink);
    let mut p = Pending::new(100);
    p.sync_taken();
    t.apply(Rank(0), &KvEvent::AllBlocksCleared, &mut p);
    assert_eq!(t.key_count(), 1);
    let d = p.take();
    assert!(!d.cleared);
    assert_eq!(d.evicted, expected("m", None, &[1, 1, 1, 1]));
}

#[test]
fn snapshot_drops_blocks_the_engine_lost_but_keeps_fresh_ones() {
    let mut t = translator();
    t.apply(Rank(0), &stored(&[1, 2], None, (0..8).collect()), &mut NullSink);
    t.begin_snapshot();
    t.apply(Rank(0), &stored(&[3], Some(2), (8..12).collect()), &mut NullSink);
    let dropped = t.retain_engine_hashes(Rank(0), &HashSet::from([1]), false, &mut NullSink);
    assert_eq!(dropped, Reconciled::Dropped(1), "hash 2 is gone; 3 arrived after the snapshot began");
    assert_eq!(t.block_count(), 2);
}

/// A snapshot that would drop most of a rank (an empty answer from a hook
/// that no longer finds the engine's cache, another engine on its port) is
/// held back until the next one agrees.
#[test]
fn a_snapshot_dropping_most_blocks_waits_for_a_second_one() {
    let mut t = translator();
    t.apply(Rank(0), &stored(&[1, 2, 3], None, (0..12).collect()), &mut NullSink);
    t.begin_snapshot();
    let first = t.retain_engine_hashes(Rank(0), &HashSet::new(), false, &mut NullSink);
    assert_eq!(first, Reconciled::Deferred { would_drop: 3, tracked: 3 });
    assert_eq!(t.block_count(), 3, "nothing dropped on one empty snapshot");
    t.begin_snapshot();
    let second = t.retain_engine_hashes(Rank(0), &HashSet::new(), true, &mut NullSink);
    assert_eq!(second, Reconciled::Dropped(3));
    assert_eq!(t.block_count(), 0);
}

/// One step of the model engine.
#[derive(Clone, Debug)]
enum Op {
    /// Store `n` new blocks after held block `parent % len` (or from the root).
    Store {
        parent: Option<usize>,
        n: usize,
        seed: u32,
    },
    /// Store another physical copy of held block `i % len` (not a root block:
    /// a root duplicate is indistinguishable from a re-report, see `store`).
    Duplicate(usize),
    /// Re-report the chain from the root to held block `i % len` (vLLM's
    /// `kv_cache_report_mode: "full"` on a prefix hit): nothing changes.
    Rereport(usize),
    /// Evict one physical copy of held block `i % len`.
    Evict(usize),
    Clear,
    /// The pusher takes the pending delta.
    Send,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (proptest::option::of(any::<usize>()), 1usize..4, 0u32..6).prop_map(|(parent, n, seed)| Op::Store { parent, n, seed }),
        1 => any::<usize>().prop_map(Op::Duplicate),
        1 => any::<usize>().prop_map(Op::Rereport),
        3 => any::<usize>().prop_map(Op::Evict),
        1 => Just(Op::Clear),
        2 => Just(Op::Send),
    ]
}

#[derive(Clone)]
struct Held {
    hash: u64,
    parent: Option<u64>,
    tokens: Vec<u32>,
    prefix: Vec<u32>,
    copies: u32,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// The translator's key set always equals the router keys of the blocks the
    /// engine holds, and applying every pushed delta to a set reproduces it.
    #[test]
    fn router_view_equals_engine_state(ops in proptest::collection::vec(op(), 1..80)) {
        let mut t = translator();
        let mut pending = Pending::new(1 << 20);
        pending.sync_taken();
        let mut router: HashSet<BlockKey> = HashSet::new();
        let mut engine: Vec<Held> = Vec::new();
        let mut next_hash = 0x9e37_79b9_0000_0000u64;
        for op in ops {
            match op {
                Op::Store { parent, n, seed } => {
                    let parent = parent.filter(|_| !engine.is_empty()).map(|i| engine[i % engine.len()].clone());
                    // Small token alphabet: different engine blocks often share
                    // content, exercising key-level refcounts.
                    let tokens: Vec<u32> = (0..n as u32 * BS).map(|i| (seed + i) % 3).collect();
                    let mut prefix = parent.as_ref().map(|p| p.prefix.clone()).unwrap_or_default();
                    let mut parent_hash = parent.as_ref().map(|p| p.hash);
                    let mut hashes = Vec::new();
                    for chunk in tokens.chunks(BS as usize) {
                        next_hash += 1;
                        prefix.extend_from_slice(chunk);
                        engine.push(Held { hash: next_hash, parent: parent_hash, tokens: chunk.to_vec(), prefix: prefix.clone(), copies: 1 });
                        hashes.push(next_hash);
                        parent_hash = Some(next_hash);
                    }
                    let ev = stored(&hashes, parent.as_ref().map(|p| p.hash), tokens);
                    t.apply(Rank(0), &ev, &mut pending);
                }
                Op::Duplicate(i) if !engine.is_empty() => {
                    let i = i % engine.len();
                    let parent_held = engine[i].parent.is_some_and(|p| engine.iter().any(|h| h.hash == p));
                    if parent_held {
                        engine[i].copies += 1;
                        let b = engine[i].clone();
                        t.apply(Rank(0), &stored(&[b.hash], b.parent, b.tokens), &mut pending);
                    }
                }
                Op::Rereport(i) if !engine.is_empty() => {
                    // The chain from the root to block i, if every link is held.
                    let mut chain = vec![engine[i % engine.len()].clone()];
                    while let Some(p) = chain.last().and_then(|b| b.parent) {
                        match engine.iter().find(|h| h.hash == p) {
                            Some(h) => chain.push(h.clone()),
                            None => break,
                        }
                    }
                    if chain.last().is_some_and(|b| b.parent.is_none()) {
                        chain.reverse();
                        let hashes: Vec<u64> = chain.iter().map(|b| b.hash).collect();
                        let tokens: Vec<u32> = chain.iter().flat_map(|b| b.tokens.clone()).collect();
                        t.apply(Rank(0), &stored(&hashes, None, tokens), &mut pending);
                    }
                }
                Op::Evict(i) if !engine.is_empty() => {
                    let i = i % engine.len();
                    let hash = engine[i].hash;
                    engine[i].copies -= 1;
                    if engine[i].copies == 0 {
                        engine.remove(i);
                    }
                    t.apply(Rank(0), &removed(&[hash]), &mut pending);
                }
                Op::Clear => {
                    engine.clear();
                    t.apply(Rank(0), &KvEvent::AllBlocksCleared, &mut pending);
                }
                Op::Send => {
                    let d = pending.take();
                    if d.cleared { router.clear(); }
                    for k in &d.evicted { prop_assert!(router.remove(k), "evicted a key the router never had"); }
                    for k in d.stored { prop_assert!(router.insert(k), "stored a key the router already had"); }
                }
                _ => {}
            }
            let want: HashSet<BlockKey> = engine.iter().map(|b| *expected("m", None, &b.prefix).last().unwrap()).collect();
            prop_assert_eq!(&keys_of(&t), &want);
        }
        let d = pending.take();
        if d.cleared { router.clear(); }
        for k in &d.evicted { router.remove(k); }
        router.extend(d.stored);
        prop_assert_eq!(router, keys_of(&t));
    }
}
