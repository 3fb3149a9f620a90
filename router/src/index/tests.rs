use super::*;
use proptest::prelude::*;

fn k(n: u64) -> BlockKey {
    BlockKey(n)
}

fn depths(ix: &Index, keys: &[BlockKey]) -> Vec<(Slot, usize)> {
    let mut d = ix.match_depths(keys);
    d.sort();
    d
}

/// The definition: walk keys in order; a worker's depth is where it drops out.
fn linear_depths(ix: &Index, keys: &[BlockKey]) -> Vec<(Slot, usize)> {
    let mut out = Vec::new();
    let mut alive = match keys.first() {
        Some(&f) => ix.holders(f),
        None => return out,
    };
    for (i, &key) in keys.iter().enumerate().skip(1) {
        let next = alive.and(ix.holders(key));
        out.extend(alive.minus(next).iter().map(|s| (s, i)));
        alive = next;
    }
    out.extend(alive.iter().map(|s| (s, keys.len())));
    out.sort();
    out
}

#[test]
fn longest_prefix_per_worker() {
    let mut ix = Index::new();
    let chain: Vec<_> = (1..=10).map(k).collect();
    ix.apply_events(Slot(0), false, &[], &chain[..10]);
    ix.apply_events(Slot(1), false, &[], &chain[..3]);
    ix.apply_events(Slot(2), false, &[], &[k(99)]);
    assert_eq!(depths(&ix, &chain), vec![(Slot(0), 10), (Slot(1), 3)]);
    assert_eq!(depths(&ix, &chain[..2]), vec![(Slot(0), 2), (Slot(1), 2)]);
    assert_eq!(depths(&ix, &[k(50)]), vec![]);
    assert_eq!(depths(&ix, &[]), vec![]);
}

#[test]
fn cleared_then_evictions_then_stores() {
    let mut ix = Index::new();
    ix.apply_events(Slot(0), false, &[], &[k(1), k(2)]);
    ix.apply_events(Slot(0), true, &[k(3)], &[k(3)]);
    assert_eq!(ix.keys_of(Slot(0)), vec![(k(3), Kind::Confirmed)]);
    // An eviction and a store of one key in one batch: the store wins (applied last).
    ix.apply_events(Slot(0), false, &[k(4)], &[k(4)]);
    assert_eq!(ix.counts(Slot(0)).confirmed, 2);
    ix.check_consistency().unwrap();
}

#[test]
fn a_withdrawn_send_takes_back_only_its_own_entries() {
    let mut ix = Index::new();
    ix.apply_events(Slot(0), false, &[], &[k(1)]);
    ix.record_routed(Slot(0), &[k(5)], 1_000); // an earlier send, computing k5
    let tick = ix.record_routed(Slot(0), &[k(1), k(5), k(6), k(7)], 1_001);
    ix.apply_events(Slot(0), false, &[], &[k(7)]); // confirmed since
    assert_eq!(ix.withdraw_routed(Slot(0), &[k(1), k(5), k(6), k(7)], tick), 1, "only k6");
    let held: Vec<BlockKey> = ix.keys_of(Slot(0)).into_iter().map(|(key, _)| key).collect();
    assert_eq!(held.len(), 3);
    assert!(held.contains(&k(1)) && held.contains(&k(5)) && held.contains(&k(7)), "{held:?}");
    // A later send of the same block keeps it.
    let first = ix.record_routed(Slot(1), &[k(9)], 2_000);
    ix.record_routed(Slot(1), &[k(9)], 2_001);
    assert_eq!(ix.withdraw_routed(Slot(1), &[k(9)], first), 0);
    ix.check_consistency().unwrap();
}

#[test]
fn sync_replaces_confirmed_and_keeps_newer_speculative() {
    let mut ix = Index::new();
    ix.apply_events(Slot(0), false, &[], &[k(1), k(2)]);
    ix.record_routed(Slot(0), &[k(1), k(10)], 1_000); // k10 speculative at t=1000
    ix.record_routed(Slot(0), &[k(11)], 3_000); // k11 speculative at t=3000
    let out = ix.sync(Slot(0), &[k(2), k(5), k(10)], 2_000);
    let mut keys = ix.keys_of(Slot(0));
    keys.sort_by_key(|(key, _)| *key);
    assert_eq!(
        keys,
        vec![(k(2), Kind::Confirmed), (k(5), Kind::Confirmed), (k(10), Kind::Confirmed), (k(11), Kind::Speculative)]
    );
    assert_eq!(out, SyncOutcome { added: 1, removed: 1, kept_speculative: 1 });
    ix.check_consistency().unwrap();
}

