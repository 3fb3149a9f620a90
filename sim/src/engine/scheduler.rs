//! vLLM v1's continuous-batching scheduler (vllm/v1/core/sched/scheduler.py
//! with its default FCFS policy and synchronous scheduling, as on CPU),
//! reduced to what decides cache contents and timing.
//!
//! A step ([`Scheduler::schedule`]) first gives running requests their tokens
//! in order (the rest of a chunked prefill, or one decode token), growing
//! their blocks as they go (`allocate_slots`). When the pool runs short, the
//! last running request is preempted (recompute: its blocks are freed and it
//! goes back to the front of the waiting queue, generated tokens kept) until
//! the allocation fits or the request preempted itself. Only if nobody was
//! preempted are waiting requests admitted, first come first served, while
//! there is a sequence slot, token budget and room for the whole current
//! sequence (`scheduler_reserve_full_isl`). A request's prefix hit is looked
//! up on admission, capped so its last token is always computed.
//!
//! [`Scheduler::complete`] then applies the step's output: requests whose
//! scheduled tokens reached their end sample one token (a chunk in the middle
//! of a prefill samples nothing); those at `max_tokens` finish and free their
//! blocks. The last sampled token's KV is never computed, so a request of
//! prompt P and M generated tokens ends holding ⌈(P + M − 1) / block⌉ blocks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::block_pool::{BlockPool, FullBlocks, StoreMeta};
use super::hashing::HashMode;
use super::request::Request;
use super::{Outcome, Rejected, Sink, StreamEvent, Submission};
use crate::events::KvEvent;
use crate::metrics::EngineMetrics;

/// Scheduler limits (vLLM's flags of the same names).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
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
    waiting: VecDeque<Request>,
    running: Vec<Request>,
    limits: Limits,
    hash_mode: HashMode,
    metrics: Arc<EngineMetrics>,
    /// Requests ever submitted: seeds each one's generated tokens.
    submitted: u64,
}

impl Scheduler {
    pub fn new(pool: BlockPool, limits: Limits, hash_mode: HashMode, metrics: Arc<EngineMetrics>) -> Self {
        Scheduler { pool, waiting: VecDeque::new(), running: Vec::new(), limits, hash_mode, metrics, submitted: 0 }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// False (and nothing changes) while running requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Queues a request, or answers at once if it could never fit: its blocks
    /// at the end (the last sampled token takes no slot) exceed the pool.
    pub fn submit(&mut self, sub: Submission) {
        let bs = self.pool.block_size();
        let needed = (sub.prompt.len() + sub.max_tokens as usize).saturating_sub(1).div_ceil(bs);
        if sub.prompt.is_empty() || needed > self.pool.usable_blocks() {
            let why = Rejected::TooLarge { needed_blocks: needed, num_blocks: self.pool.usable_blocks() };
            sub.sink.fail(why);
            return;
        }
        self.submitted += 1;
        self.waiting.push_back(Request::new(sub, self.submitted, bs, self.hash_mode));
    }

    /// Plans one step: running requests first, then admissions.
    pub fn schedule(&mut self) -> StepWork {
        // vLLM takes a request whose client left out of the queue at once
        // (its abort), not when it reaches the front: counted as waiting
        // meanwhile, it inflated the load the router reads.
        self.waiting.retain(|r| !r.sink.is_closed());
        let mut budget = self.limits.max_num_batched_tokens;
        let mut work = StepWork::default();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let req = &self.running[i];
            let room = self.limits.max_model_len.saturating_sub(req.num_computed + 1);
            let n = (req.num_tokens() - req.num_computed).min(budget).min(room);
            if n == 0 {
                i += 1;
                continue;
            }
            let end = req.num_computed + n;
            // Preempt from the back until this request's new blocks fit.
            let mut fits = true;
            loop {
                let req = &self.running[i];
                if end.div_ceil(self.pool.block_size()).saturating_sub(req.blocks.len()) <= self.pool.num_free() {
                    break;
                }
                let Some(mut victim) = self.running.pop() else { break };
                let blocks = victim.preempt();
                self.pool.free(&blocks);
                self.metrics.preemptions.fetch_add(1, Relaxed);
                self.waiting.push_front(victim);
                preempted = true;
                if self.running.len() == i {
                    fits = false;
                    break;
                }
            }
            if !fits {
                break;
            }
            let req = &mut self.running[i];
            work.add(req, n);
            grow(&mut self.pool, req, end);
            req.scheduled = n;
            req.num_computed = end;
            budget -= n;
            i += 1;
        }
        if !preempted {
            self.admit(budget, &mut work);
        }
        work
    }

