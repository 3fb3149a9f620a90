//! Mixing for hash maps and digests: SplitMix64's finalizer, a seed drawn
//! once per process, and the hasher the router's and the sidecar's maps of
//! 64-bit keys use ([`Seeded`]).

use std::hash::{BuildHasher, Hasher, RandomState};
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

/// Builds [`SeededHasher`]s with this process's seed: the hasher for maps
/// keyed by 64-bit digests (block keys, engine block hashes).
///
/// Such keys are uniform, so a map could hash them by identity (or one
/// multiply) and save the mixing. But they are not the process's to choose:
/// router keys and engine hashes both derive from client prompts, and a
/// client can grind prompts until their keys share their low bits (about
/// 2^b SHA-256 computations a key for b bits). hashbrown takes a bucket from
/// the low bits, so keys that share them share a probe sequence, and every
/// insert and lookup among them is a scan: a few thousand such keys make a
/// map quadratic. Each key is therefore XORed with the process seed and
/// mixed by [`finalize`], in which every output bit depends on every input
/// bit: two multiplications, and a key's bucket cannot be aimed at without
/// the seed. The cost is measured in BENCHMARKS.md (router index, sidecar
/// decode + translate).
#[derive(Clone, Copy, Debug)]
pub struct Seeded(u64);

impl Default for Seeded {
    fn default() -> Self {
        Seeded(process_seed())
    }
}

impl BuildHasher for Seeded {
    type Hasher = SeededHasher;

    fn build_hasher(&self) -> SeededHasher {
        SeededHasher { seed: self.0, state: 0 }
    }
}

/// A 64-bit key XORed with the seed and mixed by [`finalize`].
#[derive(Clone, Copy, Debug)]
pub struct SeededHasher {
    seed: u64,
    state: u64,
}

impl Hasher for SeededHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than a `u64`, which these maps never
        // have; correct all the same.
        for &b in bytes {
            self.write_u64(self.state.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.state = finalize(n ^ self.seed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_made_to_share_their_low_bits_still_spread_over_buckets() {
        // 4,096 keys equal in their low 32 bits: by identity, or by one
        // multiply, one bucket of any table up to 2^32 buckets.
        let seeded = Seeded::default();
        let buckets: std::collections::HashSet<u64> = (0..4_096u64).map(|i| seeded.hash_one(i << 32) & 1_023).collect();
        assert!(buckets.len() > 900, "{} of 1,024 buckets", buckets.len());
        // One seed per process: the same key hashes alike in every map.
        assert_eq!(seeded.hash_one(7u64), Seeded::default().hash_one(7u64));
    }

    #[test]
    fn the_finalizer_is_splitmix64s_and_the_seed_is_one_per_process() {
        // SplitMix64's first output from state 0 (its increment, finalized).
        assert_eq!(finalize(0x9e37_79b9_7f4a_7c15), 0xe220_a839_7b1d_cdaf);
        assert_eq!(process_seed(), process_seed());
    }
}