#[test]
fn a_prefix_sent_again_before_its_confirmation_is_a_burst() {
    let mut ix = Index::new();
    ix.record_routed(Slot(0), &[k(1), k(2)], 1_000);
    assert_eq!(ix.match_kind(Slot(0), &[k(1)]), MatchKind::Sent);
    // A second request sharing k1 only, before any sidecar confirmed it.
    ix.record_routed(Slot(0), &[k(1), k(3)], 1_010);
    assert_eq!(ix.match_kind(Slot(0), &[k(1)]), MatchKind::SentAgain);
    assert_eq!(ix.match_kind(Slot(0), &[k(1), k(2)]), MatchKind::Sent);
    // The sent-again entry still expires on time, from its refreshed stamp.
    assert_eq!(ix.expire_speculative(11_005, 10_000), 1); // k2
    assert_eq!(ix.expire_speculative(11_015, 10_000), 2); // k1, k3
    // Confirmed, then routed again: held, not a burst.
    ix.apply_events(Slot(1), false, &[], &[k(1)]);
    ix.record_routed(Slot(1), &[k(1)], 12_000);
    ix.record_routed(Slot(1), &[k(1)], 12_001);
    assert_eq!(ix.match_kind(Slot(1), &[k(1)]), MatchKind::Held);
    assert_eq!(ix.match_kind(Slot(1), &[]), MatchKind::Held);
    ix.check_consistency().unwrap();
}

/// Expiry a bounded number of records per call (a write-lock hold each),
/// across workers, to the same end as all at once.
#[test]
fn speculative_entries_expire_a_chunk_at_a_time() {
    let mut ix = Index::new();
    let keys: Vec<_> = (0..5_000).map(k).collect();
    ix.record_routed(Slot(0), &keys, 1_000);
    ix.record_routed(Slot(1), &keys, 1_000);
    ix.apply_events(Slot(1), false, &[], &keys[..1_000]); // confirmed: not expired
    assert_eq!(ix.expire_speculative_some(11_000, 10_000, 2_048), (2_048, true));
    let mut rounds = 1;
    let mut expired = 2_048;
    loop {
        let (n, more) = ix.expire_speculative_some(11_000, 10_000, 2_048);
        assert!(n <= 2_048);
        (expired, rounds) = (expired + n, rounds + 1);
        if !more {
            break;
        }
    }
    assert_eq!((expired, rounds), (9_000, 5));
    assert_eq!((ix.counts(Slot(0)).speculative, ix.counts(Slot(1)).confirmed), (0, 1_000));
    ix.check_consistency().unwrap();
}

#[test]
fn speculative_entries_expire_unless_confirmed() {
    let mut ix = Index::new();
    ix.record_routed(Slot(0), &[k(1), k(2)], 1_000);
    ix.apply_events(Slot(0), false, &[], &[k(1)]); // confirmed
    assert_eq!(ix.expire_speculative(5_000, 10_000), 0);
    assert_eq!(ix.expire_speculative(11_000, 10_000), 1);
    assert_eq!(ix.keys_of(Slot(0)), vec![(k(1), Kind::Confirmed)]);
    // A refreshed speculative entry is not expired by its older queue item.
    ix.record_routed(Slot(0), &[k(3)], 20_000);
    ix.remove(Slot(0), k(3));
    ix.record_routed(Slot(0), &[k(3)], 25_000);
    assert_eq!(ix.expire_speculative(31_000, 10_000), 0);
    assert_eq!(ix.expire_speculative(35_000, 10_000), 1);
    ix.check_consistency().unwrap();
}

