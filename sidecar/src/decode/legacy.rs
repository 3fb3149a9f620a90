//! The legacy event encoding: positional arrays, tag first, with trailing
//! default fields dropped (msgspec `array_like` + `omit_defaults`, vLLM before
//! mid-2026, e.g. 0.11):
//!
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name, extra_keys, …]`
//! - `["BlockRemoved", block_hashes, medium, …]`
//! - `["AllBlocksCleared"]`
//!
//! Positions past the ones known here are newer fields: counted and ignored.

use rmpv::ValueRef;

use super::{BlockRemoved, BlockStored, DecodeError, KvEvent, value};

const NIL: ValueRef<'static> = ValueRef::Nil;

pub(super) fn decode_event(items: &[ValueRef<'_>], unknown: &mut u32) -> Result<KvEvent, DecodeError> {
    let Some(ValueRef::String(tag)) = items.first() else {
        return Err(DecodeError::Shape("a positional event has no string tag"));
    };
    let at = |i: usize| items.get(i).unwrap_or(&NIL);
    match tag.as_str() {
        Some("BlockStored") => {
            if items.len() < 5 {
                return Err(DecodeError::Shape("BlockStored has fewer than 4 fields"));
            }
            *unknown += items.len().saturating_sub(9) as u32;
            Ok(KvEvent::BlockStored(BlockStored {
                block_hashes: value::hashes(at(1))?,
                parent_block_hash: value::opt_hash(at(2))?,
                token_ids: value::tokens(at(3))?,
                block_size: value::block_size(at(4))?,
                lora_id: value::opt_i64(at(5))?,
                medium: value::medium(at(6))?,
                lora_name: value::opt_string(at(7), "lora_name is not a string")?,
                extra_keys: value::extra_keys(at(8))?,
                group_idx: None,
                remote: false,
            }))
        }
        Some("BlockRemoved") => {
            if items.len() < 2 {
                return Err(DecodeError::Shape("BlockRemoved has no block_hashes"));
            }
            *unknown += items.len().saturating_sub(3) as u32;
            Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: value::hashes(at(1))?,
                medium: value::medium(at(2))?,
                group_idx: None,
                remote: false,
            }))
        }
        Some("AllBlocksCleared") => Ok(KvEvent::AllBlocksCleared),
        _ => Ok(KvEvent::Unknown),
    }
}
