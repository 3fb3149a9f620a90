//! The scheduler against vLLM's behaviour, step by step, on tiny pools
//! (block size 4) where every block can be counted.

use super::*;
use crate::engine::block_pool::BlockId;
use crate::engine::hashing::BlockExtras;
use crate::events::BlockHash;
use tokio::sync::oneshot;

type Waiter = oneshot::Receiver<Result<Outcome, Rejected>>;

fn sched(blocks: u32, max_num_seqs: usize) -> Scheduler {
    let limits = Limits { max_num_seqs, max_num_batched_tokens: 64, max_model_len: 1024 };
    Scheduler::new(BlockPool::new(blocks, 4), limits, HashMode::Int, Arc::new(EngineMetrics::default()))
}

fn submit(s: &mut Scheduler, prompt: Vec<u32>, max_tokens: u32) -> Waiter {
    let (tx, rx) = oneshot::channel();
    s.submit(Submission {
        prompt,
        max_tokens,
        extras: BlockExtras::default(),
        lora_id: None,
        arrival: Instant::now(),
        sink: Sink::Once(tx),
    });
    rx
}

fn step(s: &mut Scheduler) -> StepWork {
    let w = s.schedule();
    s.complete(Instant::now());
    w
}

/// Blocks referenced by requests (the null block excluded).
fn used(s: &Scheduler) -> usize {
    s.pool.usable_blocks() - s.pool.num_free()
}