#[test]
fn a_workers_unconfirmed_sends_are_capped_oldest_first() {
    let mut ix = Index::new();
    let long = 16_384u64;
    // The same long prompt sent again and again: every send is remembered.
    let same: Vec<BlockKey> = (0..long).map(k).collect();
    for i in 0..20 {
        ix.record_routed(Slot(0), &same, i);
    }
    // Then distinct long prompts, until the oldest sends are pushed out.
    let sends = Index::MAX_SPECULATIVE as u64 / long + 2;
    for p in 1..=sends {
        let keys: Vec<BlockKey> = (0..long).map(|i| k(p * 1_000_000 + i)).collect();
        ix.record_routed(Slot(0), &keys, 100 + p);
    }
    let c = ix.counts(Slot(0));
    assert!(c.speculative <= Index::MAX_SPECULATIVE, "{} speculative entries", c.speculative);
    assert!(ix.workers[&Slot(0)].speculative.len() <= Index::MAX_SPECULATIVE);
    // The newest send is whole; the oldest went first.
    let newest: Vec<BlockKey> = (0..long).map(|i| k(sends * 1_000_000 + i)).collect();
    assert_eq!(depths(&ix, &newest), vec![(Slot(0), long as usize)]);
    assert!(depths(&ix, &same).is_empty(), "the oldest sends stayed");
    // (`check_consistency` is quadratic: two minutes at this size.)
}

#[test]
fn approximate_worker_is_lru_bounded() {
    let mut ix = Index::new();
    ix.set_approximate(Slot(3), Some(4));
    ix.record_routed(Slot(3), &[k(1), k(2), k(3)], 1);
    ix.record_routed(Slot(3), &[k(1)], 2); // touch k1; the chain's tail k3 is least recent
    ix.record_routed(Slot(3), &[k(4), k(5)], 3);
    let mut keys: Vec<_> = ix.keys_of(Slot(3)).into_iter().map(|(key, _)| key).collect();
    keys.sort();
    assert_eq!(keys, vec![k(1), k(2), k(4), k(5)], "the tail goes first, never a chain's middle");
    assert_eq!(ix.counts(Slot(3)).approximate, 4);
    ix.check_consistency().unwrap();
}

#[test]
fn clear_and_remove_worker_purge_forward_entries() {
    let mut ix = Index::new();
    ix.apply_events(Slot(0), false, &[], &[k(1), k(2)]);
    ix.apply_events(Slot(1), false, &[], &[k(1)]);
    ix.remove_worker(Slot(0));
    assert_eq!(ix.key_count(), 1);
    assert_eq!(depths(&ix, &[k(1), k(2)]), vec![(Slot(1), 1)]);
    ix.check_consistency().unwrap();
}

fn ks(v: Vec<u64>) -> Vec<BlockKey> {
    v.into_iter().map(k).collect()
}

#[derive(Clone, Debug)]
enum Op {
    Events { slot: u16, cleared: bool, evicted: Vec<u64>, stored: Vec<u64> },
    Sync { slot: u16, keys: Vec<u64> },
    Routed { slot: u16, keys: Vec<u64>, at: u64 },
    Expire { at: u64 },
    Remove { slot: u16 },
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || proptest::collection::vec(0u64..40, 0..8);
    prop_oneof![
        (prop_oneof![0u16..4, 64u16..66], any::<bool>(), keys(), keys())
            .prop_map(|(slot, c, evicted, stored)| Op::Events { slot, cleared: c && slot == 0, evicted, stored }),
        (0u16..4, keys()).prop_map(|(slot, keys)| Op::Sync { slot, keys }),
        (0u16..4, keys(), 0u64..100).prop_map(|(slot, keys, at)| Op::Routed { slot, keys, at }),
        (0u64..200).prop_map(|at| Op::Expire { at }),
        (0u16..4).prop_map(|slot| Op::Remove { slot }),
    ]
}

