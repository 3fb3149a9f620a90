//! Router configuration: a serde struct read from TOML / `KVROUTE_*` env / CLI
//! flags (merged in `main`), validated once into [`Config`].
//!
//! Every default is here and in the README's table; a field the router does
//! not know is an error, not silently ignored.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvroute_shared::openai::ChatDefaults;
use kvroute_shared::{BlockSize, WorkerId};
use serde::Deserialize;

use crate::policy::{
    CacheAware, CacheAwareParams, ConsistentHash, DynamoKv, DynamoParams, LeastLoaded, LlmdParams, LlmdWeighted,
    POLICY_NAMES, Policy, PowerOfTwo, Preble, PrebleParams, PredictedTtft, PredictedTtftParams, PrefixThreshold,
    PrefixThresholdParams, RoundRobin, StickyLeastLoaded,
};

/// A secret that never prints.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The configuration as written: every field optional with a default.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub listen: SocketAddr,
    /// A second, plain-HTTP listener serving only `/metrics` (for a scrape
    /// port kept apart from the API, as vllm-router's `--prometheus-port`).
    /// `/metrics` stays on `listen` too, so existing scrape configs keep
    /// working. Unset: no second listener.
    pub metrics_listen: Option<SocketAddr>,
    /// Static workers, `ID=URL`, or `ID=URL#dp-rank=R` for data-parallel
    /// rank R behind a URL that serves every rank (vLLM's internal load
    /// balancing; requests then carry `X-data-parallel-rank: R`).
    pub workers: Vec<String>,
    /// Other replicas of this router, by base URL (`crate::replicas`): every
    /// `replica_exchange_interval` this router tells each what it has in
    /// flight per worker and hears theirs back. One link per pair suffices;
    /// the same list on every replica, itself included, works too. Empty:
    /// no exchange (this router still answers replicas that report to it).
    pub replicas: Vec<String>,
    #[serde(with = "humantime_serde")]
    pub replica_exchange_interval: Duration,
    /// Between full reports, a replica that routes a request tells the
    /// others its new per-worker figures once this long has passed since
    /// its last report there (`crate::replicas`). Zero: full reports only.
    #[serde(with = "humantime_serde")]
    pub replica_news_interval: Duration,
    /// Tokenizer directory for models without their own entry in `tokenizers`.
    pub tokenizer: Option<PathBuf>,
    /// Model name → tokenizer directory.
    pub tokenizers: BTreeMap<String, PathBuf>,
    pub block_size: u32,
    pub policy: String,
    pub cache_aware: CacheAwareParams,
    pub predicted_ttft: PredictedTtftParams,
    pub prefix_threshold: PrefixThresholdParams,
    pub consistent_hash_load_factor: f64,
    /// Tokens that identify a request for `consistent_hash` and `sticky_least_loaded`.
    pub head_tokens: usize,
    /// When set, `/debug/*` and `/admin/*` require `Authorization: Bearer`
    /// with this token (they reveal block keys, worker URLs and load, and
    /// `/debug/route` costs a tokenization). Unset: open, as on loopback.
    pub admin_token: Option<Secret>,
    pub internal_token: Option<Secret>,
    /// One token per worker id: a sidecar may then push only for its own id
    /// (its registration, URL and keys), and the shared `internal_token`
    /// authorizes no push. `ID=TOKEN` lines (blank and `#` lines ignored) in
    /// `worker_tokens_file`, e.g. a mounted Kubernetes Secret.
    pub worker_tokens_file: Option<std::path::PathBuf>,
    pub allow_insecure_internal: bool,
    #[serde(with = "humantime_serde")]
    pub speculative_ttl: Duration,
    #[serde(with = "humantime_serde")]
    pub health_check_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub health_check_timeout: Duration,
    pub eject_after_failures: u32,
    /// A sidecar-registered worker not heard from for this long is removed,
    /// unless its engine still answers health checks: it then stays routable
    /// on the approximate index until its sidecar's next full sync.
    #[serde(with = "humantime_serde")]
    pub worker_expiry: Duration,
    /// Other workers to try when an attempt fails before any byte reached the
    /// client; after two server failures the request may have caused itself
    /// (a 5xx, a connection dropped, a stream broken), none more
    /// (`proxy::MAX_SUSPECT_ATTEMPTS`).
    pub retries: u32,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Until a non-streamed answer arrives (vLLM sends it whole, after its
    /// last token: an hour, for long generations); the longest a stream
    /// queued on a busy worker waits for its first token.
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// Longest gap between two body chunks of a streaming answer.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Until a streamed answer's first chunk (the first token), from
    /// dispatch, plus `first_token_timeout_per_1k_tokens` per thousand
    /// uncached prompt tokens; past it, with nothing sent yet and no other
    /// answer begun on that worker meanwhile, the request is cancelled and
    /// tried on another worker.
    #[serde(with = "humantime_serde")]
    pub first_token_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub first_token_timeout_per_1k_tokens: Duration,
    /// Open client connections at most; at the cap, accepting pauses.
    pub max_connections: usize,
    /// Time allowed to receive a request's headers; the connection is closed
    /// beyond it (slow-loris clients).
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Time a client connection may stay with nothing under way after its
    /// last answer ended; it is then shut down gracefully.
    #[serde(with = "humantime_serde")]
    pub keep_alive_timeout: Duration,
    /// Time allowed to receive a request's whole body (408 beyond it): a
    /// client's, a sidecar's push, a replica's report.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    pub max_body_bytes: usize,
    /// Client bodies, from their first byte until their answer begins,
    /// hold at most this many bytes in all; past it a request is shed
    /// (503). Bodies are read before a concurrency slot is taken, so only
    /// this bounds what clients sending slowly (16 MiB each, then nothing),
    /// or many waiting for long non-streamed answers, make the router hold.
    pub max_body_bytes_in_flight: usize,
    pub max_messages: usize,
    /// Longest prompt accepted, in tokens (set it to the engines'
    /// `--max-model-len`); longer ones get a 400, a prompt (or a chat body
    /// naming no media) too large in bytes to be one a 413 before any
    /// tokenizing; a truncated completion is placed by load instead.
    pub max_prompt_tokens: usize,
    /// The engines' `--default-chat-template-kwargs` (a JSON object): the
    /// router renders chats as they do, each request's own
    /// `chat_template_kwargs` over them. Set it to the engines' value, or a
    /// Qwen3 served with `{"enable_thinking": false}` is keyed without the
    /// empty thinking block vLLM adds to every chat.
    pub default_chat_template_kwargs: Option<String>,
    /// The engines' `--exclude-tools-when-tool-choice-none`: a chat with
    /// `tool_choice: "none"` is rendered without its tools.
    pub exclude_tools_when_tool_choice_none: bool,
    pub max_concurrent_requests: usize,
    /// Blocks an approximately indexed worker is assumed to hold when its
    /// `vllm:cache_config_info` cannot be read.
    pub approx_capacity_blocks: usize,
    #[serde(with = "humantime_serde")]
    pub session_ttl: Duration,
    #[serde(with = "humantime_serde")]
    pub max_session_ttl: Duration,
    pub max_sessions: usize,
    /// Keys accepted in one sync (a bound on memory per request).
    pub max_sync_keys: usize,
    /// Largest /internal/* body: a sync of `max_sync_keys` keys is ~19 bytes a key.
    pub max_internal_body_bytes: usize,
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// At a stop signal, how long the router goes on serving (new
    /// connections too) with `/ready` answering 503, before it closes its
    /// listener: load balancers (Kubernetes' endpoints, kube-proxy, an
    /// ingress) take a few seconds to stop sending to it.
    #[serde(with = "humantime_serde")]
    pub drain_delay: Duration,
    /// PEM certificate chain and private key: serve HTTPS instead of HTTP.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle trusted for `https://` workers, besides the web PKI roots.
    pub tls_ca: Option<PathBuf>,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            metrics_listen: None,
            workers: Vec::new(),
            replicas: Vec::new(),
            replica_exchange_interval: Duration::from_millis(100),
            replica_news_interval: Duration::from_millis(10),
            tokenizer: None,
            tokenizers: BTreeMap::new(),
            block_size: 16,
            policy: crate::policy::DEFAULT_POLICY.into(),
            cache_aware: CacheAwareParams::default(),
            predicted_ttft: PredictedTtftParams::default(),
            prefix_threshold: PrefixThresholdParams::default(),
            consistent_hash_load_factor: 1.25,
            head_tokens: 64,
            admin_token: None,
            internal_token: None,
            worker_tokens_file: None,
            allow_insecure_internal: false,
            speculative_ttl: Duration::from_secs(10),
            health_check_interval: Duration::from_secs(2),
            health_check_timeout: Duration::from_secs(2),
            eject_after_failures: 3,
            worker_expiry: Duration::from_secs(30),
            retries: 2,
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(3600),
            idle_timeout: Duration::from_secs(300),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 10_000,
            header_read_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(75),
            first_token_timeout: Duration::from_secs(60),
            first_token_timeout_per_1k_tokens: Duration::from_secs(2),
            max_body_bytes: 16 << 20,
            max_body_bytes_in_flight: 1 << 30,
            max_messages: 4096,
            max_prompt_tokens: 262_144,
            default_chat_template_kwargs: None,
            exclude_tools_when_tool_choice_none: false,
            max_concurrent_requests: 4096,
            approx_capacity_blocks: 100_000,
            session_ttl: Duration::from_secs(600),
            max_session_ttl: Duration::from_secs(86_400),
            max_sessions: 100_000,
            max_sync_keys: 4_000_000,
            max_internal_body_bytes: 128 << 20,
            shutdown_grace: Duration::from_secs(30),
            drain_delay: Duration::ZERO,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }
}

