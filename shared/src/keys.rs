//! Router block keys (DESIGN.md §1).
//!
//! The router never indexes by vLLM's own block hashes: those depend on the
//! engine's hash function, `PYTHONHASHSEED` and version. Both the router (from
//! request tokens) and the sidecar (from `BlockStored` token ids) compute the
//! same chained key here, so a key names a whole prefix.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

const ROOT_DOMAIN: &[u8] = b"kvroute/root/v1";
const BLOCK_DOMAIN: &[u8] = b"kvroute/block/v1";

/// The key of one full block of tokens: it identifies the block *and* every
/// block before it, so a matching key means the whole prefix matches.
///
/// On the wire a key is a 16-character lowercase hex string (JSON numbers lose
/// precision above 2^53).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// The start of a key chain: one per (model, cache salt). Requests for a LoRA
/// adapter name the adapter as their model, so adapters never share keys with
/// their base model; a `cache_salt` isolates tenants the same way.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct KeyRoot(pub BlockKey);

impl KeyRoot {
    pub fn new(model: &str, cache_salt: Option<&str>) -> Self {
        let mut h = Sha256::new();
        h.update(ROOT_DOMAIN);
        h.update(model.as_bytes());
        h.update([0u8]);
        h.update(cache_salt.unwrap_or("").as_bytes());
        KeyRoot(BlockKey(first_u64(&h.finalize())))
    }
}

impl BlockKey {
    /// The key of the block holding `tokens`, whose predecessor's key is `parent`
    /// (the root's key for the first block).
    pub fn chain(parent: BlockKey, tokens: &[u32]) -> BlockKey {
        // One contiguous buffer: a single `update` is measurably faster than one
        // per token for the ~80-byte inputs of a 16-token block.
        let mut buf = [0u8; BLOCK_DOMAIN.len() + 8 + 4 * 64];
        let n = BLOCK_DOMAIN.len() + 8 + 4 * tokens.len();
        if n > buf.len() {
            return Self::chain_slow(parent, tokens);
        }
        buf[..BLOCK_DOMAIN.len()].copy_from_slice(BLOCK_DOMAIN);
        buf[BLOCK_DOMAIN.len()..BLOCK_DOMAIN.len() + 8].copy_from_slice(&parent.0.to_be_bytes());
        let mut at = BLOCK_DOMAIN.len() + 8;
        for t in tokens {
            buf[at..at + 4].copy_from_slice(&t.to_le_bytes());
            at += 4;
        }
        BlockKey(first_u64(&Sha256::digest(&buf[..n])))
    }

