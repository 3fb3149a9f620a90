//! Byte-exact msgpack encoding of [`EventBatch`]es, as vLLM's
//! `ZmqEventPublisher` (msgspec) writes them.
//!
//! What the captures in `testdata/vllm-events/` pin down, and why each matters to
//! a decoder that compares bytes:
//! - the payload is `[ts, events, data_parallel_rank]`, `ts` always a float64;
//! - unsigned integers take the smallest msgpack form (`50256` is `cd c4 50`),
//!   so hashes ≥ 2^63 are `uint64`, never negative;
//! - byte hashes are `bin`, strings are `str` (str8 from 32 bytes);
//! - current format: `BlockStored` is a map with a **map16** header even for 8
//!   entries (msgspec reserves it for structs with omittable defaulted fields),
//!   while `BlockRemoved`/`AllBlocksCleared` use fixmaps; absent optional values
//!   are `nil`, except `extra_keys`, which is left out when it would be `None`;
//! - legacy format (vLLM 0.11): positional arrays tagged by the class name,
//!   trailing default (`None`) fields dropped.

use std::convert::Infallible;

use rmp::encode::{self as mp, ByteBuf, ValueWriteError};

use super::{BlockHash, EventBatch, EventFormat, ExtraKey, KvEvent};

#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("{what} has {len} entries, more than msgpack can frame")]
    TooLong { what: &'static str, len: usize },
}

/// Encodes one batch: the third ZMQ frame of a published message.
pub fn encode_batch(batch: &EventBatch, format: EventFormat) -> Result<Vec<u8>, EncodeError> {
    let mut w = ByteBuf::with_capacity(64 + 32 * batch.events.len());
    array_len(&mut w, 3, "batch")?;
    ok(mp::write_f64(&mut w, batch.ts));
    array_len(&mut w, batch.events.len(), "events")?;
    for event in &batch.events {
        match format {
            EventFormat::Current => current_event(&mut w, event)?,
            EventFormat::Legacy => legacy_event(&mut w, event)?,
        }
    }
    uint(&mut w, u64::from(batch.data_parallel_rank));
    Ok(w.into_vec())
}

fn current_event(w: &mut ByteBuf, event: &KvEvent) -> Result<(), EncodeError> {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
        } => {
            let entries: u16 = if extra_keys.is_some() { 9 } else { 8 };
            // map16 marker + big-endian count, as the capture shows.
            w.as_mut_vec().push(0xde);
            w.as_mut_vec().extend_from_slice(&entries.to_be_bytes());
            str(w, "type");
            str(w, "BlockStored");
            str(w, "block_hashes");
            hashes(w, block_hashes)?;
            str(w, "parent_block_hash");
            opt_hash(w, parent_block_hash.as_ref());
            str(w, "token_ids");
            tokens(w, token_ids)?;
            str(w, "block_size");
            uint(w, u64::from(*block_size));
            str(w, "lora_id");
            opt_uint(w, lora_id.map(u64::from));
            str(w, "medium");
            str(w, medium.as_str());
            str(w, "lora_name");
            opt_str(w, lora_name.as_deref());
            if let Some(keys) = extra_keys {
                str(w, "extra_keys");
                extra(w, keys)?;
            }
        }
        KvEvent::BlockRemoved { block_hashes, medium } => {
            ok(mp::write_map_len(w, 3));
            str(w, "type");
            str(w, "BlockRemoved");
            str(w, "block_hashes");
            hashes(w, block_hashes)?;
            str(w, "medium");
            str(w, medium.as_str());
        }
        KvEvent::AllBlocksCleared => {
            ok(mp::write_map_len(w, 1));
            str(w, "type");
            str(w, "AllBlocksCleared");
        }
    }
    Ok(())
}

fn legacy_event(w: &mut ByteBuf, event: &KvEvent) -> Result<(), EncodeError> {
    match event {
        // vLLM 0.11.0 ends at `medium`; later positional versions append
        // `lora_name` and `extra_keys`, dropping them while they are defaults
        // (None). Without them an adapter shows only as `lora_id`.
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
        } => {
            let len = match (lora_name, extra_keys) {
                (_, Some(_)) => 9,
                (Some(_), None) => 8,
                (None, None) => 7,
            };
            ok(mp::write_array_len(w, len));
            str(w, "BlockStored");
            hashes(w, block_hashes)?;
            opt_hash(w, parent_block_hash.as_ref());
            tokens(w, token_ids)?;
            uint(w, u64::from(*block_size));
            opt_uint(w, lora_id.map(u64::from));
            str(w, medium.as_str());
            if len >= 8 {
                opt_str(w, lora_name.as_deref());
            }
            if let Some(keys) = extra_keys {
                extra(w, keys)?;
            }
        }
        KvEvent::BlockRemoved { block_hashes, medium } => {
            ok(mp::write_array_len(w, 3));
            str(w, "BlockRemoved");
            hashes(w, block_hashes)?;
            str(w, medium.as_str());
        }
        KvEvent::AllBlocksCleared => {
            ok(mp::write_array_len(w, 1));
            str(w, "AllBlocksCleared");
        }
    }
    Ok(())
}

fn extra(w: &mut ByteBuf, per_block: &[Option<Vec<ExtraKey>>]) -> Result<(), EncodeError> {
    array_len(w, per_block.len(), "extra_keys")?;
    for keys in per_block {
        match keys {
            None => ok_nil(mp::write_nil(w)),
            Some(keys) => {
                array_len(w, keys.len(), "extra_keys[i]")?;
                for ExtraKey::Str(s) in keys {
                    str(w, s);
                }
            }
        }
    }
    Ok(())
}

fn hashes(w: &mut ByteBuf, hashes: &[BlockHash]) -> Result<(), EncodeError> {
    array_len(w, hashes.len(), "block_hashes")?;
    for h in hashes {
        hash(w, h);
    }
    Ok(())
}

fn hash(w: &mut ByteBuf, h: &BlockHash) {
    match h {
        BlockHash::Int(v) => uint(w, *v),
        BlockHash::Bytes(b) => ok(mp::write_bin(w, b)),
    }
}

fn opt_hash(w: &mut ByteBuf, h: Option<&BlockHash>) {
    match h {
        Some(h) => hash(w, h),
        None => ok_nil(mp::write_nil(w)),
    }
}

fn tokens(w: &mut ByteBuf, ids: &[u32]) -> Result<(), EncodeError> {
    array_len(w, ids.len(), "token_ids")?;
    for &t in ids {
        uint(w, u64::from(t));
    }
    Ok(())
}

fn uint(w: &mut ByteBuf, v: u64) {
    ok(mp::write_uint(w, v));
}

fn opt_uint(w: &mut ByteBuf, v: Option<u64>) {
    match v {
        Some(v) => uint(w, v),
        None => ok_nil(mp::write_nil(w)),
    }
}

fn str(w: &mut ByteBuf, s: &str) {
    ok(mp::write_str(w, s));
}

fn opt_str(w: &mut ByteBuf, s: Option<&str>) {
    match s {
        Some(s) => str(w, s),
        None => ok_nil(mp::write_nil(w)),
    }
}

fn array_len(w: &mut ByteBuf, len: usize, what: &'static str) -> Result<(), EncodeError> {
    let n = u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })?;
    ok(mp::write_array_len(w, n));
    Ok(())
}

/// Writing into a `ByteBuf` cannot fail (its error type is `Infallible`); this
/// proves it to the compiler instead of unwrapping.
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => match e {},
    }
}

fn ok_nil(r: Result<(), Infallible>) {
    match r {
        Ok(()) => {}
        Err(e) => match e {},
    }
}
