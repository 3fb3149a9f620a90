//! Deterministic synthetic token ids.
//!
//! Every workload builds its prompts from runs of token ids derived from a
//! 64-bit seed, so the same seed always gives the same run and different
//! seeds give (with overwhelming probability) runs that differ in their first
//! token, i.e. share no cached block. No tokenizer is involved: the router
//! passes token-id prompts to the engine unchanged.

/// Lowest token id used; keeps clear of ids that byte-level tokenizers give
/// special meaning to.
const BASE: u32 = 1_000;
/// Token ids are drawn from `BASE..BASE + SPAN`.
const SPAN: u64 = 50_000;

/// SplitMix64's finaliser: a bijective mix of a 64-bit word.
pub fn mix(z: u64) -> u64 {
    kvroute_shared::hash::finalize(z.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// A seed naming one piece of one workload (`tag` separates pieces, e.g. the
/// system prompt from user 3's history), so pieces never collide by accident.
pub fn seed(tag: u64, a: u64, b: u64) -> u64 {
    mix(mix(mix(tag) ^ a) ^ b.rotate_left(17))
}

/// The `i`-th token of the run named by `seed`.
pub fn token(seed: u64, i: usize) -> u32 {
    BASE + (mix(seed ^ (i as u64).wrapping_mul(0xd6e8_feb8_6659_fd93)) % SPAN) as u32
}

/// Appends `len` tokens of the run named by `seed` to `out`.
pub fn extend_run(out: &mut Vec<u32>, seed: u64, len: usize) {
    out.extend((0..len).map(|i| token(seed, i)));
}

/// The run named by `seed`, `len` tokens long.
pub fn run(seed: u64, len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(len);
    extend_run(&mut out, seed, len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_deterministic_and_distinct() {
        assert_eq!(run(7, 100), run(7, 100));
        assert_ne!(run(7, 100)[0], run(8, 100)[0]);
        assert_eq!(run(7, 10)[..], run(7, 100)[..10]);
        assert!(run(1, 1000).iter().all(|&t| (BASE..BASE + SPAN as u32).contains(&t)));
    }

    #[test]
    fn seeds_separate_their_parts() {
        assert_ne!(seed(1, 2, 3), seed(1, 3, 2));
        assert_ne!(seed(1, 2, 3), seed(2, 2, 3));
    }
}
