//! vLLM v1's continuous-batching scheduler, reduced to what decides cache
//! contents and timing.
//!
//! Each step first gives running requests their tokens (a prefill chunk, or one
//! decode token), then admits waiting requests first-come-first-served while
//! there is a sequence slot, token budget and KV room. A request's prefix hit is
//! looked up on admission, capped so the last prompt token is always computed.
//! Admission reserves blocks for the prompt *and* `max_tokens` (vLLM grows a
//! request's blocks as it decodes and preempts on shortage; reserving up front
//! keeps the simulator free of preemption while keeping the same cache
//! contents for prompt blocks). When the head of the queue does not fit, it and
//! everyone behind it waits, as with vLLM's FCFS policy.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::block_pool::{BlockId, BlockPool, StoreMeta};
use super::hashing::{HashMode, prompt_hashes};
use super::{Outcome, Rejected, Sink, StreamEvent, Submission};
use crate::events::{BlockHash, KvEvent};
use crate::metrics::EngineMetrics;

/// Scheduler limits (vLLM's flags of the same names).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

#[derive(Debug)]
struct Seq {
    sub: Submission,
    hashes: Vec<BlockHash>,
    blocks: Vec<BlockId>,
    /// Prompt tokens whose KV exists (cached hits included).
    computed: usize,
    cached_tokens: usize,
    generated: u32,
    /// This step's work: `Some(n)` prefill tokens, `Some(0)` one decode token.
    step: Option<usize>,
}

impl Seq {
    fn prompt_len(&self) -> usize {
        self.sub.prompt.len()
    }
}

/// What the scheduled step costs (the engine turns this into time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepWork {
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
}

#[derive(Debug)]
pub struct Scheduler {
    pool: BlockPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    limits: Limits,
    hash_mode: HashMode,
    metrics: Arc<EngineMetrics>,
}

impl Scheduler {
    pub fn new(pool: BlockPool, limits: Limits, hash_mode: HashMode, metrics: Arc<EngineMetrics>) -> Self {
        Scheduler { pool, waiting: VecDeque::new(), running: Vec::new(), limits, hash_mode, metrics }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset();
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Queues a request, or answers at once if it could never fit.
    pub fn submit(&mut self, sub: Submission) {
        let bs = self.pool.block_size();
        let needed = (sub.prompt.len() + sub.max_tokens as usize).div_ceil(bs);
        if sub.prompt.is_empty() || needed > self.pool.num_blocks() {
            let why = Rejected::TooLarge { needed_blocks: needed, num_blocks: self.pool.num_blocks() };
            sub.sink.fail(why);
            return;
        }
        let hashes = prompt_hashes(&sub.prompt, bs, &sub.extras, self.hash_mode);
        self.waiting.push_back(Seq {
            sub,
            hashes,
            blocks: Vec::new(),
            computed: 0,
            cached_tokens: 0,
            generated: 0,
            step: None,
        });
    }

    /// Plans one step: running requests first, then admissions.
    pub fn schedule(&mut self) -> StepWork {
        let bs = self.pool.block_size();
        let mut budget = self.limits.max_num_batched_tokens;
        let mut work = StepWork::default();
        for seq in &mut self.running {
            seq.step = None;
            if budget == 0 {
                continue;
            }
            if seq.computed < seq.prompt_len() {
                let n = (seq.prompt_len() - seq.computed).min(budget);
                budget -= n;
                work.prefill_tokens += n;
                seq.step = Some(n);
                let end = ((seq.computed + n) / bs).min(seq.hashes.len());
                let meta = StoreMeta { lora_id: seq.sub.lora_id, extras: &seq.sub.extras };
                self.pool.cache(&seq.blocks, &seq.hashes, &seq.sub.prompt, seq.computed / bs..end, meta);
            } else {
                budget -= 1;
                work.decode_seqs += 1;
                seq.step = Some(0);
            }
        }
        while budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(front) = self.waiting.front() else { break };
            if front.sub.sink.is_closed() {
                self.waiting.pop_front();
                continue;
            }
            let len = front.prompt_len();
            // vLLM computes at least one token: the hit may not cover the last.
            let hittable = (len - 1) / bs;
            let hits = self.pool.longest_hit(&front.hashes[..hittable]);
            let total = (len + front.sub.max_tokens as usize).div_ceil(bs);
            if self.pool.allocatable_after(&hits) < total - hits.len() {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else { break };
            self.pool.touch(&hits);
            let Some(fresh) = self.pool.allocate(total - hits.len()) else {
                // Unreachable after the check above; undo and wait rather than panic.
                self.pool.free(&hits);
                self.waiting.push_front(seq);
                break;
            };
            seq.computed = hits.len() * bs;
            seq.cached_tokens = seq.computed;
            seq.blocks = hits;
            seq.blocks.extend(fresh);
            self.metrics.prefix_queries.fetch_add(len as u64, Relaxed);
            self.metrics.prefix_hits.fetch_add(seq.cached_tokens as u64, Relaxed);
            self.metrics.prompt_tokens.fetch_add(len as u64, Relaxed);
            let n = (len - seq.computed).min(budget);
            budget -= n;
            work.prefill_tokens += n;
            seq.step = Some(n);
            let end = ((seq.computed + n) / bs).min(seq.hashes.len());
            let meta = StoreMeta { lora_id: seq.sub.lora_id, extras: &seq.sub.extras };
            self.pool.cache(&seq.blocks, &seq.hashes, &seq.sub.prompt, seq.computed / bs..end, meta);
            self.running.push(seq);
        }
        work
    }

    /// Applies the step's results: prefill progress, one token per request that
    /// reached decoding, and finished or abandoned requests freed.
    pub fn complete(&mut self, now: Instant) {
        // Answered only after the gauges below are updated, so a client that
        // scrapes `/metrics` right after its response sees itself finished.
        let mut finished = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            let mut alive = !seq.sub.sink.is_closed();
            if alive && let Some(n) = seq.step.take() {
                let was_decoding = seq.computed == seq.prompt_len();
                seq.computed += n;
                if was_decoding || seq.computed == seq.prompt_len() {
                    if seq.generated == 0 {
                        let ttft = now.saturating_duration_since(seq.sub.arrival).as_secs_f64();
                        self.metrics.ttft.lock().observe(ttft);
                    }
                    seq.generated += 1;
                    self.metrics.generation_tokens.fetch_add(1, Relaxed);
                    alive = seq.sub.sink.token(seq.generated - 1);
                }
            }
            let done = alive && seq.generated >= seq.sub.max_tokens;
            if done || !alive {
                let seq = self.running.swap_remove(i);
                self.pool.free(&seq.blocks);
                if done {
                    self.metrics.finished.fetch_add(1, Relaxed);
                    let outcome = Outcome {
                        prompt_tokens: seq.prompt_len(),
                        cached_tokens: seq.cached_tokens,
                        completion_tokens: seq.generated,
                    };
                    finished.push((seq.sub.sink, outcome));
                }
                continue;
            }
            i += 1;
        }
        self.metrics.running.store(self.running.len() as u64, Relaxed);
        self.metrics.waiting.store(self.waiting.len() as u64, Relaxed);
        self.metrics.set_kv_usage(self.pool.usage());
        for (sink, outcome) in finished {
            sink.finish(outcome);
        }
    }
}

