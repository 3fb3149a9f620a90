//! The router ⇄ sidecar wire protocol (DESIGN.md §2), and the OpenAI-shaped
//! error body both binaries answer with.
//!
//! Every body is JSON; block keys travel as 16-character hex strings. Decoding
//! goes through [`decode`], which names the offending field on failure so a
//! 400 tells the sender exactly what to fix.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::digest::KeyDigest;
use crate::ids::{ModelName, WorkerId};
use crate::keys::{BlockKey, BlockSize};

/// Path of the fast-path endpoint (evictions and stores, every 100 ms).
pub const EVICTION_PATH: &str = "/internal/eviction";

/// The wire protocol's major version. A sidecar names it in the
/// [`PROTOCOL_HEADER`] of every push; a router refuses a major it does not
/// speak, and answers with its own in [`InternalAck::protocol`]. A header, not
/// a body field: routers of the previous release reject unknown body fields
/// but ignore unknown headers, so sidecars and routers can be upgraded in
/// either order. A push without the header is version 1.
///
/// Version 2 only adds optional fields ([`EvictionBatch::digest`],
/// [`SyncSnapshot::digest`], [`SyncSnapshot::covers`], [`InternalAck::resync`],
/// [`InternalAck::clock`]): a v1 body is a valid v2 body, so a v2 router
/// accepts v1 sidecars ([`OLDEST_PROTOCOL`]), and a v2 sidecar that a v1
/// router refuses falls back to v1 bodies on that link.
pub const PROTOCOL_VERSION: u32 = 2;
/// The oldest major a router of this release still accepts (one release of
/// overlap).
pub const OLDEST_PROTOCOL: u32 = 1;
pub const PROTOCOL_HEADER: &str = "x-kvroute-protocol";
/// Path of the slow-path endpoint (full snapshot, every 5 s).
pub const SYNC_PATH: &str = "/internal/sync";

/// Longest worker id accepted; ids become metric labels and log fields.
pub const MAX_WORKER_ID_LEN: usize = 128;
/// Data-parallel ranks per engine a sidecar follows, and the bound on a
/// pushed `dp_rank`.
pub const MAX_DP_RANKS: u32 = 1024;
/// A bearer token (the internal, admin and per-worker ones) must be long
/// and not trivially guessable: routers refuse to start with one that is
/// not, and sidecars too, rather than meet 401s at run time.
pub fn check_token(t: &str) -> Result<(), String> {
    if t.len() < 16 {
        return Err("must be at least 16 characters".into());
    }
    let first = t.chars().next().unwrap_or(' ');
    if t.chars().any(|c| c.is_whitespace() || c.is_control()) || t.chars().all(|c| c == first) {
        return Err("must have no whitespace and not be one repeated character".into());
    }
    Ok(())
}

/// The longest base URL a worker, router or replica may have. Every request
/// routed to a worker formats its URL and the HTTP client parses it again,
/// and a sync's URL is parsed under the index's write lock: a sidecar sent
/// one as long as its 128 MiB body.
pub const MAX_URL_LEN: usize = 2048;