/// A static worker from `--worker ID=URL[#dp-rank=R]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaticWorker {
    pub id: WorkerId,
    pub url: String,
    pub dp_rank: Option<u32>,
}

/// `URL#dp-rank=R` → (`URL`, `Some(R)`); a URL without a fragment is its own
/// target. Worker URLs may not carry fragments, so `#` is unambiguous.
fn split_dp_rank(target: &str) -> Result<(&str, Option<u32>), String> {
    let Some((url, fragment)) = target.split_once('#') else { return Ok((target, None)) };
    let rank = fragment
        .strip_prefix("dp-rank=")
        .and_then(|r| r.parse::<u32>().ok())
        .filter(|r| *r < kvroute_shared::wire::MAX_DP_RANKS)
        .ok_or_else(|| {
            format!("{fragment:?} after '#' is not dp-rank=R with R below {}", kvroute_shared::wire::MAX_DP_RANKS)
        })?;
    Ok((url, Some(rank)))
}

/// Which policy, with its parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyConfig {
    CacheAware(CacheAwareParams),
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
    ConsistentHash { load_factor: f64 },
    StickyLeastLoaded { prefix_tokens: usize },
    PrefixThreshold(PrefixThresholdParams),
    PredictedTtft(PredictedTtftParams),
    DynamoKv(DynamoParams),
    LlmdWeighted(LlmdParams),
    Preble(PrebleParams),
}