    /// Admits waiting requests into the step while they fit.
    fn admit(&mut self, mut budget: usize, work: &mut StepWork) {
        let bs = self.pool.block_size();
        while budget > 0 {
            let Some(front) = self.waiting.front() else { break };
            if front.sink.is_closed() {
                self.waiting.pop_front();
                continue;
            }
            if self.running.len() >= self.limits.max_num_seqs {
                break;
            }
            let num_tokens = front.num_tokens();
            // vLLM computes at least one token: the hit may not cover the last.
            let hittable = ((num_tokens - 1) / bs).min(front.hashes.len());
            let hits = self.pool.longest_hit(&front.hashes[..hittable]);
            let hit_tokens = hits.len() * bs;
            let n = (num_tokens - hit_tokens).min(budget);
            // The whole current sequence must fit, not only this chunk.
            let whole = num_tokens.min(self.limits.max_model_len).div_ceil(bs).max((hit_tokens + n).div_ceil(bs));
            if whole - hits.len() + self.pool.evictable(&hits) > self.pool.num_free() {
                break;
            }
            let Some(mut req) = self.waiting.pop_front() else { break };
            self.pool.touch(&hits);
            req.num_cached_blocks = hits.len();
            req.blocks = hits;
            req.num_computed = hit_tokens;
            if req.num_preemptions == 0 {
                // vLLM counts a request's lookup once, at its first admission.
                self.metrics.prefix_queries.fetch_add(num_tokens as u64, Relaxed);
                self.metrics.prefix_hits.fetch_add(hit_tokens as u64, Relaxed);
                self.metrics.prompt_tokens.fetch_add(num_tokens as u64, Relaxed);
                req.cached_tokens = Some(hit_tokens);
            }
            work.add(&req, n);
            grow(&mut self.pool, &mut req, hit_tokens + n);
            req.scheduled = n;
            req.num_computed = hit_tokens + n;
            budget -= n;
            self.running.push(req);
        }
    }

    /// Applies the step's results: requests whose clients left are aborted,
    /// then every request whose scheduled tokens reached its end samples a
    /// token, and those done free their blocks (in running order).
    pub fn complete(&mut self, now: Instant) {
        let bs = self.pool.block_size();
        let running = std::mem::take(&mut self.running);
        let (gone, alive): (Vec<Request>, Vec<Request>) = running.into_iter().partition(|r| r.sink.is_closed());
        for req in gone {
            self.pool.free(&req.blocks);
        }
        // Answered only after the gauges below are updated, so a client that
        // scrapes `/metrics` right after its response sees itself finished.
        let mut finished = Vec::new();
        for mut req in alive {
            let scheduled = std::mem::take(&mut req.scheduled);
            if scheduled == 0 || req.num_computed < req.num_tokens() {
                self.running.push(req);
                continue;
            }
            let index = req.append_generated(bs, self.hash_mode);
            if index == 0 {
                let ttft = now.saturating_duration_since(req.arrival).as_secs_f64();
                self.metrics.ttft.observe(ttft);
            }
            self.metrics.generation_tokens.fetch_add(1, Relaxed);
            let here = req.sink.token(index);
            let done = req.generated() >= req.max_tokens || req.num_tokens() >= self.limits.max_model_len;
            if here && !done {
                self.running.push(req);
                continue;
            }
            self.pool.free(&req.blocks);
            if here {
                self.metrics.finished.fetch_add(1, Relaxed);
                let outcome = Outcome {
                    prompt_tokens: req.prompt_len(),
                    cached_tokens: req.cached_tokens.unwrap_or(0),
                    completion_tokens: req.generated(),
                };
                finished.push((req.sink, outcome));
            }
        }
        self.metrics.running.store(self.running.len() as u64, Relaxed);
        self.metrics.waiting.store(self.waiting.len() as u64, Relaxed);
        self.metrics.set_kv_usage(self.pool.usage());
        for (sink, outcome) in finished {
            sink.finish(outcome);
        }
    }
}

/// vLLM's `allocate_slots` for a request whose KV will reach `end` tokens:
/// new blocks for the slots, then the newly full blocks cached.
fn grow(pool: &mut BlockPool, req: &mut Request, end: usize) {
    let bs = pool.block_size();
    let need = end.div_ceil(bs).saturating_sub(req.blocks.len());
    // The caller checked the room; allocation is all or nothing.
    if let Some(fresh) = pool.allocate(need) {
        req.blocks.extend(fresh);
    }
    let full = (end.min(req.num_tokens()) / bs).min(req.blocks.len());
    if full > req.num_cached_blocks {
        let meta = StoreMeta { lora_id: req.lora_id, extras: &req.extras };
        let view = FullBlocks { blocks: &req.blocks, hashes: &req.hashes, tokens: req.tokens(), meta };
        pool.cache_full_blocks(view, req.num_cached_blocks..full);
        req.num_cached_blocks = full;
    }
}

impl StepWork {
    /// Counts `n` tokens scheduled for `req` (not yet advanced): one decode
    /// token, or prefill (first pass or recompute after preemption).
    fn add(&mut self, req: &Request, n: usize) {
        if n == 1 && req.generated() > 0 && req.num_computed + 1 == req.num_tokens() {
            self.decode_seqs += 1;
        } else {
            self.prefill_tokens += n;
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
mod tests;