/// A worker's, a router's or a replica's base URL, checked and normalised
/// (no trailing `/`): `http(s)`, a host, no credentials, query or fragment.
/// The error says why.
pub fn check_http_url(url: &str) -> Result<String, String> {
    if url.len() > MAX_URL_LEN {
        return Err(format!("longer than {MAX_URL_LEN} bytes"));
    }
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("the scheme must be http or https".into());
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("no host".into());
    }
    if !parsed.username().is_empty()
        || parsed.password().is_some()
        || parsed.query().is_some()
        || parsed.fragment().is_some()
    {
        return Err("credentials, queries and fragments are not allowed".into());
    }
    // The OpenAI base URL a client is given ends in `/v1`; these are the
    // server's own, to which `/v1/…`, `/health`, `/metrics` or `/internal/…`
    // are added: taken as it was, every probe was a 404 and the worker was
    // ejected with nothing but "answered 404" to say why.
    if parsed.path().trim_end_matches('/').rsplit('/').next() == Some("v1") {
        return Err("the server's base URL, without the OpenAI API's /v1 (which is added to it)".into());
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// Model names a sync may list (a base model and its LoRA adapters), and the
/// longest name: every routed request scans a worker's list, and
/// `/v1/models` returns every name to any client.
pub const MAX_MODELS: usize = 1024;
pub const MAX_MODEL_NAME_LEN: usize = 1024;
/// A model list a sync may carry: at most [`MAX_MODELS`] names of 1 to
/// [`MAX_MODEL_NAME_LEN`] bytes (the sidecar checks its engine's list with
/// it before sending one a router would refuse).
pub fn check_models(models: &[ModelName]) -> Result<(), DecodeError> {
    if models.len() > MAX_MODELS {
        return Err(DecodeError::new("models", format!("at most {MAX_MODELS} names, not {}", models.len())));
    }
    for (i, m) in models.iter().enumerate() {
        if m.as_str().is_empty() || m.as_str().len() > MAX_MODEL_NAME_LEN {
            return Err(DecodeError::new(format!("models[{i}]"), format!("must be 1 to {MAX_MODEL_NAME_LEN} bytes")));
        }
    }
    Ok(())
}

/// Served names that key as another (`--served-model-name a b`): alias →
/// the name the worker's sidecar keys its base model's blocks by. vLLM
/// caches one model's blocks whatever name a request gives it (only a LoRA
/// adapter's name is in its block hashes), so a request naming an alias is
/// keyed as the base: keyed under its own name it matched nothing.
pub type ModelAliases = BTreeMap<ModelName, ModelName>;

/// An alias map a sync may carry: every name in it is one of `models`, and
/// an alias's base is not itself an alias (nor the alias).
pub fn check_aliases(aliases: &ModelAliases, models: &[ModelName]) -> Result<(), DecodeError> {
    if aliases.is_empty() {
        return Ok(());
    }
    // Up to MAX_MODELS of each: a set, not a scan per alias.
    let models: std::collections::HashSet<&ModelName> = models.iter().collect();
    let listed = |m: &ModelName| models.contains(m);
    for (alias, base) in aliases {
        let field = || format!("model_aliases.{}", alias.as_str().chars().take(64).collect::<String>());
        if !listed(alias) || !listed(base) {
            return Err(DecodeError::new(field(), "an alias and its base must both be in `models`"));
        }
        if alias == base || aliases.contains_key(base) {
            return Err(DecodeError::new(field(), "an alias's base must be a name that is not an alias"));
        }
    }
    Ok(())
}

/// One entry of an engine's `/v1/models`: its name, and the base model a
/// LoRA adapter runs on (`parent`; `None` for a served name of the base).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedModel {
    pub name: ModelName,
    pub parent: Option<String>,
}

/// The aliases of `base` among `served`: the other names without a
/// `parent` (vLLM's `--served-model-name a b` lists `a` and `b` so, and a
/// LoRA adapter with its base as `parent`). None when `base` is an adapter.
pub fn model_aliases(served: &[ServedModel], base: &ModelName) -> ModelAliases {
    if !served.iter().any(|m| &m.name == base && m.parent.is_none()) {
        return ModelAliases::new();
    }
    let others = served.iter().filter(|m| m.parent.is_none() && &m.name != base);
    others.map(|m| (m.name.clone(), base.clone())).collect()
}

/// The most of an engine's `/v1/models` that is read: room for
/// [`MAX_MODELS`] entries of vLLM's shape, ids of up to
/// [`MAX_MODEL_NAME_LEN`] bytes.
pub const MAX_MODELS_BYTES: usize = 4 << 20;

/// The model names in an engine's `/v1/models` answer, base model first
/// (as vLLM lists them), if it is a list a router takes
/// ([`check_models`]).
pub fn parse_model_list(body: &[u8]) -> Result<Vec<ModelName>, DecodeError> {
    Ok(parse_served_models(body)?.into_iter().map(|m| m.name).collect())
}

/// [`parse_model_list`], with each entry's `parent`.
pub fn parse_served_models(body: &[u8]) -> Result<Vec<ServedModel>, DecodeError> {
    #[derive(Deserialize)]
    struct ModelList {
        data: Vec<ModelEntry>,
    }
    #[derive(Deserialize)]
    struct ModelEntry {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: ModelList = decode(body)?;
    let served: Vec<ServedModel> =
        list.data.into_iter().map(|m| ServedModel { name: ModelName::new(m.id), parent: m.parent }).collect();
    check_models(&served.iter().map(|m| m.name.clone()).collect::<Vec<_>>())?;
    Ok(served)
}

/// The request header vLLM's API server (internal load balancing) reads to
/// pin a request to one data-parallel rank.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Engine load as vLLM's metrics report it, carried on every push.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// `vllm:num_requests_running`
    #[serde(default)]
    pub running: u32,
    /// `vllm:num_requests_waiting`
    #[serde(default)]
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, 0.0 ..= 1.0
    #[serde(default)]
    pub kv_usage: f64,
}

