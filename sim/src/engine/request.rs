//! One request as the scheduler tracks it: vLLM's `Request` reduced to what
//! decides cache contents: every token so far (prompt, then generated), the
//! hashes of its full blocks, the blocks it holds and how far it has got.
//!
//! Generated tokens are filler ids that differ from request to request, like
//! a real model's samples at vLLM's default temperature of 1: their blocks are
//! hashed and cached like prompt blocks, and match nothing later (no prompt
//! contains them).

use std::time::Instant;

use super::block_pool::BlockId;
use super::hashing::{BlockExtras, HashMode, extend_hashes};
use super::{Sink, Submission};
use crate::events::BlockHash;

#[derive(Debug)]
pub struct Request {
    /// Prompt, then generated tokens (vLLM's `all_token_ids`).
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Makes this request's generated ids its own.
    seed: u64,
    pub max_tokens: u32,
    pub extras: BlockExtras,
    pub lora_id: Option<u32>,
    pub arrival: Instant,
    pub sink: Sink,
    /// Hashes of every full block of `tokens`.
    pub hashes: Vec<BlockHash>,
    /// Blocks held, in token order (empty while waiting or preempted).
    pub blocks: Vec<BlockId>,
    /// Leading blocks whose hashes are registered (prefix hits included).
    pub num_cached_blocks: usize,
    /// Tokens whose KV is computed or scheduled this step (vLLM advances
    /// `num_computed_tokens` when it schedules).
    pub num_computed: usize,
    /// Tokens scheduled in the current step; 0 if not scheduled.
    pub scheduled: usize,
    pub num_preemptions: u32,
    /// The prefix hit on first admission: the response's `cached_tokens`.
    pub cached_tokens: Option<usize>,
}

impl Request {
    pub fn new(sub: Submission, seed: u64, block_size: usize, mode: HashMode) -> Self {
        let Submission { prompt, max_tokens, extras, lora_id, arrival, sink } = sub;
        let mut hashes = Vec::with_capacity(prompt.len() / block_size + 1);
        extend_hashes(&mut hashes, &prompt, block_size, &extras, mode);
        Request {
            prompt_len: prompt.len(),
            tokens: prompt,
            seed,
            max_tokens,
            extras,
            lora_id,
            arrival,
            sink,
            hashes,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_computed: 0,
            scheduled: 0,
            num_preemptions: 0,
            cached_tokens: None,
        }
    }

    /// Prompt plus generated tokens so far (vLLM's `num_tokens`).
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub fn generated(&self) -> u32 {
        (self.tokens.len() - self.prompt_len) as u32
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends the next generated token, hashing the block it may complete;
    /// returns its index among the generated tokens.
    pub fn append_generated(&mut self, block_size: usize, mode: HashMode) -> u32 {
        let index = self.generated();
        self.tokens.push(filler_token(self.seed, index));
        extend_hashes(&mut self.hashes, &self.tokens, block_size, &self.extras, mode);
        index
    }

    /// Gives back every block (the caller frees them) and starts over from
    /// the waiting queue, generated tokens kept: vLLM's recompute preemption.
    pub fn preempt(&mut self) -> Vec<BlockId> {
        self.num_cached_blocks = 0;
        self.num_computed = 0;
        self.scheduled = 0;
        self.num_preemptions += 1;
        std::mem::take(&mut self.blocks)
    }
}

/// Generated token `index` of the request seeded `seed`: splitmix64, folded
/// below 100,000 (inside every vocabulary the simulator stands in for).
fn filler_token(seed: u64, index: u32) -> u32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(index).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % 100_000) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_extend_the_hash_chain_and_differ_per_request() {
        let prompt: Vec<u32> = (0..6).collect();
        let sub = |prompt: Vec<u32>| {
            let (tx, _rx) = tokio::sync::oneshot::channel();
            Submission {
                prompt,
                max_tokens: 8,
                extras: BlockExtras::default(),
                lora_id: None,
                arrival: Instant::now(),
                sink: Sink::Once(tx),
            }
        };
        let mut a = Request::new(sub(prompt.clone()), 1, 4, HashMode::Int);
        let mut b = Request::new(sub(prompt), 2, 4, HashMode::Int);
        assert_eq!(a.hashes.len(), 1);
        assert_eq!(a.hashes, b.hashes);
        for _ in 0..3 {
            a.append_generated(4, HashMode::Int);
            b.append_generated(4, HashMode::Int);
        }
        assert_eq!((a.num_tokens(), a.generated(), a.hashes.len()), (9, 3, 2));
        assert_eq!(a.hashes[0], b.hashes[0]);
        assert_ne!(a.hashes[1], b.hashes[1], "generated blocks of two requests differ");
        let _ = a.preempt();
        assert_eq!((a.num_computed, a.num_preemptions, a.num_tokens()), (0, 1, 9));
    }
}