impl PolicyConfig {
    pub fn build(&self) -> Box<dyn Policy> {
        match *self {
            PolicyConfig::CacheAware(params) => Box::new(CacheAware { params }),
            PolicyConfig::RoundRobin => Box::<RoundRobin>::default(),
            PolicyConfig::LeastLoaded => Box::new(LeastLoaded),
            PolicyConfig::PowerOfTwo => Box::<PowerOfTwo>::default(),
            PolicyConfig::ConsistentHash { load_factor } => Box::new(ConsistentHash { load_factor }),
            PolicyConfig::StickyLeastLoaded { prefix_tokens } => Box::new(StickyLeastLoaded { prefix_tokens }),
            PolicyConfig::PrefixThreshold(params) => Box::new(PrefixThreshold { params }),
            PolicyConfig::PredictedTtft(params) => Box::new(PredictedTtft { params }),
            PolicyConfig::DynamoKv(params) => Box::new(DynamoKv::new(params)),
            PolicyConfig::LlmdWeighted(params) => Box::new(LlmdWeighted { params }),
            PolicyConfig::Preble(params) => Box::new(Preble { params }),
        }
    }
}

/// The validated configuration the router runs with.
#[derive(Clone, Debug)]
pub struct Config {
    pub raw: RawConfig,
    pub block_size: BlockSize,
    pub workers: Vec<StaticWorker>,
    /// The other replicas' base URLs, checked, without a trailing `/`.
    pub replicas: Vec<String>,
    pub policy: PolicyConfig,
    /// Per-worker push tokens (empty: the shared internal token authorizes
    /// pushes for any id).
    pub worker_tokens: BTreeMap<WorkerId, Secret>,
    /// What the engines' flags add to every chat's rendering.
    pub chat_defaults: ChatDefaults,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid config value for `{field}`: {message}")]
    Invalid { field: &'static str, message: String },
    #[error(
        "refusing to serve /internal/* on non-loopback {listen} without an internal token: \
         set --internal-token (or KVROUTE_INTERNAL_TOKEN), or pass --allow-insecure-internal"
    )]
    InsecureInternal { listen: SocketAddr },
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, message: message.into() }
}