/// `POST /internal/eviction`: what changed on one worker since the last batch.
///
/// `{"worker_id", "evicted_hashes"}` alone is valid (the paper's shape).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvictionBatch {
    pub worker_id: WorkerId,
    /// Changes when the sidecar or its engine restarts; `seq` restarts with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default)]
    pub evicted_hashes: Vec<BlockKey>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stored_hashes: Vec<BlockKey>,
    /// The engine dropped everything; applied before the two lists.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cleared: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Load>,
    /// v2: the digest of the worker's whole key set once this batch is
    /// applied. The router compares it with its own digest of the worker's
    /// confirmed entries and asks for a full sync ([`InternalAck::resync`])
    /// when they differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<KeyDigest>,
}

/// `POST /internal/sync`: one worker's complete key set, and its registration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncSnapshot {
    pub worker_id: WorkerId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// v1: when the snapshot was taken (ms since the Unix epoch, the
    /// sidecar's clock): speculative entries the router made after this are
    /// kept, their prefill may still be running. v2 sidecars send
    /// [`SyncSnapshot::covers`] instead, and routers ignore this when both
    /// are present (clocks are never compared across machines in v2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub as_of_ms: Option<u64>,
    /// v2: the router's [`InternalAck::clock`] from the last ack this
    /// sidecar had from it before reading the key set. The snapshot is
    /// causally after every speculative entry stamped at or before it;
    /// entries stamped later survive the sync (their prefill may still be
    /// running). `None` with no `as_of_ms`: every speculative entry survives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub covers: Option<u64>,
    /// v2: the digest of `hashes` (the router checks the sync arrived whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<KeyDigest>,
    /// Where routers send this worker's requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// This worker is data-parallel rank `dp_rank` behind `url`, which
    /// serves every rank (vLLM's internal load balancing): routers name the
    /// rank in `X-data-parallel-rank` on each request. `None`: `url` is the
    /// target itself (one engine, or a rank with its own API server under
    /// external load balancing). Sent only when set, so a sidecar without
    /// ranks speaks to routers that predate the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    #[serde(default)]
    pub models: Vec<ModelName>,
    /// Which of `models` key as another ([`ModelAliases`]). Sent only to a
    /// router whose ack says it takes them ([`InternalAck::model_aliases`]):
    /// routers before the field refuse unknown fields.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_aliases: ModelAliases,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<BlockSize>,
    pub hashes: Vec<BlockKey>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Load>,
}

/// The router's answer to every internal call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InternalAck {
    /// Changes when the router restarts: a sidecar that sees a new epoch sends a
    /// full sync at once.
    pub router_epoch: String,
    pub outcome: AckOutcome,
    /// The protocol version the router speaks (routers before versioning do
    /// not say: version 1).
    #[serde(default = "protocol_v1")]
    pub protocol: u32,
    /// v2: the router's digest of this worker differs from the push's (a
    /// push was lost or misapplied): send a full sync now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resync: bool,
    /// v2: the router's causal clock (it ticks whenever the router records a
    /// speculative entry); echoed as [`SyncSnapshot::covers`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<u64>,
    /// This router takes [`SyncSnapshot::model_aliases`] (routers before the
    /// field do not say, and refuse it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub model_aliases: bool,
}

fn protocol_v1() -> u32 {
    1
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AckOutcome {
    Applied,
    /// A reordered or duplicated batch (`seq` not newer within the epoch): ignored.
    Stale,
    /// The router does not know this worker yet: send a sync first.
    UnknownWorker,
}

/// OpenAI's error shape: `{"error": {"message", "type", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status, as vLLM and OpenAI put it.
    pub code: u16,
    /// The request field at fault, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
}

impl ErrorBody {
    pub fn new(code: u16, kind: &str, message: impl Into<String>) -> Self {
        ErrorBody { error: ErrorDetail { message: message.into(), kind: kind.to_owned(), code, param: None } }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.error.param = Some(param.into());
        self
    }
}

/// A body that could not be decoded, with the path of the field at fault
/// (`evicted_hashes[3]`, `load.kv_usage`; `.` for the body itself).
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct DecodeError {
    pub field: String,
    pub message: String,
}

impl DecodeError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        DecodeError { field: field.into(), message: message.into() }
    }
}

