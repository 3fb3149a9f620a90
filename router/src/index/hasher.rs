//! How block keys are hashed in the router's maps.
//!
//! Block keys are already uniform 64-bit hashes (SHA-256 truncations), so
//! the index first hashed them by identity: a lookup cost a probe, not a
//! hash computation (kept over foldhash and rustc-hash in issue 15: on this
//! 2-core machine, std `HashMap<u64, u64>`, uniformly random keys, best of 5
//! runs of 4 M lookups, 2026-11-23, the identity hit 5.5 / 19.9 ns and missed
//! 8.7 / 13.0 ns at 100 k / 1 M keys; foldhash 7.4 / 25.1 and 10.9 / 17.0 ns;
//! rustc-hash 7.1 / 26.4 and 10.2 / 17.8 ns).
//!
//! But the keys are not always the router's to choose: a sidecar reports
//! the keys its engine stored, another replica the keys it sent, and a
//! client can grind prompts until their keys share their low bits (about
//! 2^b SHA-256 computations a key for b bits). Keys that share their low
//! bits share a bucket of an identity-hashed map, and every insert and
//! lookup among them is a scan: a few thousand such keys make the index
//! quadratic. So each key is XORed with a seed drawn once per process and
//! mixed by SplitMix64's finalizer, in which every output bit depends on
//! every input bit: two multiplications, and a key's bucket cannot be
//! aimed at without the seed. Measured with `cargo bench -p kvroute-router
//! --bench router` (BENCHMARKS.md, "Router index and decisions").

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use kvroute_shared::BlockKey;

/// Builds [`KeyHasher`]s with this process's seed.
#[derive(Clone, Copy, Debug)]
pub struct Seeded(u64);

impl Default for Seeded {
    fn default() -> Self {
        Seeded(kvroute_shared::hash::process_seed())
    }
}

impl BuildHasher for Seeded {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher { seed: self.0, state: 0 }
    }
}

/// A block key XORed with the seed and mixed (SplitMix64's finalizer).
#[derive(Clone, Copy, Debug)]
pub struct KeyHasher {
    seed: u64,
    state: u64,
}

impl Hasher for KeyHasher {
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
        self.state = kvroute_shared::hash::finalize(n ^ self.seed);
    }
}

/// A map keyed by block keys.
pub type KeyMap<V> = HashMap<BlockKey, V, Seeded>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_made_to_share_their_low_bits_still_spread_over_buckets() {
        // 4,096 keys equal in their low 32 bits: by identity, one bucket of
        // any table up to 2^32 buckets.
        let seeded = Seeded::default();
        let buckets: std::collections::HashSet<u64> =
            (0..4_096u64).map(|i| seeded.hash_one(BlockKey(i << 32)) & 1_023).collect();
        assert!(buckets.len() > 900, "{} of 1,024 buckets", buckets.len());
        // One seed per process: the same key hashes alike in every map.
        assert_eq!(seeded.hash_one(BlockKey(7)), Seeded::default().hash_one(BlockKey(7)));
    }
}