impl RawConfig {
    pub fn validate(self) -> Result<Config, ConfigError> {
        let block_size = BlockSize::new(self.block_size).map_err(|e| invalid("block_size", e.to_string()))?;
        let mut workers: Vec<StaticWorker> = Vec::new();
        for spec in &self.workers {
            let (id, target) =
                spec.split_once('=').ok_or_else(|| invalid("workers", format!("{spec:?} is not ID=URL")))?;
            let (url, dp_rank) = split_dp_rank(target).map_err(|e| invalid("workers", format!("{spec:?}: {e}")))?;
            let url = crate::workers::checked_url(url).map_err(|e| invalid("workers", format!("{spec:?}: {e}")))?;
            if workers.iter().any(|w| w.id.as_str() == id) {
                return Err(invalid("workers", format!("{spec:?}: worker ids must be unique")));
            }
            // As a sidecar's: the id is a metrics label, written unescaped.
            kvroute_shared::wire::validate_worker_id(&WorkerId::new(id))
                .map_err(|e| invalid("workers", format!("{spec:?}: {}", e.message)))?;
            // One engine under two ids splits its traffic and its cache.
            if let Some(twin) = workers.iter().find(|w| w.url == url && w.dp_rank == dp_rank) {
                return Err(invalid("workers", format!("{spec:?}: the same engine as worker {}", twin.id)));
            }
            workers.push(StaticWorker { id: WorkerId::new(id), url, dp_rank });
        }
        let mut replicas: Vec<String> = Vec::new();
        for url in &self.replicas {
            let url = crate::workers::checked_url(url).map_err(|e| invalid("replicas", e.to_string()))?;
            if !replicas.contains(&url) {
                replicas.push(url);
            }
        }
        if !(Duration::from_millis(10)..=Duration::from_secs(10)).contains(&self.replica_exchange_interval) {
            return Err(invalid("replica_exchange_interval", "must be between 10ms and 10s"));
        }
        if !self.replica_news_interval.is_zero()
            && !(Duration::from_millis(1)..self.replica_exchange_interval).contains(&self.replica_news_interval)
        {
            return Err(invalid(
                "replica_news_interval",
                format!(
                    "is {:?} (default 10ms): it must be 0 (full reports only) or at least 1ms and shorter than \
                     replica_exchange_interval ({:?})",
                    self.replica_news_interval, self.replica_exchange_interval
                ),
            ));
        }
        let policy = match self.policy.as_str() {
            "cache_aware" => PolicyConfig::CacheAware(self.cache_aware),
            "round_robin" => PolicyConfig::RoundRobin,
            "least_loaded" => PolicyConfig::LeastLoaded,
            "power_of_two" => PolicyConfig::PowerOfTwo,
            "consistent_hash" => PolicyConfig::ConsistentHash { load_factor: self.consistent_hash_load_factor },
            "sticky_least_loaded" => PolicyConfig::StickyLeastLoaded { prefix_tokens: self.head_tokens },
            "prefix_threshold" => PolicyConfig::PrefixThreshold(self.prefix_threshold),
            "predicted_ttft" => PolicyConfig::PredictedTtft(self.predicted_ttft),
            "dynamo_kv" => PolicyConfig::DynamoKv(DynamoParams::default()),
            "llmd_weighted" => PolicyConfig::LlmdWeighted(LlmdParams::default()),
            "preble" => PolicyConfig::Preble(PrebleParams::default()),
            other => return Err(invalid("policy", format!("{other:?} is not one of {}", POLICY_NAMES.join(", ")))),
        };
        if !(1.0..=10.0).contains(&self.consistent_hash_load_factor) {
            return Err(invalid("consistent_hash_load_factor", "must be between 1.0 and 10.0"));
        }
        // NaN passes every `<` check: each float is also held finite.
        let c = &self.cache_aware;
        if !([c.load_weight, c.spill_slack].iter().all(|v| *v >= 0.0 && v.is_finite())
            && [c.spill_factor, c.imbalance_rel, c.placement_factor].iter().all(|v| *v >= 1.0 && v.is_finite())
            && (0.0..=1.0).contains(&c.min_match_ratio))
        {
            return Err(invalid(
                "cache_aware",
                "load_weight and spill_slack must be finite and ≥ 0, spill_factor, imbalance_rel and \
                 placement_factor finite and ≥ 1, min_match_ratio within 0..=1",
            ));
        }
        let p = &self.prefix_threshold;
        if !((0.0..=1.0).contains(&p.threshold) && p.balance_rel >= 1.0 && p.balance_rel.is_finite()) {
            return Err(invalid("prefix_threshold", "threshold must be within 0..=1, balance_rel finite and ≥ 1"));
        }
        let t = &self.predicted_ttft;
        if !(t.prefill_us_per_token > 0.0 && t.step_overhead_us >= 0.0 && t.decode_us_per_seq >= 0.0)
            || t.max_batched_tokens == 0
            || !(t.near_best >= 0.0
                && t.spill_factor >= 1.0
                && t.miss_weight >= 0.0
                && t.stick_factor >= 1.0
                && t.imposed_cap_us >= 0.0)
            || !(0.0..=1.0).contains(&t.stick_ratio)
            || !(0.0..1.0).contains(&t.room_reserve)
            || ![
                t.pull_ratio,
                t.pull_unique_ratio,
                t.pull_gap_weight,
                t.burst_idle_share,
                t.imposed_weight,
                t.imposed_band,
                t.pace_weight,
                t.pace_band,
                t.room_ratio,
                t.near_best_us,
                t.spill_slack,
                t.kv_knee,
                t.stick_slack_tokens,
                t.stick_recompute_weight,
                t.stick_unique_weight,
            ]
            .iter()
            .all(|v| *v >= 0.0 && v.is_finite())
        {
            return Err(invalid(
                "predicted_ttft",
                "costs must be ≥ 0 (prefill_us_per_token > 0), max_batched_tokens ≥ 1, \
                 spill_factor and stick_factor ≥ 1, stick_ratio within 0..=1, room_reserve within 0..1, \
                 the slacks, kv_knee, stick weights and the pull, burst, imposed-delay, pace and room \
                 parameters finite and ≥ 0 (imposed_cap_us may be inf)",
            ));
        }
        if self.max_connections == 0 {
            return Err(invalid("max_connections", "must be at least 1"));
        }
        // A zero period panics tokio's interval (the health checks stopped,
        // and no ejected worker came back); a zero timeout fails everything.
        for (key, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("keep_alive_timeout", self.keep_alive_timeout),
            ("idle_timeout", self.idle_timeout),
            ("body_read_timeout", self.body_read_timeout),
            ("health_check_interval", self.health_check_interval),
            ("health_check_timeout", self.health_check_timeout),
            ("connect_timeout", self.connect_timeout),
            ("first_byte_timeout", self.first_byte_timeout),
            ("first_token_timeout", self.first_token_timeout),
        ] {
            if d.is_zero() {
                return Err(invalid(key, "must be above 0"));
            }
        }
        if self.worker_expiry <= Duration::from_millis(500) {
            return Err(invalid("worker_expiry", "must be above the sidecars' 500ms heartbeat"));
        }
        if self.session_ttl > self.max_session_ttl {
            return Err(invalid("session_ttl", "must not exceed max_session_ttl"));
        }
        if self.max_sync_keys == 0 {
            return Err(invalid("max_sync_keys", "must be at least 1"));
        }
        // A sync of max_sync_keys keys takes 19 bytes a key on the wire.
        if self.max_internal_body_bytes < self.max_sync_keys.saturating_mul(20).max(1 << 16) {
            return Err(invalid(
                "max_internal_body_bytes",
                "must hold a sync of max_sync_keys keys (20 bytes a key, at least 64 KiB), or its sidecar loops on 413s",
            ));
        }
        if self.max_prompt_tokens == 0 {
            return Err(invalid("max_prompt_tokens", "must be at least 1"));
        }
        if self.head_tokens == 0 {
            return Err(invalid("head_tokens", "must be at least 1"));
        }
        if self.max_concurrent_requests == 0 {
            return Err(invalid("max_concurrent_requests", "must be at least 1"));
        }
        if self.max_body_bytes < 1024 {
            return Err(invalid("max_body_bytes", "must be at least 1024"));
        }
        if self.max_body_bytes_in_flight < self.max_body_bytes {
            return Err(invalid("max_body_bytes_in_flight", "must be at least max_body_bytes"));
        }
        if self.eject_after_failures == 0 {
            return Err(invalid("eject_after_failures", "must be at least 1"));
        }
        if let Some(t) = &self.admin_token {
            kvroute_shared::wire::check_token(t.expose()).map_err(|m| invalid("admin_token", m))?;
        }
        if let Some(t) = &self.internal_token {
            kvroute_shared::wire::check_token(t.expose()).map_err(|m| invalid("internal_token", m))?;
        }
        let worker_tokens = match &self.worker_tokens_file {
            Some(path) => load_worker_tokens(path)?,
            None => BTreeMap::new(),
        };
        // The shared token speaks for routers (`/internal/replica`) and for
        // every worker: a worker's own token equal to it (the old shared
        // token kept for one worker while moving to per-worker tokens) gave
        // that worker's sidecar both.
        if let Some(shared) = &self.internal_token
            && let Some((id, _)) = worker_tokens.iter().find(|(_, t)| t.expose() == shared.expose())
        {
            return Err(invalid(
                "worker_tokens_file",
                format!("worker {id}'s token is internal_token, which speaks for every worker and router"),
            ));
        }
        // Static workers and the ids in the tokens file must all fit in the
        // index's slots at once: then a registration flood can never lock one
        // of them out (fakes without a token are refused, and a static
        // worker's slot is never reclaimed).
        let reserved: std::collections::BTreeSet<&str> =
            workers.iter().map(|w| w.id.as_str()).chain(worker_tokens.keys().map(|id| id.as_str())).collect();
        if reserved.len() > crate::index::MAX_WORKERS {
            return Err(invalid(
                "workers",
                format!(
                    "{} distinct static and per-token worker ids, but the router has {} worker slots",
                    reserved.len(),
                    crate::index::MAX_WORKERS
                ),
            ));
        }
        if let Some(m) = self.metrics_listen
            && m.port() != 0
            && m.port() == self.listen.port()
            && (m.ip() == self.listen.ip() || m.ip().is_unspecified() || self.listen.ip().is_unspecified())
        {
            return Err(invalid(
                "metrics_listen",
                format!("{m} is the API's own address; /metrics is served there already"),
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(invalid("tls_cert", "tls_cert and tls_key go together"));
        }
        if !replicas.is_empty() && self.internal_token.is_none() && !worker_tokens.is_empty() {
            return Err(invalid(
                "replicas",
                "replicas authenticate with internal_token, which worker_tokens_file leaves unset: set both",
            ));
        }
        if self.internal_token.is_none()
            && worker_tokens.is_empty()
            && !self.listen.ip().is_loopback()
            && !self.allow_insecure_internal
        {
            return Err(ConfigError::InsecureInternal { listen: self.listen });
        }
        let kwargs = match &self.default_chat_template_kwargs {
            None => None,
            Some(text) => match serde_json::from_str::<serde_json::Value>(text) {
                Ok(serde_json::Value::Object(map)) => Some(Arc::new(map)),
                _ => {
                    return Err(invalid(
                        "default_chat_template_kwargs",
                        format!("must be a JSON object, as vLLM's --default-chat-template-kwargs: {text:?}"),
                    ));
                }
            },
        };
        let chat_defaults =
            ChatDefaults { kwargs, exclude_tools_when_tool_choice_none: self.exclude_tools_when_tool_choice_none };
        Ok(Config { block_size, workers, replicas, policy, worker_tokens, chat_defaults, raw: self })
    }
}

fn load_worker_tokens(path: &std::path::Path) -> Result<BTreeMap<WorkerId, Secret>, ConfigError> {
    let field = "worker_tokens_file";
    let text = std::fs::read_to_string(path).map_err(|e| invalid(field, format!("{}: {e}", path.display())))?;
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |m: String| invalid(field, format!("{} line {}: {m}", path.display(), n + 1));
        let (id, token) = line.split_once('=').ok_or_else(|| at("not ID=TOKEN".into()))?;
        let id = WorkerId::from(id.trim());
        if id.as_str().is_empty() {
            return Err(at("empty worker id".into()));
        }
        kvroute_shared::wire::check_token(token.trim()).map_err(at)?;
        if out.insert(id.clone(), Secret::new(token.trim())).is_some() {
            return Err(at(format!("worker {id} appears twice")));
        }
    }
    if out.is_empty() {
        return Err(invalid(field, format!("{} names no worker", path.display())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        let c = RawConfig::default().validate().unwrap();
        assert_eq!(c.block_size, BlockSize::DEFAULT);
        assert!(matches!(c.policy, PolicyConfig::PredictedTtft(_)));
    }

    #[test]
    fn every_policy_name_builds() {
        for name in POLICY_NAMES {
            let c = RawConfig { policy: (*name).into(), ..Default::default() }.validate().unwrap();
            assert_eq!(c.policy.build().name(), *name);
        }
    }

    #[test]
    fn bad_values_name_the_field() {
        let e = RawConfig { policy: "fastest".into(), ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`policy`"), "{e}");
        let e = RawConfig { workers: vec!["w1".into()], ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`workers`"), "{e}");
        let bad = PredictedTtftParams { stick_ratio: 2.0, ..Default::default() };
        let e = RawConfig { predicted_ttft: bad, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`predicted_ttft`"), "{e}");
        for bad in [
            PredictedTtftParams { burst_idle_share: f64::NAN, ..Default::default() },
            PredictedTtftParams { imposed_weight: -1.0, ..Default::default() },
            PredictedTtftParams { pace_weight: f64::INFINITY, ..Default::default() },
            PredictedTtftParams { pace_band: -0.5, ..Default::default() },
            PredictedTtftParams { imposed_cap_us: -1.0, ..Default::default() },
            PredictedTtftParams { imposed_cap_us: f64::NAN, ..Default::default() },
            PredictedTtftParams { room_ratio: -1.0, ..Default::default() },
            PredictedTtftParams { room_reserve: 1.0, ..Default::default() },
            PredictedTtftParams { kv_knee: f64::NAN, ..Default::default() },
            PredictedTtftParams { stick_slack_tokens: -1.0, ..Default::default() },
            PredictedTtftParams { stick_unique_weight: f64::INFINITY, ..Default::default() },
        ] {
            let e = RawConfig { predicted_ttft: bad, ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("`predicted_ttft`"), "{e}");
        }
        // Every policy's table: NaN passed the `< 0` checks.
        for bad in [
            CacheAwareParams { load_weight: f64::NAN, ..Default::default() },
            CacheAwareParams { min_match_ratio: 1.5, ..Default::default() },
            CacheAwareParams { spill_factor: 0.5, ..Default::default() },
        ] {
            let e = RawConfig { cache_aware: bad, ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("`cache_aware`"), "{e}");
        }
        for bad in [
            PrefixThresholdParams { threshold: 1.5, ..Default::default() },
            PrefixThresholdParams { balance_rel: f64::NAN, ..Default::default() },
        ] {
            let e = RawConfig { prefix_threshold: bad, ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("`prefix_threshold`"), "{e}");
        }
        // No cap is a setting, not a mistake.
        let uncapped = PredictedTtftParams { imposed_cap_us: f64::INFINITY, ..Default::default() };
        assert!(RawConfig { predicted_ttft: uncapped, ..Default::default() }.validate().is_ok());
        let e = RawConfig { block_size: 0, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`block_size`"), "{e}");
        // A zero deadline would fail every connection at once.
        let e = RawConfig { idle_timeout: Duration::ZERO, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`idle_timeout`"), "{e}");
        let e = RawConfig { keep_alive_timeout: Duration::ZERO, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`keep_alive_timeout`"), "{e}");
    }

    /// Values that would stop or fail the router's work at run time are
    /// refused at start, naming the field: a zero health-check period
    /// panicked the health task (ejected workers never came back).
    /// vLLM's `--default-chat-template-kwargs` is a JSON object: anything
    /// else is refused at start, naming the setting.
    #[test]
    fn the_engines_chat_defaults_are_a_json_object() {
        let with = |text: &str| RawConfig { default_chat_template_kwargs: Some(text.into()), ..Default::default() };
        let config = with(r#"{"enable_thinking": false}"#).validate().unwrap();
        assert_eq!(config.chat_defaults.kwargs.unwrap()["enable_thinking"], false);
        for bad in ["", "[1]", "{", "true"] {
            let e = with(bad).validate().unwrap_err().to_string();
            assert!(e.contains("default_chat_template_kwargs"), "{bad}: {e}");
        }
    }

    #[test]
    fn settings_that_would_fail_at_run_time_are_refused_at_start() {
        let zero = Duration::ZERO;
        let cases: Vec<(&str, RawConfig)> = vec![
            ("health_check_interval", RawConfig { health_check_interval: zero, ..Default::default() }),
            ("health_check_timeout", RawConfig { health_check_timeout: zero, ..Default::default() }),
            ("connect_timeout", RawConfig { connect_timeout: zero, ..Default::default() }),
            ("first_byte_timeout", RawConfig { first_byte_timeout: zero, ..Default::default() }),
            ("first_token_timeout", RawConfig { first_token_timeout: zero, ..Default::default() }),
            ("worker_expiry", RawConfig { worker_expiry: Duration::from_millis(500), ..Default::default() }),
            ("session_ttl", RawConfig { session_ttl: Duration::from_secs(7 * 86_400), ..Default::default() }),
            ("max_sync_keys", RawConfig { max_sync_keys: 0, ..Default::default() }),
            ("max_internal_body_bytes", RawConfig { max_internal_body_bytes: 1 << 20, ..Default::default() }),
            ("max_body_bytes", RawConfig { max_body_bytes: 100, ..Default::default() }),
            ("max_concurrent_requests", RawConfig { max_concurrent_requests: 0, ..Default::default() }),
        ];
        for (field, raw) in cases {
            let e = raw.validate().unwrap_err();
            assert!(e.to_string().contains(&format!("`{field}`")), "{field}: {e}");
        }
        let small = RawConfig { max_sync_keys: 1_000, max_internal_body_bytes: 1 << 16, ..Default::default() };
        assert!(small.validate().is_ok(), "64 KiB holds a 1,000-key sync");
        let e = RawConfig { replica_exchange_interval: Duration::from_millis(10), ..Default::default() }
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("default 10ms") && e.to_string().contains("10ms"), "{e}");
    }

    #[test]
    fn a_static_worker_may_name_its_data_parallel_rank() {
        let workers = vec!["a=http://h:8000".into(), "b=http://h:8000/#dp-rank=3".into()];
        let c = RawConfig { workers, ..Default::default() }.validate().unwrap();
        let got: Vec<_> = c.workers.iter().map(|w| (w.url.as_str(), w.dp_rank)).collect();
        assert_eq!(got, [("http://h:8000", None), ("http://h:8000", Some(3))]);
        for bad in ["c=http://h#rank=1", "c=http://h#dp-rank=x", "c=http://h#dp-rank=1024"] {
            let e = RawConfig { workers: vec![bad.into()], ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("dp-rank=R"), "{bad}: {e}");
        }
        // One engine (or rank) under two ids is refused, its twin named.
        for twins in
            [["a=http://h:8000", "b=http://h:8000/"], ["a=http://h:8000#dp-rank=1", "b=http://h:8000/#dp-rank=1"]]
        {
            let workers = twins.iter().map(|w| (*w).to_owned()).collect();
            let e = RawConfig { workers, ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("the same engine as worker a"), "{twins:?}: {e}");
        }
    }

    /// A static worker's id is held to a sidecar's rules: it is written
    /// unescaped into metrics labels (a `"` broke every scrape), and `none`
    /// is the label of requests refused before a worker was chosen.
    #[test]
    fn a_static_worker_id_is_checked_as_a_sidecars() {
        for bad in ["a\"b=http://h:8000", "none=http://h:8000", "=http://h:8000", "a b=http://h:8000"] {
            let e = RawConfig { workers: vec![bad.into()], ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("workers"), "{bad}: {e}");
        }
        assert!(RawConfig { workers: vec!["gpu-0.a_b:1=http://h".into()], ..Default::default() }.validate().is_ok());
    }

    #[test]
    fn more_reserved_worker_ids_than_slots_are_refused() {
        let many = |n: usize| (0..n).map(|i| format!("w{i}=http://127.0.0.1:{}", 9000 + i)).collect::<Vec<_>>();
        let fits = RawConfig { workers: many(crate::index::MAX_WORKERS), ..Default::default() };
        assert!(fits.validate().is_ok());
        let e =
            RawConfig { workers: many(crate::index::MAX_WORKERS + 1), ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("worker slots"), "{e}");
    }

    #[test]
    fn replicas_are_checked_urls_and_need_a_token_routers_can_share() {
        let replicas = vec!["http://router-b:8080/".into(), "http://router-b:8080".into(), "https://10.0.0.3".into()];
        let c = RawConfig { replicas, ..Default::default() }.validate().unwrap();
        assert_eq!(c.replicas, ["http://router-b:8080", "https://10.0.0.3"]);
        let e = RawConfig { replicas: vec!["router-b:8080".into()], ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("`replicas`"), "{e}");
        for bad in [Duration::ZERO, Duration::from_secs(11)] {
            let e = RawConfig { replica_exchange_interval: bad, ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("`replica_exchange_interval`"), "{e}");
        }
        for bad in [Duration::from_micros(500), Duration::from_millis(100), Duration::from_secs(1)] {
            let e = RawConfig { replica_news_interval: bad, ..Default::default() }.validate().unwrap_err();
            assert!(e.to_string().contains("`replica_news_interval`"), "{e}");
        }
        for good in [Duration::ZERO, Duration::from_millis(1), Duration::from_millis(99)] {
            RawConfig { replica_news_interval: good, ..Default::default() }.validate().unwrap();
        }
        let dir = std::env::temp_dir().join(format!("kvroute-replica-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokens");
        std::fs::write(&file, "w1=worker-one-token-0123\n").unwrap();
        let per_worker = RawConfig {
            replicas: vec!["http://router-b:8080".into()],
            worker_tokens_file: Some(file),
            ..Default::default()
        };
        let e = per_worker.clone().validate().unwrap_err();
        assert!(e.to_string().contains("`replicas`") && e.to_string().contains("internal_token"), "{e}");
        let both = RawConfig { internal_token: Some(Secret::new("shared-router-token-01")), ..per_worker.clone() };
        assert!(both.validate().is_ok());
        // A worker's token may not be the shared one, which speaks for routers.
        let same = RawConfig { internal_token: Some(Secret::new("worker-one-token-0123")), ..per_worker };
        let e = same.validate().unwrap_err();
        assert!(e.to_string().contains("`worker_tokens_file`") && e.to_string().contains("w1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refuses_open_internal_endpoints_off_loopback() {
        let open = RawConfig { listen: "0.0.0.0:8080".parse().unwrap(), ..Default::default() };
        assert!(matches!(open.clone().validate(), Err(ConfigError::InsecureInternal { .. })));
        let tokened = RawConfig { internal_token: Some(Secret::new("0123456789abcdef")), ..open.clone() };
        assert!(tokened.validate().is_ok());
        assert!(RawConfig { allow_insecure_internal: true, ..open }.validate().is_ok());
    }

    #[test]
    fn weak_tokens_are_refused() {
        for weak in ["                ", "aaaaaaaaaaaaaaaa", " padded-token-0123456 ", "tab\tinside-the-token"] {
            let raw = RawConfig { internal_token: Some(Secret::new(weak)), ..Default::default() };
            let e = raw.validate().unwrap_err();
            assert!(e.to_string().contains("`internal_token`"), "{weak:?}: {e}");
        }
    }

    #[test]
    fn metrics_listen_must_differ_from_listen() {
        let same = RawConfig { metrics_listen: Some("0.0.0.0:8080".parse().unwrap()), ..Default::default() };
        let e = same.validate().unwrap_err();
        assert!(e.to_string().contains("`metrics_listen`"), "{e}");
        let other = RawConfig { metrics_listen: Some("127.0.0.1:9090".parse().unwrap()), ..Default::default() };
        assert_eq!(other.validate().unwrap().raw.metrics_listen, Some("127.0.0.1:9090".parse().unwrap()));
    }

    #[test]
    fn secrets_do_not_print() {
        let c = RawConfig { internal_token: Some(Secret::new("super-secret-token-123")), ..Default::default() };
        assert!(!format!("{c:?}").contains("super-secret"));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = serde_json::from_str::<RawConfig>(r#"{"polcy": "round_robin"}"#).unwrap_err();
        assert!(e.to_string().contains("polcy"), "{e}");
    }
}