proptest! {
    /// No reverse entry without its forward entry, whatever happens.
    #[test]
    fn maps_always_agree(ops in proptest::collection::vec(op(), 1..60)) {
        let mut ix = Index::new();
        ix.set_approximate(Slot(3), Some(5));
        for op in ops {
            match op {
                Op::Events { slot, cleared, evicted, stored } => {
                    ix.apply_events(Slot(slot), cleared, &ks(evicted), &ks(stored))
                }
                Op::Sync { slot, keys } => {
                    ix.sync(Slot(slot), &ks(keys), 50);
                }
                Op::Routed { slot, keys, at } => {
                    ix.record_routed(Slot(slot), &ks(keys), at);
                }
                Op::Expire { at } => { ix.expire_speculative(at, 30); }
                Op::Remove { slot } => ix.remove_worker(Slot(slot)),
            }
            prop_assert_eq!(ix.check_consistency(), Ok(()));
        }
    }

    /// A delta applied a chunk at a time leaves the index as applying it at
    /// once does, whatever came before it (speculative and confirmed keys,
    /// an approximate worker) and whatever the chunk size.
    #[test]
    fn chunked_deltas_equal_whole_ones(ops in proptest::collection::vec(op(), 1..40), n in 1usize..5) {
        let (mut whole, mut chunked) = (Index::new(), Index::new());
        for ix in [&mut whole, &mut chunked] {
            ix.set_approximate(Slot(3), Some(5));
        }
        for op in ops {
            match op {
                Op::Events { slot, cleared, evicted, stored } => {
                    let (e, s) = (ks(evicted), ks(stored));
                    whole.apply_events(Slot(slot), cleared, &e, &s);
                    let mut cursor = DeltaCursor::new(cleared);
                    while chunked.apply_some(Slot(slot), &mut cursor, &e, &s, n) {
                        prop_assert_eq!(chunked.check_consistency(), Ok(()));
                    }
                }
                Op::Routed { slot, keys, at } => {
                    let keys = ks(keys);
                    whole.record_routed(Slot(slot), &keys, at);
                    chunked.record_routed(Slot(slot), &keys, at);
                }
                _ => {}
            }
            prop_assert_eq!(chunked.check_consistency(), Ok(()));
            for slot in [0, 1, 2, 3, 64, 65].map(Slot) {
                let (mut a, mut b) = (whole.keys_of(slot), chunked.keys_of(slot));
                a.sort_by_key(|x| x.0);
                b.sort_by_key(|x| x.0);
                prop_assert_eq!(a, b);
                prop_assert_eq!(whole.counts(slot), chunked.counts(slot));
                prop_assert_eq!(whole.digest(slot), chunked.digest(slot));
            }
        }
    }

    /// A sync leaves the worker with exactly the confirmed set that replaying
    /// the engine's events gives.
    #[test]
    fn sync_equals_replaying_events(batches in proptest::collection::vec(
        (any::<bool>(), proptest::collection::vec(0u64..30, 0..6), proptest::collection::vec(0u64..30, 0..6)), 1..30)) {
        let mut by_events = Index::new();
        let mut truth = std::collections::BTreeSet::new();
        for (cleared, evicted, stored) in &batches {
            let e: Vec<_> = evicted.iter().copied().map(k).collect();
            let s: Vec<_> = stored.iter().copied().map(k).collect();
            by_events.apply_events(Slot(0), *cleared, &e, &s);
            if *cleared { truth.clear(); }
            for x in evicted { truth.remove(x); }
            for x in stored { truth.insert(*x); }
        }
        let mut by_sync = Index::new();
        by_sync.apply_events(Slot(0), false, &[], &[k(1000), k(1001)]);
        let keys: Vec<_> = truth.iter().copied().map(k).collect();
        by_sync.sync(Slot(0), &keys, 0);
        let mut a = by_events.keys_of(Slot(0));
        let mut b = by_sync.keys_of(Slot(0));
        a.sort_by_key(|x| x.0);
        b.sort_by_key(|x| x.0);
        prop_assert_eq!(a, b);
    }

    /// Bisection gives the linear walk's answer on prefix-closed holdings.
    #[test]
    fn bisection_equals_linear_walk(holdings in proptest::collection::vec(0usize..70, 1..6), len in 0usize..70) {
        let chain: Vec<_> = (0..70).map(|i| k(i as u64 + 1)).collect();
        let mut ix = Index::new();
        for (w, &n) in holdings.iter().enumerate() {
            ix.apply_events(Slot(w as u16), false, &[], &chain[..n]);
        }
        let keys = &chain[..len];
        prop_assert_eq!(depths(&ix, keys), linear_depths(&ix, keys));
    }
}

