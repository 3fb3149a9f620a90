//! Block keys are already uniform 64-bit hashes (SHA-256 truncations), so the
//! index hashes them with the identity instead of SipHash: a lookup costs a
//! probe, not a hash computation.
//!
//! Kept over foldhash and rustc-hash (issue 15): measured on this 2-core
//! machine (std `HashMap<u64, u64>`, uniformly random keys, best of 5 runs of
//! 4 M lookups, 2026-11-23), the identity hit 5.5 / 19.9 ns and missed
//! 8.7 / 13.0 ns at 100 k / 1 M keys; foldhash 7.4 / 25.1 and 10.9 / 17.0 ns;
//! rustc-hash 7.1 / 26.4 and 10.2 / 17.8 ns. At 8 M keys all were within the
//! noise of a shared machine (48-55 ns hits).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use kvroute_shared::BlockKey;

#[derive(Default, Clone, Copy, Debug)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys, which the index never uses; fold
        // anyway so the hasher stays correct.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map keyed by block keys.
pub type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<IdentityHasher>>;
