//! Decoding vLLM's KV-cache event messages (DESIGN.md §5) into [`EventBatch`]es.
//!
//! vLLM publishes one ZMQ message per batch: frames `[topic, seq (8 bytes BE), payload]`,
//! payload = msgpack `[ts, events, data_parallel_rank]` (very old: `[ts, events]`).
//! Events come in two encodings, both handled here: maps tagged by `"type"`
//! ([`current`], vLLM ≥ mid-2026) and positional arrays with trailing defaults
//! dropped ([`legacy`], older vLLM). Unknown fields are ignored; unknown event
//! types decode to [`KvEvent::Unknown`] so the caller can count them.
//!
//! Used by the subscriber (live batches), the replay client and the golden tests.

mod current;
mod legacy;
mod value;

use rmpv::ValueRef;

/// An engine's own block hash as vLLM publishes it: a 64-bit integer (the
/// default), or raw digest bytes when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum EngineHash {
    /// A u64 hash (i64 values from older engines are kept bit for bit).
    Int(u64),
    /// A raw digest (32 bytes for sha256, 16 for xxhash128).
    Bytes(Box<[u8]>),
}

impl EngineHash {
    /// A 64-bit id for the engine hash, used as the translation table's key.
    ///
    /// For digests this is the *last* 8 bytes big-endian: exactly what vLLM's
    /// `maybe_convert_block_hash` publishes in integer mode, so the same block has
    /// the same id whichever mode the engine (or the snapshot hook) uses.
    pub fn id(&self) -> u64 {
        match self {
            EngineHash::Int(n) => *n,
            EngineHash::Bytes(b) => {
                let mut buf = [0u8; 8];
                let tail = &b[b.len().saturating_sub(8)..];
                buf[8 - tail.len()..].copy_from_slice(tail);
                u64::from_be_bytes(buf)
            }
        }
    }
}

/// Which storage tier an event concerns. Only [`Medium::Gpu`] is the prefix
/// cache that routing cares about; offload tiers are counted and ignored.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Medium {
    Gpu,
    Cpu,
    Other(Box<str>),
}

impl Medium {
    fn parse(s: &str) -> Medium {
        match s {
            "GPU" => Medium::Gpu,
            "CPU" => Medium::Cpu,
            other => Medium::Other(other.into()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Other(s) => s,
        }
    }
}

/// One untagged entry of a block's `extra_keys` (DESIGN.md §5).
#[derive(Clone, PartialEq, Debug)]
pub enum ExtraKey {
    /// A LoRA name or a cache salt (which one depends on position).
    Text(Box<str>),
    /// A `(mm_identifier, offset)` pair or any other tuple: multimodal input.
    Tuple,
    /// Raw bytes: a prompt-embedding digest.
    Bytes,
    /// Anything else (integers, maps): unknown to this sidecar.
    Other,
}

/// A block became full and cached (possibly several chained blocks at once).
#[derive(Clone, PartialEq, Debug)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    /// `block_hashes.len() * block_size` token ids, block after block.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    /// `None` when the engine predates the field; it then means GPU.
    pub medium: Option<Medium>,
    pub lora_name: Option<String>,
    /// One entry per block when present (`None` for a block without extras).
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// The KV-cache group (vLLM ≥ 0.32; `None` before). Hybrid models publish
    /// one event per group with the same hashes; only group 0 is routed on.
    pub group_idx: Option<u32>,
    /// `locality: "REMOTE"`: a block held by another tier, not this engine.
    pub remote: bool,
}

/// Blocks evicted from a tier.
#[derive(Clone, PartialEq, Debug)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    pub medium: Option<Medium>,
    pub group_idx: Option<u32>,
    pub remote: bool,
}

/// One KV-cache event.
#[derive(Clone, PartialEq, Debug)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event type this sidecar does not know (a newer vLLM): ignored, counted.
    Unknown,
}

/// How the events of a batch were encoded (which vLLM generation sent them).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Encoding {
    /// Maps tagged with `"type"`.
    Map,
    /// Positional arrays, tag first.
    Positional,
}

/// One decoded payload.
#[derive(Clone, PartialEq, Debug)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u32>,
    /// `None` for a batch without events.
    pub encoding: Option<Encoding>,
    /// Fields of known events that this sidecar does not know (ignored).
    pub unknown_fields: u32,
}

/// A batch's sequence number: from 0, reset when the engine restarts.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Seq(pub u64);

/// Why a message or payload could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("message has {0} frames, expected [topic, seq, payload]")]
    Frames(usize),
    #[error("sequence frame has {0} bytes, expected 8")]
    SeqFrame(usize),
    #[error("payload is not msgpack")]
    Msgpack(#[source] rmpv::decode::Error),
    #[error("{0}")]
    Shape(&'static str),
}

/// Decodes a published message `[topic, seq, payload]`.
pub fn decode_message(frames: &[impl AsRef<[u8]>]) -> Result<(Seq, EventBatch), DecodeError> {
    let [_topic, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    Ok((parse_seq(seq.as_ref())?, decode_payload(payload.as_ref())?))
}

/// Parses an 8-byte big-endian sequence frame (replay's end marker is -1, i.e.
/// `u64::MAX`).
pub fn parse_seq(frame: &[u8]) -> Result<Seq, DecodeError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| DecodeError::SeqFrame(frame.len()))?;
    Ok(Seq(u64::from_be_bytes(bytes)))
}

/// Decodes a msgpack payload `[ts, events, data_parallel_rank?]`.
pub fn decode_payload(mut payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let root = rmpv::decode::read_value_ref(&mut payload).map_err(DecodeError::Msgpack)?;
    let ValueRef::Array(items) = root else {
        return Err(DecodeError::Shape("payload is not an array"));
    };
    let ts = items.first().and_then(value::as_f64).ok_or(DecodeError::Shape("payload[0] (ts) is not a number"))?;
    let Some(ValueRef::Array(raw_events)) = items.get(1) else {
        return Err(DecodeError::Shape("payload[1] (events) is not an array"));
    };
    let data_parallel_rank = match items.get(2) {
        None | Some(ValueRef::Nil) => None,
        Some(v) => Some(value::as_u32(v).ok_or(DecodeError::Shape("payload[2] (data_parallel_rank) is not a u32"))?),
    };
    let mut batch = EventBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        data_parallel_rank,
        encoding: None,
        unknown_fields: 0,
    };
    for raw in raw_events {
        let (event, encoding) = match raw {
            ValueRef::Map(fields) => (current::decode_event(fields, &mut batch.unknown_fields)?, Encoding::Map),
            ValueRef::Array(fields) => (legacy::decode_event(fields, &mut batch.unknown_fields)?, Encoding::Positional),
            _ => return Err(DecodeError::Shape("an event is neither a map nor an array")),
        };
        batch.encoding.get_or_insert(encoding);
        batch.events.push(event);
    }
    Ok(batch)
}