#[test]
fn approximate_eviction_keeps_chains_prefix_closed() {
    // The hardening review's case, capacity 5: route [a..e], then [a], then
    // [x]. Evicting the head first made a match of [a..e] report 5 blocks.
    let mut ix = Index::new();
    ix.set_approximate(Slot(0), Some(5));
    let chain: Vec<_> = (1..=5).map(k).collect();
    ix.record_routed(Slot(0), &chain, 1);
    ix.record_routed(Slot(0), &chain[..1], 2);
    ix.record_routed(Slot(0), &[k(99)], 3);
    assert_eq!(depths(&ix, &chain), linear_depths(&ix, &chain));
    assert_eq!(depths(&ix, &chain), vec![(Slot(0), 4)], "e, the tail, was evicted");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// On approximate workers, after any sequence of routings of chains from a
    /// small prefix tree (shared heads, different tails), bisection equals the
    /// linear walk for every chain.
    #[test]
    fn approximate_bisection_equals_linear_walk(
        routes in proptest::collection::vec((0u16..3, 0u64..4, 0u64..4, 1usize..9), 1..60),
        capacity in 1usize..12,
    ) {
        // A chain's key i names its whole prefix: (branch, twig, i) below depth 3 share.
        let chain = |branch: u64, twig: u64, len: usize| -> Vec<BlockKey> {
            (0..len as u64).map(|i| match i {
                0..=2 => k(1 + i),
                3..=5 => k(100 + branch * 10 + i),
                _ => k(1000 + branch * 100 + twig * 10 + i),
            }).collect()
        };
        let mut ix = Index::new();
        for w in 0..3 {
            ix.set_approximate(Slot(w), Some(capacity));
        }
        for (t, &(w, branch, twig, len)) in routes.iter().enumerate() {
            ix.record_routed(Slot(w), &chain(branch, twig, len), t as u64);
            for b in 0..4 {
                for tw in 0..4 {
                    let c = chain(b, tw, 8);
                    prop_assert_eq!(depths(&ix, &c), linear_depths(&ix, &c));
                }
            }
        }
        ix.check_consistency().unwrap();
    }
}

#[test]
fn workers_beyond_slot_64_use_the_other_words_maps() {
    let mut ix = Index::new();
    let chain: Vec<_> = (1..=6).map(k).collect();
    ix.apply_events(Slot(100), false, &[], &chain);
    ix.apply_events(Slot(3), false, &[], &chain[..2]);
    ix.record_routed(Slot(127), &chain[..4], 5);
    ix.apply_events(Slot(200), false, &[], &chain[..3]);
    let last = Slot(MAX_WORKERS as u16 - 1);
    ix.apply_events(last, false, &[], &chain[..5]);
    let all = |d| vec![(Slot(3), 2), (Slot(100), d), (Slot(127), 4), (Slot(200), 3), (last, 5)];
    assert_eq!(depths(&ix, &chain), all(6));
    assert_eq!(ix.key_count(), 6);
    assert_eq!(ix.entry_count(), 20);
    ix.sync(Slot(100), &chain[..1], 0);
    assert_eq!(depths(&ix, &chain), all(1));
    for s in [Slot(127), Slot(200), last] {
        ix.remove_worker(s);
    }
    assert_eq!(ix.key_count(), 2);
    ix.check_consistency().unwrap();
}

#[test]
fn reverse_vector_is_compacted() {
    let mut ix = Index::new();
    for round in 0..50u64 {
        let keys: Vec<_> = (0..100).map(|i| k(round * 1000 + i)).collect();
        ix.apply_events(Slot(0), false, &[], &keys);
        ix.apply_events(Slot(0), false, &keys, &[]);
    }
    ix.apply_events(Slot(0), false, &[], &[k(1), k(1)]);
    let w = ix.workers.get(&Slot(0)).unwrap();
    assert!(w.keys.len() <= 2 * w.live + 64 + 1, "{} items for {} live", w.keys.len(), w.live);
    assert_eq!(ix.keys_of(Slot(0)), vec![(k(1), Kind::Confirmed)]);
    ix.check_consistency().unwrap();
}

