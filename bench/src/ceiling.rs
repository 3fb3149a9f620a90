//! The infinite-cache ceiling of a workload: the token-level prefix hit rate
//! one engine with unbounded KV cache would reach, serving every request in
//! the workload's order. No router can beat it, so compare reports each
//! policy's measured hit rate against it.
//!
//! It counts exactly as vLLM (and kvroute-sim) do: only whole blocks hit, a
//! request can never hit its last prompt token (at least one token is always
//! computed), queries are whole prompt lengths, and only prompt blocks enter
//! the cache.

use std::collections::HashSet;

use crate::tokens::mix;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ceiling {
    pub hit_tokens: u64,
    pub query_tokens: u64,
    /// Distinct full blocks in the workload: its working set.
    pub unique_blocks: u64,
    /// Blocks of the longest prompt.
    pub max_prompt_blocks: u64,
}

impl Ceiling {
    pub fn rate(&self) -> f64 {
        if self.query_tokens == 0 { 0.0 } else { self.hit_tokens as f64 / self.query_tokens as f64 }
    }
}

/// Chained block hashes of a prompt's full blocks: equal hash `i` means equal
/// tokens `0..(i + 1) * block`.
pub(crate) fn block_chain(tokens: &[u32], block: usize) -> impl Iterator<Item = u64> + '_ {
    tokens.chunks_exact(block).scan(0x006b_7672_6f75_7465_u64, |prev, chunk| {
        let mut h = mix(*prev);
        for &t in chunk {
            h = mix(h ^ u64::from(t));
        }
        *prev = h;
        Some(h)
    })
}

/// Feeds prompts in order through one infinite cache.
pub fn compute<I, P>(prompts: I, block: usize) -> Ceiling
where
    I: IntoIterator<Item = P>,
    P: AsRef<[u32]>,
{
    let mut cache: HashSet<u64> = HashSet::new();
    let mut c = Ceiling::default();
    for prompt in prompts {
        let tokens = prompt.as_ref();
        if tokens.is_empty() {
            continue;
        }
        let hittable = (tokens.len() - 1) / block;
        let chain: Vec<u64> = block_chain(tokens, block).collect();
        let hit = chain.iter().take(hittable).take_while(|h| cache.contains(h)).count();
        c.hit_tokens += (hit * block) as u64;
        c.query_tokens += tokens.len() as u64;
        c.max_prompt_blocks = c.max_prompt_blocks.max(chain.len() as u64);
        cache.extend(chain);
    }
    c.unique_blocks = cache.len() as u64;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_made_example() {
        // Block size 4.
        let a: Vec<u32> = (0..10).collect(); // blocks [0..4) [4..8), 2 tokens spare
        let b: Vec<u32> = (0..9).collect(); // same two blocks + 1 token: hits both (8 ≤ 9 - 1)
        let c: Vec<u32> = (0..8).collect(); // exactly two blocks: last token never hits → 1 block
        let d: Vec<u32> = vec![0, 1, 2, 3, 99, 5, 6, 7, 8]; // diverges in block 2 → 1 block
        let e: Vec<u32> = vec![7, 7, 7]; // no full block
        let c = compute([a, b, c, d, e], 4);
        assert_eq!(c.hit_tokens, 8 + 4 + 4);
        assert_eq!(c.query_tokens, 10 + 9 + 8 + 9 + 3);
        // Distinct full blocks: [0..4), [0..8), [0..4)+[99,5,6,7].
        assert_eq!(c.unique_blocks, 3);
        assert_eq!(c.max_prompt_blocks, 2);
        assert!((c.rate() - 16.0 / 39.0).abs() < 1e-12);
    }

    #[test]
    fn a_repeat_hits_all_but_its_last_block_when_aligned() {
        let p: Vec<u32> = (0..64).collect();
        let c = compute([p.clone(), p], 16);
        assert_eq!(c.hit_tokens, 48);
    }

    #[test]
    fn equal_suffixes_after_a_different_prefix_do_not_hit() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[0] = 999;
        assert_eq!(compute([a, b], 16).hit_tokens, 0);
    }
}
