//! The current event encoding: msgpack maps tagged by `"type"` (vLLM ≥ mid-2026,
//! e.g. 0.32, 0.33). Fields may come in any order; unknown ones are counted and
//! ignored. vLLM 0.32's `BlockStored` has 14 fields and `BlockRemoved` 5: every
//! one of them is known here, so the unknown-fields counter stays at 0 on a
//! current engine and rises only when vLLM adds a field.

use rmpv::ValueRef;

use super::{BlockRemoved, BlockStored, DecodeError, KvEvent, value};

pub(super) fn decode_event(fields: &[(ValueRef<'_>, ValueRef<'_>)], unknown: &mut u32) -> Result<KvEvent, DecodeError> {
    let tag = fields.iter().find_map(|(k, v)| (key(k) == Some("type")).then_some(v));
    let Some(ValueRef::String(tag)) = tag else {
        return Err(DecodeError::Shape("a map event has no string \"type\""));
    };
    match tag.as_str() {
        Some("BlockStored") => stored(fields, unknown).map(KvEvent::BlockStored),
        Some("BlockRemoved") => removed(fields, unknown).map(KvEvent::BlockRemoved),
        Some("AllBlocksCleared") => Ok(KvEvent::AllBlocksCleared),
        _ => Ok(KvEvent::Unknown),
    }
}

fn key<'a>(k: &'a ValueRef<'_>) -> Option<&'a str> {
    match k {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn stored(fields: &[(ValueRef<'_>, ValueRef<'_>)], unknown: &mut u32) -> Result<BlockStored, DecodeError> {
    let mut ev = BlockStored {
        block_hashes: Vec::new(),
        parent_block_hash: None,
        token_ids: Vec::new(),
        block_size: 0,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        remote: false,
    };
    let (mut have_hashes, mut have_tokens, mut have_size) = (false, false, false);
    for (k, v) in fields {
        match key(k) {
            Some("type") => {}
            Some("block_hashes") => {
                ev.block_hashes = value::hashes(v)?;
                have_hashes = true;
            }
            Some("parent_block_hash") => ev.parent_block_hash = value::opt_hash(v)?,
            Some("token_ids") => {
                ev.token_ids = value::tokens(v)?;
                have_tokens = true;
            }
            Some("block_size") => {
                ev.block_size = value::block_size(v)?;
                have_size = true;
            }
            Some("lora_id") => ev.lora_id = value::opt_i64(v)?,
            Some("medium") => ev.medium = value::medium(v)?,
            Some("lora_name") => ev.lora_name = value::opt_string(v, "lora_name is not a string")?,
            Some("extra_keys") => ev.extra_keys = value::extra_keys(v)?,
            Some("group_idx") => ev.group_idx = value::opt_u32(v, "group_idx is not a u32")?,
            Some("locality") => ev.remote = value::is_remote(v)?,
            // Known, and irrelevant to routing: the group's attention kind and
            // window (group 0 is the one routed on), and who triggered the store.
            Some("kv_cache_spec_kind" | "kv_cache_spec_sliding_window" | "ownership" | "session_id") => {}
            _ => *unknown += 1,
        }
    }
    if !(have_hashes && have_tokens && have_size) {
        return Err(DecodeError::Shape("BlockStored lacks block_hashes, token_ids or block_size"));
    }
    Ok(ev)
}

fn removed(fields: &[(ValueRef<'_>, ValueRef<'_>)], unknown: &mut u32) -> Result<BlockRemoved, DecodeError> {
    let mut ev = BlockRemoved { block_hashes: Vec::new(), medium: None, group_idx: None, remote: false };
    let mut have_hashes = false;
    for (k, v) in fields {
        match key(k) {
            Some("type") => {}
            Some("block_hashes") => {
                ev.block_hashes = value::hashes(v)?;
                have_hashes = true;
            }
            Some("medium") => ev.medium = value::medium(v)?,
            Some("group_idx") => ev.group_idx = value::opt_u32(v, "group_idx is not a u32")?,
            Some("locality") => ev.remote = value::is_remote(v)?,
            Some("ownership") => {}
            _ => *unknown += 1,
        }
    }
    if !have_hashes {
        return Err(DecodeError::Shape("BlockRemoved lacks block_hashes"));
    }
    Ok(ev)
}