/// A large vector is compacted in steps: scanned under a read lock, swapped
/// under the write lock, with what changed in between respected.
#[test]
fn a_large_reverse_vector_is_compacted_in_steps() {
    let mut ix = Index::new();
    let all: Vec<_> = (0..40_000).map(k).collect();
    ix.apply_events(Slot(0), false, &[], &all);
    ix.apply_events(Slot(0), false, &all[..30_000], &[]);
    assert_eq!(ix.compaction_due(), vec![Slot(0)], "too large to compact inline");
    let mut c = Compaction::new(&ix, Slot(0)).unwrap();
    while c.scan(&ix, 4_096).unwrap() {}
    // Meanwhile: one key removed, one re-added, one new.
    ix.apply_events(Slot(0), false, &[k(35_000)], &[k(5), k(50_000)]);
    assert!(c.install(&mut ix));
    assert!(ix.compaction_due().is_empty());
    let w = ix.workers.get(&Slot(0)).unwrap();
    assert!(w.keys.len() <= w.live + 1, "{} items for {} live", w.keys.len(), w.live);
    assert_eq!(w.live, 10_001);
    ix.check_consistency().unwrap();
    // A plan against a vector replaced since is abandoned.
    let stale = Compaction::new(&ix, Slot(0)).unwrap();
    ix.clear_worker(Slot(0));
    assert!(!stale.install(&mut ix));
}

/// A full sync whose scan of the held keys spans a compaction (which swaps
/// the vector for a shorter one in another order) still finds every key
/// the sync lacks: its cursor pointed past the new vector's end, and the
/// keys the engine dropped stayed confirmed until the next sync.
#[test]
fn a_sync_scanning_across_a_compaction_misses_no_key() {
    let mut ix = Index::new();
    let all: Vec<_> = (0..40_000).map(k).collect();
    ix.apply_events(Slot(0), false, &[], &all);
    ix.apply_events(Slot(0), false, &all[..30_000], &[]);
    let mut plan = SyncPlan::new(Slot(0), &[], Covers(0));
    assert!(plan.scan_held(&ix, 16_384));
    let mut c = Compaction::new(&ix, Slot(0)).unwrap();
    while c.scan(&ix, 4_096).unwrap() {}
    assert!(c.install(&mut ix));
    while plan.scan_held(&ix, 16_384) {}
    while plan.scan_fresh(&ix, 16_384) {}
    while plan.apply_some(&mut ix, 4_096) {}
    plan.finish(&mut ix);
    assert_eq!(ix.counts(Slot(0)).confirmed, 0, "the sync holds nothing");
    ix.check_consistency().unwrap();
}

/// A compaction planned for a worker that then leaves is abandoned, not
/// applied to the slot's next occupant (whose vector is another).
#[test]
fn a_compaction_never_reaches_the_slots_next_worker() {
    let mut ix = Index::new();
    let all: Vec<_> = (0..40_000).map(k).collect();
    ix.set_approximate(Slot(0), Some(100_000));
    ix.apply_events(Slot(0), false, &[], &all);
    ix.apply_events(Slot(0), false, &all[..30_000], &[]);
    let mut planned = Compaction::new(&ix, Slot(0)).unwrap();
    assert_eq!(planned.scan(&ix, 4_096), Some(true));
    ix.remove_worker(Slot(0));
    assert!(!ix.is_approximate(Slot(0)), "the next occupant starts exact");
    ix.apply_events(Slot(0), false, &[], &(50_000..50_010).map(k).collect::<Vec<_>>());
    assert_eq!(planned.scan(&ix, 4_096), None);
    let again = Compaction::new(&ix, Slot(0)).unwrap();
    ix.remove_worker(Slot(0));
    ix.apply_events(Slot(0), false, &[], &[k(60_000)]);
    assert!(!again.install(&mut ix));
    assert_eq!(ix.keys_of(Slot(0)).len(), 1);
    ix.check_consistency().unwrap();
}
