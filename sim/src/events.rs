//! vLLM's KV-cache events as the simulated engine produces them, and how they
//! leave the process: [`encode`] writes vLLM's exact msgpack bytes (current map
//! encoding or the legacy positional one), [`publisher`] sends one ZMQ PUB
//! message per engine step, [`replay`] answers vLLM's replay protocol.
//!
//! The sidecar decodes these bytes; golden tests pin them to captures of real
//! vLLM 0.33.0 and 0.11.0.

pub mod encode;
pub mod publisher;
pub mod replay;

/// An engine block hash as vLLM publishes it: a u64 by default
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), or the raw digest bytes.
///
/// These are the *engine's* hashes; kvroute's router keys are computed
/// separately from token ids and never equal them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum BlockHash {
    Int(u64),
    Bytes([u8; 32]),
}

/// Which tier a block lives in; the simulator only has GPU HBM, `Cpu` exists so
/// offload-tier events can be encoded (and golden-tested).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Medium {
    Gpu,
    Cpu,
}

impl Medium {
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

/// One item of a block's `extra_keys` tuple (vLLM: LoRA name, then multimodal
/// `(identifier, offset)` pairs, then the cache salt on the first block).
/// The simulator only produces strings.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ExtraKey {
    Str(String),
}

/// One KV-cache event, with vLLM's field names and order.
#[derive(Clone, PartialEq, Debug)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u32>,
        medium: Medium,
        /// Current format only (vLLM 0.11 has no such field).
        lora_name: Option<String>,
        /// Current format only: one entry per block (`None` = no extra keys);
        /// the field is left out entirely when no block has extra keys.
        extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        medium: Medium,
    },
    AllBlocksCleared,
}

/// What one engine step published: vLLM's `KVEventBatch`.
#[derive(Clone, PartialEq, Debug)]
pub struct EventBatch {
    /// Seconds since the Unix epoch, as a float (Python's `time.time()`).
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: u32,
}

/// The two encodings vLLM has used on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventFormat {
    /// vLLM ≥ mid-2026 (0.33): events are maps keyed by field name.
    #[default]
    Current,
    /// vLLM 0.11: events are positional arrays.
    Legacy,
}

/// zeromq-rs cannot bind the `tcp://*:PORT` form vLLM configs use; it means
/// every interface.
/// `endpoint` for data-parallel rank `rank`: port + rank, as vLLM's
/// `offset_endpoint_port`; port 0 stays 0 (each rank binds a free port).
pub fn rank_endpoint(endpoint: &str, rank: u32) -> String {
    let Some((base, port)) = endpoint.rsplit_once(':') else { return endpoint.to_owned() };
    match port.parse::<u32>() {
        Ok(p) if p != 0 && rank != 0 => format!("{base}:{}", p + rank),
        _ => endpoint.to_owned(),
    }
}

pub fn bindable_endpoint(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_owned(),
    }
}