    fn chain_slow(parent: BlockKey, tokens: &[u32]) -> BlockKey {
        let mut h = Sha256::new();
        h.update(BLOCK_DOMAIN);
        h.update(parent.0.to_be_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        BlockKey(first_u64(&h.finalize()))
    }

    pub fn to_hex(self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Keys of every *full* block of `tokens` (vLLM caches only full blocks).
pub fn block_keys(root: KeyRoot, tokens: &[u32], block_size: BlockSize) -> Vec<BlockKey> {
    let mut parent = root.0;
    tokens
        .chunks_exact(block_size.get())
        .map(|block| {
            parent = BlockKey::chain(parent, block);
            parent
        })
        .collect()
}

fn first_u64(digest: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(b)
}

/// Tokens per KV-cache block. Must equal the engine's `--block-size`, or no key
/// the router computes will ever match a key the sidecar reports.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct BlockSize(u32);

impl BlockSize {
    /// vLLM's default.
    pub const DEFAULT: BlockSize = BlockSize(16);

    pub fn new(n: u32) -> Result<Self, BlockSizeError> {
        if (1..=4096).contains(&n) { Ok(BlockSize(n)) } else { Err(BlockSizeError(n)) }
    }

    pub fn get(self) -> usize {
        self.0 as usize
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl From<BlockSize> for u32 {
    fn from(b: BlockSize) -> u32 {
        b.0
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = BlockSizeError;
    fn try_from(n: u32) -> Result<Self, Self::Error> {
        BlockSize::new(n)
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("block size must be between 1 and 4096 tokens, got {0}")]
pub struct BlockSizeError(pub u32);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a block key is 16 lowercase hex characters, got {0:?}")]
pub struct ParseKeyError(pub String);

impl FromStr for BlockKey {
    type Err = ParseKeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = s.len() == 16 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !ok {
            return Err(ParseKeyError(s.chars().take(40).collect()));
        }
        u64::from_str_radix(s, 16).map(BlockKey).map_err(|_| ParseKeyError(s.to_owned()))
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({:016x})", self.0)
    }
}

impl Serialize for BlockKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut buf = [0u8; 16];
        hex::encode_to_slice(self.0.to_be_bytes(), &mut buf).map_err(serde::ser::Error::custom)?;
        // hex output is always ASCII.
        s.serialize_str(std::str::from_utf8(&buf).map_err(serde::ser::Error::custom)?)
    }
}

impl<'de> Deserialize<'de> for BlockKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = BlockKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a 16-character lowercase hex block key")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<BlockKey, E> {
                s.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hex_round_trip_and_rejects_bad_input() {
        let k = BlockKey(0x9e37_79b9_7f4a_7c15);
        assert_eq!(k.to_hex(), "9e3779b97f4a7c15");
        assert_eq!("9e3779b97f4a7c15".parse::<BlockKey>(), Ok(k));
        assert!("9E3779B97F4A7C15".parse::<BlockKey>().is_err());
        assert!("9e3779b97f4a7c1".parse::<BlockKey>().is_err());
        assert!("+e3779b97f4a7c15".parse::<BlockKey>().is_err());
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json, "\"9e3779b97f4a7c15\"");
        assert_eq!(serde_json::from_str::<BlockKey>(&json).unwrap(), k);
    }

    #[test]
    fn only_full_blocks_get_keys() {
        let root = KeyRoot::new("m", None);
        let bs = BlockSize::new(4).unwrap();
        assert_eq!(block_keys(root, &[1, 2, 3], bs).len(), 0);
        assert_eq!(block_keys(root, &[1, 2, 3, 4, 5, 6, 7], bs).len(), 1);
        assert_eq!(block_keys(root, &[1; 8], bs).len(), 2);
    }

    #[test]
    fn salt_and_model_separate_roots() {
        assert_ne!(KeyRoot::new("m", None), KeyRoot::new("m", Some("s")));
        assert_ne!(KeyRoot::new("m", None), KeyRoot::new("lora", None));
        // An empty salt is the same as no salt (DESIGN §1: empty if none).
        assert_eq!(KeyRoot::new("m", None), KeyRoot::new("m", Some("")));
    }

    #[test]
    fn block_size_bounds() {
        assert!(BlockSize::new(0).is_err());
        assert!(BlockSize::new(16).is_ok());
        assert!(serde_json::from_str::<BlockSize>("0").is_err());
    }

    proptest! {
        #[test]
        fn chain_is_prefix_closed(tokens in proptest::collection::vec(any::<u32>(), 0..200),
                                  cut in 0usize..200, bs in 1u32..40) {
            let bs = BlockSize::new(bs).unwrap();
            let root = KeyRoot::new("model", None);
            let all = block_keys(root, &tokens, bs);
            let cut = cut.min(tokens.len());
            let prefix = block_keys(root, &tokens[..cut], bs);
            prop_assert_eq!(&all[..prefix.len()], &prefix[..]);
        }

        #[test]
        fn fast_and_slow_paths_agree(tokens in proptest::collection::vec(any::<u32>(), 0..64), p in any::<u64>()) {
            prop_assert_eq!(BlockKey::chain(BlockKey(p), &tokens), BlockKey::chain_slow(BlockKey(p), &tokens));
        }
    }
}
