//! Block keys are already uniform 64-bit hashes (SHA-256 truncations), so the
//! index hashes them with the identity instead of SipHash: a lookup costs a
//! probe, not a hash computation.

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