impl Sink {
    fn is_closed(&self) -> bool {
        match self {
            Sink::Once(tx) => tx.is_closed(),
            Sink::Stream(tx) => tx.is_closed(),
        }
    }

    /// Reports a generated token; false if the client has gone.
    fn token(&self, index: u32) -> bool {
        match self {
            Sink::Once(tx) => !tx.is_closed(),
            Sink::Stream(tx) => tx.send(StreamEvent::Token { index }).is_ok(),
        }
    }

    fn finish(self, outcome: Outcome) {
        // A client that left just now is not an error.
        let _ = match self {
            Sink::Once(tx) => tx.send(Ok(outcome)).map_err(drop),
            Sink::Stream(tx) => tx.send(StreamEvent::Done(outcome)).map_err(drop),
        };
    }

    fn fail(self, why: Rejected) {
        let _ = match self {
            Sink::Once(tx) => tx.send(Err(why)).map_err(drop),
            Sink::Stream(tx) => tx.send(StreamEvent::Failed(why)).map_err(drop),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::hashing::BlockExtras;
    use tokio::sync::oneshot;

    type Waiter = oneshot::Receiver<Result<Outcome, Rejected>>;

    fn sched(blocks: u32, max_num_seqs: usize) -> Scheduler {
        let limits = Limits { max_num_seqs, max_num_batched_tokens: 64 };
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
    fn waits_for_kv_blocks_and_then_hits() {
        // 3 blocks of 4: a 8-token prompt + 4 tokens takes all three.
        let mut s = sched(3, 8);
        let p: Vec<u32> = (0..8).collect();
        let _a = submit(&mut s, p.clone(), 4);
        let mut b = submit(&mut s, p.clone(), 1);
        step(&mut s);
        assert_eq!(s.running.len(), 1, "b waits: no free block");
        for _ in 0..3 {
            step(&mut s);
        }
        // a finished this step and freed its blocks; b is admitted next step
        // and hits one block (the last prompt token is always recomputed).
        step(&mut s);
        let outcome = b.try_recv().expect("b done").expect("ok");
        assert_eq!(outcome.cached_tokens, 4);
        assert_eq!(s.metrics.prefix_hits.load(Relaxed), 4);
        assert_eq!(s.metrics.prefix_queries.load(Relaxed), 16);
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
        let mut s = sched(2, 8);
        let mut a = submit(&mut s, (0..100).collect(), 1);
        assert!(matches!(a.try_recv(), Ok(Err(Rejected::TooLarge { .. }))));
        assert!(s.is_idle());
    }
}
