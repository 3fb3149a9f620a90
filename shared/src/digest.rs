//! The order-independent digest of one worker's key set (wire protocol v2,
//! DESIGN.md §2): a key count and the wrapping sum of a strong 64-bit mix of
//! every key.
//!
//! Both ends keep it incrementally — the sidecar as keys enter and leave its
//! set, the router as it applies that worker's confirmed entries — so
//! comparing a whole key set costs 16 bytes on every push instead of sending
//! the set. A sum (not an XOR) of mixed keys: adding and removing are exact
//! inverses whatever the order, and a key counted twice does not cancel out.

use std::fmt;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::keys::BlockKey;

/// Count and mixed sum of a key set.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyDigest {
    /// Distinct keys in the set.
    pub count: u64,
    /// Wrapping sum of [`mix`] over the keys, as 16 hex digits on the wire
    /// (JSON numbers lose precision above 2^53).
    #[serde(serialize_with = "hex_ser", deserialize_with = "hex_de")]
    pub sum: u64,
}

/// SplitMix64's finalizer over the key xor a domain constant: block keys are
/// already SHA-256 truncations, the mix keeps the sum from being linear in
/// the raw keys (two sets with equal raw sums rarely have equal mixed sums).
pub fn mix(key: BlockKey) -> u64 {
    crate::hash::finalize(key.0 ^ 0x6b76_726f_7574_6532) // "kvroute2"
}

impl KeyDigest {
    /// The digest of `keys`, which must be distinct.
    pub fn of(keys: impl IntoIterator<Item = BlockKey>) -> Self {
        let mut d = KeyDigest::default();
        keys.into_iter().for_each(|k| d.insert(k));
        d
    }

    /// A key entered the set.
    pub fn insert(&mut self, key: BlockKey) {
        self.count = self.count.wrapping_add(1);
        self.sum = self.sum.wrapping_add(mix(key));
    }

    /// A key left the set.
    pub fn remove(&mut self, key: BlockKey) {
        self.count = self.count.wrapping_sub(1);
        self.sum = self.sum.wrapping_sub(mix(key));
    }
}

impl fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyDigest({} keys, {:016x})", self.count, self.sum)
    }
}

fn hex_ser<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:016x}"))
}

fn hex_de<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
    if s.len() != 16 {
        return Err(D::Error::custom("expected 16 hex digits"));
    }
    u64::from_str_radix(&s, 16).map_err(D::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_does_not_matter_and_removal_undoes_insertion() {
        let keys: Vec<BlockKey> = (1..1000u64).map(|i| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect();
        let forward = KeyDigest::of(keys.iter().copied());
        let backward = KeyDigest::of(keys.iter().rev().copied());
        assert_eq!(forward, backward);
        let mut d = forward;
        d.insert(BlockKey(7));
        assert_ne!(d, forward);
        d.remove(BlockKey(7));
        assert_eq!(d, forward);
        let mut missing_one = KeyDigest::of(keys[1..].iter().copied());
        assert_ne!(missing_one, forward);
        missing_one.insert(keys[0]);
        assert_eq!(missing_one, forward);
        // A swapped key with the same count is still told apart.
        let mut swapped = KeyDigest::of(keys[1..].iter().copied());
        swapped.insert(BlockKey(12345));
        assert_ne!(swapped, forward);
    }

    #[test]
    fn wire_form_is_a_count_and_sixteen_hex_digits() {
        let d = KeyDigest { count: 3, sum: 0xfedc_ba98_7654_3210 };
        let v = serde_json::to_value(d).unwrap();
        assert_eq!(v, serde_json::json!({"count": 3, "sum": "fedcba9876543210"}));
        assert_eq!(serde_json::from_value::<KeyDigest>(v).unwrap(), d);
        assert!(serde_json::from_str::<KeyDigest>(r#"{"count":1,"sum":"12"}"#).is_err());
    }
}
