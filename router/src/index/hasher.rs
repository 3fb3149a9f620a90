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
//! client can grind prompts until their keys share their low bits. So the
//! maps use [`Seeded`]: each key XORed with a seed drawn once per process
//! and mixed by SplitMix64's finalizer (the reasoning is on [`Seeded`]).
//! Measured with `cargo bench -p kvroute-router --bench router`
//! (BENCHMARKS.md, "Router index and decisions").

use std::collections::HashMap;

use kvroute_shared::BlockKey;
use kvroute_shared::hash::Seeded;

/// A map keyed by block keys.
pub type KeyMap<V> = HashMap<BlockKey, V, Seeded>;

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn a_block_key_hashes_as_its_u64_so_it_gets_the_seeded_mixing() {
        // `Seeded` mixes what it is given through `write_u64`; a `BlockKey`
        // hashed any other way (as bytes, say) would lose the guarantee
        // tested in `kvroute_shared::hash`.
        let seeded = Seeded::default();
        for key in [0u64, 7, 1 << 32, u64::MAX] {
            assert_eq!(seeded.hash_one(BlockKey(key)), seeded.hash_one(key));
        }
    }
}
