//! Mixing for hash maps and digests: SplitMix64's finalizer, and a seed
//! drawn once per process for maps whose keys someone else chooses.

use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

/// SplitMix64's finalizer: a bijection on 64 bits in which every output bit
/// depends on every input bit (two multiplications).
pub fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random value drawn once per process (from the OS, as std's
/// `RandomState` draws its keys). A map that mixes its keys with it cannot
/// have its buckets aimed at by whoever chooses the keys, and every map of
/// the process hashes a key alike.
pub fn process_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| RandomState::new().hash_one(0x6b76_726f_7574_6572_u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_finalizer_is_splitmix64s_and_the_seed_is_one_per_process() {
        // SplitMix64's first output from state 0 (its increment, finalized).
        assert_eq!(finalize(0x9e37_79b9_7f4a_7c15), 0xe220_a839_7b1d_cdaf);
        assert_eq!(process_seed(), process_seed());
    }
}