/// Decodes a JSON body, naming the field that failed. Anything but
/// whitespace after the value is refused (as vLLM and `serde_json::from_slice`
/// refuse it): `{"prompt": "a"} garbage` was routed and forwarded.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, DecodeError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = decode_from(de)?;
    de.end().map_err(|e| DecodeError::new(".", e.to_string()))?;
    Ok(value)
}

fn decode_from<T: DeserializeOwned>(
    de: &mut serde_json::Deserializer<serde_json::de::SliceRead<'_>>,
) -> Result<T, DecodeError> {
    serde_path_to_error::deserialize(de).map_err(|e| {
        // serde_path_to_error says "?" when no field was reached (a syntax error).
        let path = match e.path().to_string() {
            p if p == "?" => ".".to_owned(),
            p => p,
        };
        let inner = e.into_inner();
        // serde_json appends " at line 1 column 42": useful for syntax errors,
        // noise once the field is named.
        let mut message = inner.to_string();
        if path != "."
            && let Some(at) = message.rfind(" at line ")
        {
            message.truncate(at);
        }
        DecodeError::new(path, message)
    })
}

/// Checks that hold across fields and that serde cannot express.
pub trait Validate {
    fn validate(&self) -> Result<(), DecodeError>;
}

/// A worker id as every push and report must carry it: 1 to
/// [`MAX_WORKER_ID_LEN`] bytes of ASCII letters, digits and `- _ . :`.
pub fn validate_worker_id(id: &WorkerId) -> Result<(), DecodeError> {
    let s = id.as_str();
    if s.is_empty() || s.len() > MAX_WORKER_ID_LEN {
        return Err(DecodeError::new("worker_id", format!("must be 1 to {MAX_WORKER_ID_LEN} bytes")));
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':')) {
        return Err(DecodeError::new("worker_id", "may hold only ASCII letters, digits and - _ . :"));
    }
    if s == RESERVED_WORKER_ID {
        return Err(DecodeError::new("worker_id", format!("{RESERVED_WORKER_ID:?} is reserved (metrics: no worker)")));
    }
    Ok(())
}

/// The router's metrics label requests refused before a worker was chosen
/// with this worker id: no worker may take it.
pub const RESERVED_WORKER_ID: &str = "none";

fn validate_load(load: &Option<Load>) -> Result<(), DecodeError> {
    match load {
        Some(l) if !(0.0..=1.0).contains(&l.kv_usage) => {
            Err(DecodeError::new("load.kv_usage", "must be between 0.0 and 1.0"))
        }
        _ => Ok(()),
    }
}

fn validate_epoch(epoch: &Option<String>) -> Result<(), DecodeError> {
    match epoch {
        Some(e) if e.is_empty() || e.len() > 64 => Err(DecodeError::new("epoch", "must be 1 to 64 bytes")),
        _ => Ok(()),
    }
}

impl Validate for EvictionBatch {
    fn validate(&self) -> Result<(), DecodeError> {
        validate_worker_id(&self.worker_id)?;
        validate_epoch(&self.epoch)?;
        validate_load(&self.load)
    }
}

impl Validate for SyncSnapshot {
    fn validate(&self) -> Result<(), DecodeError> {
        validate_worker_id(&self.worker_id)?;
        validate_epoch(&self.epoch)?;
        validate_load(&self.load)?;
        if let Some(url) = &self.url
            && (!(url.starts_with("http://") || url.starts_with("https://")) || url.len() > MAX_URL_LEN)
        {
            return Err(DecodeError::new(
                "url",
                format!("must be an http:// or https:// URL of at most {MAX_URL_LEN} bytes"),
            ));
        }
        if self.dp_rank.is_some_and(|r| r >= MAX_DP_RANKS) {
            return Err(DecodeError::new("dp_rank", format!("must be below {MAX_DP_RANKS}")));
        }
        check_models(&self.models)?;
        check_aliases(&self.model_aliases, &self.models)
    }
}