fn stored_hashes(events: &[KvEvent]) -> Vec<BlockHash> {
    events
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// A waiting request whose client left leaves the queue at the next step,
/// wherever it stands in it (vLLM aborts it at once), not when it reaches
/// the front.
#[test]
fn a_waiting_request_whose_client_left_leaves_the_queue_at_once() {
    let mut s = sched(16, 1);
    let _a = submit(&mut s, vec![1, 2, 3], 4);
    let _b = submit(&mut s, vec![4, 5, 6], 1);
    let c = submit(&mut s, vec![7, 8, 9], 1);
    let _d = submit(&mut s, vec![10, 11, 12], 1);
    drop(c);
    step(&mut s);
    assert_eq!(s.metrics.waiting.load(Relaxed), 2, "b and d wait behind a; c, behind b, is gone");
}

#[test]
fn waits_for_a_sequence_slot() {
    let mut s = sched(16, 1);
    let mut a = submit(&mut s, vec![1, 2, 3], 2);
    let mut b = submit(&mut s, vec![4, 5, 6], 1);
    assert_eq!(step(&mut s), StepWork { prefill_tokens: 3, decode_seqs: 0 });
    assert_eq!(s.metrics.waiting.load(Relaxed), 1);
    assert_eq!(step(&mut s), StepWork { prefill_tokens: 0, decode_seqs: 1 });
    assert!(a.try_recv().is_ok_and(|r| r.is_ok()));
    assert!(b.try_recv().is_err(), "b has not run yet");
    assert_eq!(step(&mut s), StepWork { prefill_tokens: 3, decode_seqs: 0 });
    assert!(b.try_recv().is_ok());
    assert!(s.is_idle());
}

#[test]
fn blocks_grow_as_tokens_are_generated_and_every_full_block_is_cached() {
    // Prompt 6, 5 tokens: the KV of tokens 0..=9 is computed (the 5th
    // generated token's never is), so 3 blocks are held and 2 cached.
    let mut s = sched(16, 8);
    let mut a = submit(&mut s, (100..106).collect(), 5);
    let mut held = Vec::new();
    let mut events = Vec::new();
    while !s.is_idle() {
        s.schedule();
        held.push(used(&s));
        s.complete(Instant::now());
        events.extend(s.take_events());
    }
    assert_eq!(held, vec![2, 2, 2, 3, 3]);
    let outcome = a.try_recv().expect("done").expect("ok");
    assert_eq!(outcome.completion_tokens, 5);
    assert_eq!(events.len(), 2, "{events:?}");
    let KvEvent::BlockStored { token_ids, parent_block_hash: Some(_), .. } = &events[1] else { panic!("{events:?}") };
    assert_eq!(&token_ids[..2], &[104, 105], "the second block ends in generated tokens");
    assert!(token_ids[2..].iter().all(|t| *t < 100_000));
    assert_eq!(s.pool.cached_hashes().count(), 2);
    assert_eq!(used(&s), 0);
}

#[test]
fn waits_for_kv_blocks_then_hits() {
    // 4 usable blocks of 4: an 8-token prompt generating 4 ends with 3.
    let mut s = sched(5, 8);
    let p: Vec<u32> = (0..8).collect();
    let _a = submit(&mut s, p.clone(), 4);
    let _b = submit(&mut s, (50..62).collect(), 1);
    let mut c = submit(&mut s, p.clone(), 1);
    step(&mut s);
    assert_eq!(s.running.len(), 1, "b (3 blocks) does not fit next to a (2 so far)");
    while s.running.len() == 1 && s.waiting.len() == 2 {
        step(&mut s);
    }
    while !s.is_idle() {
        step(&mut s);
    }
    // b evicted p's second block; it could not have hit anyway (the last
    // token is always computed).
    let outcome = c.try_recv().expect("c done").expect("ok");
    assert_eq!(outcome.cached_tokens, 4);
    assert_eq!(s.metrics.prefix_hits.load(Relaxed), 4);
    assert_eq!(s.metrics.prefix_queries.load(Relaxed), 8 + 12 + 8);
}

#[test]
fn a_recomputed_last_block_is_stored_again_under_the_same_hash() {
    let mut s = sched(16, 8);
    let p: Vec<u32> = (0..8).collect();
    let _a = submit(&mut s, p.clone(), 1);
    step(&mut s);
    let first = stored_hashes(&s.take_events());
    let _b = submit(&mut s, p, 1);
    step(&mut s);
    let second = stored_hashes(&s.take_events());
    assert_eq!(first.len(), 2);
    assert_eq!(second, vec![first[1]], "the block the hit may not cover is computed and stored again");
    assert_eq!(s.pool.cached_hashes().map(|(_, n)| n).sum::<usize>(), 3);
}

#[test]
fn running_out_of_blocks_preempts_the_last_request_to_the_queue_front() {
    // 5 usable blocks; a and b each end with ⌈(4 + 8 − 1) / 4⌉ = 3 blocks.
    let mut s = sched(6, 8);
    let mut a = submit(&mut s, (0..4).collect(), 8);
    let mut b = submit(&mut s, (10..14).collect(), 8);
    step(&mut s);
    let _c = submit(&mut s, (20..40).collect(), 1);
    let mut steps = 1;
    while s.metrics.preemptions.load(Relaxed) == 0 {
        step(&mut s);
        steps += 1;
        assert!(steps < 20, "no preemption");
    }
    // b, the last running request, gave its blocks back and now leads c.
    assert_eq!(s.running.len(), 1);
    assert_eq!(s.waiting.front().map(|r| r.prompt_len()), Some(4));
    assert_eq!(s.waiting.front().map(|r| r.num_preemptions), Some(1));
    assert_eq!(s.waiting.len(), 2);
    let b_prompt_block = s.waiting.front().map(|r| r.hashes[0]).expect("b");
    assert!(stored_hashes(&s.take_events()).contains(&b_prompt_block));
    let mut events = Vec::new();
    while !s.is_idle() {
        step(&mut s);
        events.extend(s.take_events());
        assert!(steps < 100, "stuck");
        steps += 1;
    }
    let a = a.try_recv().expect("a done").expect("ok");
    let b = b.try_recv().expect("b done").expect("ok");
    assert_eq!((a.completion_tokens, b.completion_tokens), (8, 8));
    assert_eq!(b.cached_tokens, 0, "cached_tokens is the first admission's hit");
    // Resumed, b hit its own prompt block instead of storing it again.
    assert!(!stored_hashes(&events).contains(&b_prompt_block));
    // A resumed request's lookup is not counted again.
    assert_eq!(s.metrics.prefix_queries.load(Relaxed), 4 + 4 + 20);
    assert_eq!(used(&s), 0);
}

#[test]
fn freed_blocks_go_tail_first_and_partial_blocks_are_reused_first() {
    let mut s = sched(8, 8);
    let _a = submit(&mut s, (0..9).collect(), 1);
    step(&mut s);
    // Blocks 1 and 2 cached, block 3 partial: 3 is reused first, then the
    // never-used ones, then 2 before 1.
    assert_eq!(s.pool.free_order(), [3, 4, 5, 6, 7, 2, 1].into_iter().map(BlockId).collect::<Vec<_>>());
}

#[test]
fn reset_is_refused_while_blocks_are_in_use() {
    let mut s = sched(16, 8);
    let _a = submit(&mut s, (0..8).collect(), 3);
    step(&mut s);
    assert!(!s.reset_prefix_cache());
    while !s.is_idle() {
        step(&mut s);
    }
    s.take_events();
    assert!(s.reset_prefix_cache());
    assert_eq!(s.take_events(), vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut s = sched(64, 8);
    let _a = submit(&mut s, (0..100).collect(), 1);
    assert_eq!(step(&mut s).prefill_tokens, 64);
    assert_eq!(step(&mut s).prefill_tokens, 36);
    assert!(s.is_idle());
}

#[test]
fn impossible_requests_are_answered_not_queued() {
    // 2 usable blocks hold 8 tokens: 8 prompt + 1 generated fits, 8 + 2 does not.
    let mut s = sched(3, 8);
    let mut ok = submit(&mut s, (0..8).collect(), 1);
    let mut a = submit(&mut s, (0..8).collect(), 2);
    assert!(matches!(a.try_recv(), Ok(Err(Rejected::TooLarge { needed_blocks: 3, num_blocks: 2 }))));
    step(&mut s);
    assert!(ok.try_recv().is_ok_and(|r| r.is_ok()));
    assert!(s.is_idle());
}
