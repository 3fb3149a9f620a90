//! Engine block hashes, computed the way vLLM v1 chains them — and
//! deliberately *not* kvroute's router keys, so the sidecar's translation from
//! engine hashes to router keys is exercised for real.
//!
//! `hash[i] = SHA-256(parent bytes ‖ tokens of block i as u32 LE ‖ extra keys)`;
//! in int mode (vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) the hash
//! is the digest's last 8 bytes as a big-endian u64, otherwise the full digest.
//! The first block's parent is a fixed seed, standing in for vLLM's `NONE_HASH`.

use sha2::{Digest, Sha256};

use crate::events::{BlockHash, ExtraKey};

const NONE_HASH_SEED: &[u8] = b"kvroute-sim/none-hash";

/// Whether hashes are published as u64 or as raw 32-byte digests.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HashMode {
    Int,
    Bytes32,
}

/// What, besides tokens, makes a block's hash unique (vLLM's `extra_keys`):
/// the LoRA adapter on every block, the cache salt on the first block only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtras {
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
}

impl BlockExtras {
    /// Block `i`'s extra keys in vLLM's order (LoRA name, then the salt).
    pub fn keys_for(&self, i: usize) -> Option<Vec<ExtraKey>> {
        let mut keys = Vec::new();
        if let Some(l) = &self.lora_name {
            keys.push(ExtraKey::Str(l.clone()));
        }
        if i == 0
            && let Some(s) = &self.cache_salt
        {
            keys.push(ExtraKey::Str(s.clone()));
        }
        (!keys.is_empty()).then_some(keys)
    }
}

/// Hashes of the full blocks of `tokens` (only full blocks are ever cached).
pub fn prompt_hashes(tokens: &[u32], block_size: usize, extras: &BlockExtras, mode: HashMode) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    extend_hashes(&mut out, tokens, block_size, extras, mode);
    out
}

/// Appends the hashes of the blocks of `tokens` that became full since
/// `hashes` was last extended, as vLLM's request block hasher does each time
/// a generated token is appended: generated blocks are hashed (and cached)
/// like prompt blocks.
pub fn extend_hashes(
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    extras: &BlockExtras,
    mode: HashMode,
) {
    let full = tokens.len() / block_size;
    for i in hashes.len()..full {
        let block = &tokens[i * block_size..(i + 1) * block_size];
        let h = chain(hashes.last(), block, extras.keys_for(i).as_deref(), mode);
        hashes.push(h);
    }
}

fn chain(parent: Option<&BlockHash>, tokens: &[u32], extra: Option<&[ExtraKey]>, mode: HashMode) -> BlockHash {
    let mut h = Sha256::new();
    match parent {
        None => h.update(NONE_HASH_SEED),
        Some(BlockHash::Int(v)) => h.update(v.to_be_bytes()),
        Some(BlockHash::Bytes(b)) => h.update(b),
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    if let Some(keys) = extra {
        for ExtraKey::Str(s) in keys {
            // Length-prefixed so ("ab","c") and ("a","bc") differ.
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    }
    let digest: [u8; 32] = h.finalize().into();
    match mode {
        HashMode::Bytes32 => BlockHash::Bytes(digest),
        HashMode::Int => {
            let mut last = [0u8; 8];
            last.copy_from_slice(&digest[24..]);
            BlockHash::Int(u64::from_be_bytes(last))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_deterministic_and_salted() {
        let toks: Vec<u32> = (0..40).collect();
        let plain = prompt_hashes(&toks, 16, &BlockExtras::default(), HashMode::Int);
        assert_eq!(plain.len(), 2);
        assert_eq!(plain, prompt_hashes(&toks, 16, &BlockExtras::default(), HashMode::Int));
        let salted = BlockExtras { cache_salt: Some("s".into()), ..Default::default() };
        let s = prompt_hashes(&toks, 16, &salted, HashMode::Int);
        assert_ne!(s[0], plain[0]);
        assert_ne!(s[1], plain[1], "the salt reaches later blocks through the chain");
        let lora = BlockExtras { lora_name: Some("a".into()), ..Default::default() };
        assert_ne!(prompt_hashes(&toks, 16, &lora, HashMode::Int)[0], plain[0]);
        let bytes = prompt_hashes(&toks, 16, &BlockExtras::default(), HashMode::Bytes32);
        assert!(matches!(bytes[0], BlockHash::Bytes(_)));
        assert_eq!(salted.keys_for(1), None);
        assert_eq!(lora.keys_for(1), Some(vec![ExtraKey::Str("a".into())]));
    }

    #[test]
    fn extending_token_by_token_equals_hashing_at_once() {
        let toks: Vec<u32> = (0..53).collect();
        let salted = BlockExtras { cache_salt: Some("s".into()), ..Default::default() };
        let mut grown = Vec::new();
        for n in 0..=toks.len() {
            extend_hashes(&mut grown, &toks[..n], 16, &salted, HashMode::Int);
            assert_eq!(grown.len(), n / 16);
        }
        assert_eq!(grown, prompt_hashes(&toks, 16, &salted, HashMode::Int));
    }
}