/// Decodes and validates in one step.
pub fn decode_valid<T: DeserializeOwned + Validate>(body: &[u8]) -> Result<T, DecodeError> {
    let v: T = decode(body)?;
    v.validate()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn anything_after_the_value_is_refused() {
        let ok: Result<EvictionBatch, _> = decode(b"{\"worker_id\":\"w1\"} \n");
        assert!(ok.is_ok(), "trailing whitespace is fine");
        let e = decode::<EvictionBatch>(b"{\"worker_id\":\"w1\"} garbage").unwrap_err();
        assert_eq!(e.field, ".", "{e}");
        assert!(decode::<EvictionBatch>(b"{\"worker_id\":\"w1\"}{}").is_err());
    }

    #[test]
    fn papers_minimal_eviction_body_is_valid() {
        let b: EvictionBatch = decode_valid(br#"{"worker_id":"w1","evicted_hashes":["9e3779b97f4a7c15"]}"#).unwrap();
        assert_eq!(b.worker_id.as_str(), "w1");
        assert_eq!(b.evicted_hashes, vec![BlockKey(0x9e3779b97f4a7c15)]);
        assert!(!b.cleared && b.stored_hashes.is_empty() && b.seq.is_none());
    }

    #[test]
    fn full_eviction_body_round_trips() {
        let body = br#"{"worker_id":"w1","epoch":"b5e1","seq":42,
            "evicted_hashes":["9e3779b97f4a7c15"],"stored_hashes":["3c6ef372fe94f82a"],
            "cleared":false,"load":{"running":3,"waiting":0,"kv_usage":0.41}}"#;
        let b: EvictionBatch = decode_valid(body).unwrap();
        assert_eq!(b.seq, Some(42));
        assert_eq!(b.load.unwrap().running, 3);
        let again: EvictionBatch = decode_valid(serde_json::to_vec(&b).unwrap().as_slice()).unwrap();
        assert_eq!(again, b);
    }

    #[test]
    fn v2_fields_are_optional_and_absent_from_v1_bodies() {
        let v1 = br#"{"worker_id":"w1","epoch":"e","seq":3,"hashes":["0000000000000001"],"as_of_ms":5}"#;
        let s: SyncSnapshot = decode_valid(v1).unwrap();
        assert_eq!((s.covers, s.digest), (None, None));
        let v = serde_json::to_value(&s).unwrap();
        assert!(v.get("covers").is_none() && v.get("digest").is_none(), "{v}");
        let v2 = br#"{"worker_id":"w1","evicted_hashes":[],"digest":{"count":2,"sum":"00000000000000ff"}}"#;
        let b: EvictionBatch = decode_valid(v2).unwrap();
        assert_eq!(b.digest, Some(KeyDigest { count: 2, sum: 0xff }));
        // A v1 router's ack (no resync, no clock) decodes as "in sync".
        let ack: InternalAck = serde_json::from_str(r#"{"router_epoch":"r","outcome":"applied"}"#).unwrap();
        assert_eq!((ack.protocol, ack.resync, ack.clock), (1, false, None));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = decode_valid::<EvictionBatch>(br#"{"worker_id":"w1","evicted_hashes":["00","zz"]}"#).unwrap_err();
        assert_eq!(e.field, "evicted_hashes[0]");
        let e = decode_valid::<SyncSnapshot>(br#"{"worker_id":"w1"}"#).unwrap_err();
        assert!(e.message.contains("hashes"), "{e}");
        let e = decode_valid::<SyncSnapshot>(br#"{"worker_id":"w1","hashes":[],"block_size":0}"#).unwrap_err();
        assert_eq!(e.field, "block_size");
        let e = decode_valid::<SyncSnapshot>(br#"{"worker_id":"w 1","hashes":[]}"#).unwrap_err();
        assert_eq!(e.field, "worker_id");
        let e = decode_valid::<EvictionBatch>(br#"{"worker_id":"w","evicted_hashes":[],"load":{"kv_usage":7}}"#)
            .unwrap_err();
        assert_eq!(e.field, "load.kv_usage");
        let e = decode_valid::<EvictionBatch>(br#"{"worker_id":"w","evicted":[]}"#).unwrap_err();
        assert!(e.message.contains("unknown field"), "{e}");
        let e = decode_valid::<EvictionBatch>(b"{not json").unwrap_err();
        assert_eq!(e.field, ".");
    }

    /// Every routed request scans a worker's model list and `/v1/models`
    /// returns it to any client: a sync may not name millions.
    #[test]
    fn a_sync_names_a_bounded_list_of_models() {
        let sync = |models: Vec<String>| {
            let body = serde_json::json!({"worker_id": "w1", "hashes": [], "models": models});
            decode_valid::<SyncSnapshot>(body.to_string().as_bytes())
        };
        assert!(sync(vec!["m".into(); MAX_MODELS]).is_ok());
        assert_eq!(sync(vec!["m".into(); MAX_MODELS + 1]).unwrap_err().field, "models");
        assert_eq!(sync(vec!["m".into(), "x".repeat(MAX_MODEL_NAME_LEN + 1)]).unwrap_err().field, "models[1]");
        assert_eq!(sync(vec![String::new()]).unwrap_err().field, "models[0]");
    }

    /// A sync's aliases name only its models, each alias keying as a name
    /// that is not one (an alias of an alias, or a loop, is refused).
    #[test]
    fn a_syncs_aliases_name_its_models_one_level_deep() {
        let sync = |aliases: serde_json::Value| {
            let body = serde_json::json!({"worker_id": "w1", "hashes": [], "models": ["a", "b", "c"], "model_aliases": aliases});
            decode_valid::<SyncSnapshot>(body.to_string().as_bytes())
        };
        let ok = sync(serde_json::json!({"b": "a", "c": "a"})).unwrap();
        assert_eq!(ok.model_aliases.get(&ModelName::new("c")), Some(&ModelName::new("a")));
        for bad in [
            json!({"x": "a"}),
            json!({"b": "x"}),
            json!({"a": "a"}),
            json!({"b": "a", "c": "b"}),
            json!({"a": "b", "b": "a"}),
        ] {
            assert!(sync(bad.clone()).unwrap_err().field.starts_with("model_aliases."), "{bad}");
        }
        // Routers before the field answer acks without it; it is not sent empty.
        let ack: InternalAck = decode(br#"{"router_epoch": "e", "outcome": "applied", "protocol": 2}"#).unwrap();
        assert!(!ack.model_aliases);
        let plain = SyncSnapshot { model_aliases: ModelAliases::new(), ..ok };
        assert!(!serde_json::to_string(&plain).unwrap().contains("model_aliases"));
    }

    /// vLLM lists `--served-model-name a b` as two entries without a
    /// `parent`, and a LoRA adapter with its base as `parent`.
    #[test]
    fn the_other_served_names_of_the_base_are_its_aliases() {
        let body = br#"{"object": "list", "data": [
            {"id": "a", "object": "model", "root": "/m", "parent": null},
            {"id": "b", "object": "model", "root": "/m", "parent": null},
            {"id": "lora1", "object": "model", "root": "/l", "parent": "a"}]}"#;
        let served = parse_served_models(body).unwrap();
        let names = |m: ModelAliases| {
            m.into_iter().map(|(k, v)| (k.as_str().to_owned(), v.as_str().to_owned())).collect::<Vec<_>>()
        };
        let pair = |k: &str, v: &str| vec![(k.to_owned(), v.to_owned())];
        assert_eq!(names(model_aliases(&served, &ModelName::new("a"))), pair("b", "a"));
        assert_eq!(names(model_aliases(&served, &ModelName::new("b"))), pair("a", "b"));
        assert!(model_aliases(&served, &ModelName::new("lora1")).is_empty(), "an adapter has no aliases");
        assert_eq!(parse_model_list(body).unwrap(), ["a", "b", "lora1"].map(ModelName::new));
    }

    /// A sync's URL is parsed under the router's index lock and formatted
    /// into every request sent there: it is bounded.
    #[test]
    fn a_sync_names_a_bounded_url() {
        let sync = |url: String| {
            let body = serde_json::json!({"worker_id": "w1", "hashes": [], "url": url});
            decode_valid::<SyncSnapshot>(body.to_string().as_bytes())
        };
        let at = |n: usize| format!("http://h/{}", "a".repeat(n - "http://h/".len()));
        assert!(sync(at(MAX_URL_LEN)).is_ok());
        assert_eq!(sync(at(MAX_URL_LEN + 1)).unwrap_err().field, "url");
        assert!(check_http_url(&at(MAX_URL_LEN + 1)).is_err());
    }

    #[test]
    fn a_base_url_is_the_servers_not_the_openai_apis() {
        for url in ["http://vllm:8000/v1", "http://vllm:8000/v1/", "https://gw/team/v1"] {
            assert!(check_http_url(url).unwrap_err().contains("/v1"), "{url}");
        }
        // A path of its own (a gateway's prefix, vLLM's --root-path) is kept.
        assert_eq!(check_http_url("http://gw/team-a/").as_deref(), Ok("http://gw/team-a"));
        assert_eq!(check_http_url("http://gw/v1x").as_deref(), Ok("http://gw/v1x"));
    }

    #[test]
    fn error_body_is_openai_shaped() {
        let v = serde_json::to_value(ErrorBody::new(400, "invalid_request_error", "bad").with_param("model")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error":{"message":"bad","type":"invalid_request_error","code":400,"param":"model"}})
        );
    }
}
