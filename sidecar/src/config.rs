//! Sidecar configuration: the raw, all-optional form read from a file, the
//! environment (`KVROUTE_SIDECAR_*`) and flags, and the validated [`Config`]
//! that the library runs on.
//!
//! Values that only the engine knows (model, block size) stay `None` here and
//! are discovered from the engine when `run` starts.

use std::fmt;
use std::time::Duration;

use kvroute_shared::wire::{MAX_DP_RANKS, MAX_MODEL_NAME_LEN, MAX_WORKER_ID_LEN};
use kvroute_shared::{BlockSize, ModelName, WorkerId};
use serde::Deserialize;

/// Everything settable, all optional, in the shape a config file uses.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub worker_id: Option<String>,
    pub engine_url: Option<String>,
    /// vLLM's `--api-key`, sent as a bearer token on the sidecar's calls to it.
    pub engine_api_key: Option<String>,
    pub advertise_url: Option<String>,
    pub model: Option<String>,
    pub events: Option<String>,
    pub replay: Option<String>,
    pub topic: Option<String>,
    pub data_parallel_size: Option<u32>,
    pub data_parallel_rank: Option<u32>,
    /// A list in a file; a comma-separated string from the environment.
    #[serde(default, deserialize_with = "list_or_commas")]
    pub router: Vec<String>,
    pub internal_token: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub fast_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub sync_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub full_sync_interval: Option<Duration>,
    pub block_size: Option<u32>,
    pub listen: Option<String>,
    pub engine_snapshot: Option<String>,
    pub max_pending_changes: Option<usize>,
    /// PEM CA bundle trusted for `https://` routers, besides the web PKI roots.
    pub tls_ca: Option<String>,
}

impl RawConfig {
    /// Fills every field unset in `self` from `lower` (flags over env over file).
    pub fn or(self, lower: RawConfig) -> RawConfig {
        RawConfig {
            worker_id: self.worker_id.or(lower.worker_id),
            engine_url: self.engine_url.or(lower.engine_url),
            engine_api_key: self.engine_api_key.or(lower.engine_api_key),
            advertise_url: self.advertise_url.or(lower.advertise_url),
            model: self.model.or(lower.model),
            events: self.events.or(lower.events),
            replay: self.replay.or(lower.replay),
            topic: self.topic.or(lower.topic),
            data_parallel_size: self.data_parallel_size.or(lower.data_parallel_size),
            data_parallel_rank: self.data_parallel_rank.or(lower.data_parallel_rank),
            router: if self.router.is_empty() { lower.router } else { self.router },
            internal_token: self.internal_token.or(lower.internal_token),
            fast_interval: self.fast_interval.or(lower.fast_interval),
            sync_interval: self.sync_interval.or(lower.sync_interval),
            full_sync_interval: self.full_sync_interval.or(lower.full_sync_interval),
            block_size: self.block_size.or(lower.block_size),
            listen: self.listen.or(lower.listen),
            engine_snapshot: self.engine_snapshot.or(lower.engine_snapshot),
            max_pending_changes: self.max_pending_changes.or(lower.max_pending_changes),
            tls_ca: self.tls_ca.or(lower.tls_ca),
        }
    }

    /// Validates into a [`Config`]; `default_worker_id` is used when none is set
    /// (main passes the hostname: library code does not read the environment).
    pub fn validate(self, default_worker_id: &str) -> Result<Config, ConfigError> {
        let worker_id = self.worker_id.unwrap_or_else(|| default_worker_id.to_owned());
        if worker_id.is_empty()
            || worker_id.len() > MAX_WORKER_ID_LEN
            || !worker_id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        {
            return Err(ConfigError::new("worker_id", "1 to 128 ASCII letters, digits or - _ . :"));
        }
        let engine_url = http_url("engine_url", self.engine_url.unwrap_or_else(|| "http://127.0.0.1:8000".into()))?;
        let advertise_url = match self.advertise_url {
            Some(u) => http_url("advertise_url", u)?,
            None => engine_url.clone(),
        };
        let events = self.events.ok_or_else(|| ConfigError::new("events", "required (tcp://HOST:PORT)"))?;
        let events = ZmqEndpoint::parse("events", &events)?;
        let replay = self.replay.map(|r| ZmqEndpoint::parse("replay", &r)).transpose()?;
        let engine_snapshot = self.engine_snapshot.map(|r| ZmqEndpoint::parse("engine_snapshot", &r)).transpose()?;
        let data_parallel_size = self.data_parallel_size.unwrap_or(1);
        if !(1..=MAX_DP_RANKS).contains(&data_parallel_size) {
            return Err(ConfigError::new("data_parallel_size", format!("must be 1 to {MAX_DP_RANKS}")));
        }
        let targets = rank_targets(&worker_id, data_parallel_size, self.data_parallel_rank)?;
        for (field, ep) in
            [("events", Some(&events)), ("replay", replay.as_ref()), ("engine_snapshot", engine_snapshot.as_ref())]
        {
            if let Some(ep) = ep
                && ep.listed() > 1
                && ep.listed() != data_parallel_size as usize
            {
                return Err(ConfigError::new(
                    field,
                    format!("lists {} endpoints, but data_parallel_size is {data_parallel_size}", ep.listed()),
                ));
            }
        }
        // vLLM binds rank r's sockets at base + r: with the defaults (events
        // 5557, replay 5558) rank 1's events are rank 0's replay, and one of
        // the two binds fails (an engine that will not start, or a socket
        // that answers another protocol).
        let mut bound: Vec<(String, &'static str, u32)> = Vec::new();
        for (field, ep) in
            [("events", Some(&events)), ("replay", replay.as_ref()), ("engine_snapshot", engine_snapshot.as_ref())]
        {
            let Some(ep) = ep else { continue };
            for rank in targets.iter().map(|t| t.rank) {
                let at = ep.for_rank(rank);
                if let Some((_, other, other_rank)) = bound.iter().find(|(a, ..)| *a == at) {
                    return Err(ConfigError::new(
                        field,
                        format!(
                            "rank {rank}'s {field} endpoint {at} is also rank {other_rank}'s {other} (vLLM binds \
                             rank r at base port + r): move one base clear of the other's ranks"
                        ),
                    ));
                }
                bound.push((at, field, rank));
            }
        }
        let routers = self.router.into_iter().map(|r| http_url("router", r)).collect::<Result<Vec<_>, _>>()?;
        let fast_interval = self.fast_interval.unwrap_or(Duration::from_millis(100));
        let sync_interval = self.sync_interval.unwrap_or(Duration::from_secs(5));
        let full_sync_interval = self.full_sync_interval.unwrap_or(Duration::from_secs(300));
        for (field, d) in [
            ("fast_interval", fast_interval),
            ("sync_interval", sync_interval),
            ("full_sync_interval", full_sync_interval),
        ] {
            if d.is_zero() {
                return Err(ConfigError::new(field, "must be above 0"));
            }
        }
        // Pushes are also the sidecar's heartbeat (every 500 ms at most): a
        // router reclaims the slot of a worker silent 2 s when it needs one.
        if fast_interval > Duration::from_secs(1) {
            return Err(ConfigError::new("fast_interval", "must be at most 1s (pushes are the heartbeat)"));
        }
        if let Some(t) = &self.internal_token {
            kvroute_shared::wire::check_token(t).map_err(|m| ConfigError::new("internal_token", m))?;
        }
        let block_size = self
            .block_size
            .map(|b| BlockSize::new(b).map_err(|e| ConfigError::new("block_size", e.to_string())))
            .transpose()?;
        let model = match self.model {
            Some(m) if m.is_empty() || m.len() > MAX_MODEL_NAME_LEN => {
                return Err(ConfigError::new("model", format!("must be 1 to {MAX_MODEL_NAME_LEN} bytes")));
            }
            m => m.map(ModelName::new),
        };
        if self.engine_api_key.as_deref().is_some_and(|k| k.is_empty() || k.chars().any(char::is_whitespace)) {
            return Err(ConfigError::new("engine_api_key", "must be non-empty, without whitespace"));
        }
        // With none it would follow its engine, report healthy and tell no one.
        if routers.is_empty() {
            return Err(ConfigError::new(
                "router",
                "none given: list every router replica (--router URL, or KVROUTE_SIDECAR_ROUTER=URL,URL)",
            ));
        }
        Ok(Config {
            worker_id: WorkerId::new(worker_id),
            engine_url,
            engine_api_key: self.engine_api_key.map(Secret),
            advertise_url,
            model,
            events,
            replay,
            // ZMQ subscriptions are prefixes: "" receives vLLM's default topic
            // (also "") and any other, so defaults on both sides just work.
            topic: self.topic.unwrap_or_default(),
            targets,
            routers,
            internal_token: self.internal_token.map(Secret),
            fast_interval,
            sync_interval,
            full_sync_interval,
            block_size,
            engine_snapshot,
            max_pending_changes: self.max_pending_changes.unwrap_or(1 << 20),
            tls_ca: self.tls_ca.map(std::path::PathBuf::from),
        })
    }
}

/// Accepts `["a", "b"]` or `"a,b"`: the environment can only give a string,
/// and parsing it generically would turn a numeric-looking token into a number.
fn list_or_commas<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrString {
        List(Vec<String>),
        String(String),
    }
    Ok(match ListOrString::deserialize(d)? {
        ListOrString::List(v) => v,
        ListOrString::String(s) => s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect(),
    })
}

/// The routers' rule for a URL: `http(s)`, a host, no credentials, query
/// or fragment (credentials would be logged and shown in metrics labels).
fn http_url(field: &'static str, s: String) -> Result<String, ConfigError> {
    kvroute_shared::wire::check_http_url(&s)
        .map_err(|why| ConfigError::new(field, format!("{s:?} is not an http:// or https:// URL with a host: {why}")))
}

/// A `tcp://HOST:PORT` ZMQ endpoint, where data-parallel rank *r* is at
/// port + *r* as vLLM binds them; or a comma-separated list, one endpoint per
/// rank (ranks behind separate addresses, or ports that are not consecutive).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ZmqEndpoint {
    /// `(host, port)`: one base, or one per rank.
    endpoints: Vec<(String, u16)>,
}

impl ZmqEndpoint {
    pub fn parse(field: &'static str, s: &str) -> Result<Self, ConfigError> {
        let bad =
            || ConfigError::new(field, format!("{s:?} is not tcp://HOST:PORT (or a comma-separated list of them)"));
        let mut endpoints = Vec::new();
        for one in s.split(',') {
            let rest = one.trim().strip_prefix("tcp://").ok_or_else(bad)?;
            let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
            let port = port.parse().map_err(|_| bad())?;
            if host.is_empty() {
                return Err(bad());
            }
            // vLLM binds `tcp://*:5557`; the sidecar connects, and `*` is
            // no address to connect to (it warned about failed connects for ever).
            if host == "*" {
                return Err(ConfigError::new(
                    field,
                    format!(
                        "{s:?}: the sidecar connects to the engine: give its address (tcp://127.0.0.1:{port}), not *"
                    ),
                ));
            }
            endpoints.push((host.to_owned(), port));
        }
        Ok(ZmqEndpoint { endpoints })
    }

    /// How many endpoints were listed (1: a base that ranks offset).
    pub fn listed(&self) -> usize {
        self.endpoints.len()
    }

    /// The host and port of data-parallel rank `rank`'s endpoint: a single
    /// base offset by the rank (as vLLM binds them), or the rank's own.
    fn host_port(&self, rank: u32) -> (&str, u32) {
        match self.endpoints.as_slice() {
            [(host, port)] => (host, u32::from(*port) + rank),
            many => {
                let (host, port) = &many[rank as usize];
                (host, u32::from(*port))
            }
        }
    }

    /// The port of data-parallel rank `rank`'s endpoint.
    pub fn port_for_rank(&self, rank: u32) -> u32 {
        self.host_port(rank).1
    }

    /// The endpoint of data-parallel rank `rank`.
    pub fn for_rank(&self, rank: u32) -> String {
        let (host, port) = self.host_port(rank);
        format!("tcp://{host}:{port}")
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (host, port)) in self.endpoints.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}tcp://{host}:{port}")?;
        }
        Ok(())
    }
}

/// One routing target this sidecar reports: a data-parallel rank of the
/// engine (rank 0 of an engine without data parallelism).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankTarget {
    /// Which rank's events, replay and snapshot ports (vLLM: base + rank).
    pub rank: u32,
    /// The id routers know it by.
    pub worker_id: WorkerId,
    /// Sent to routers as the sync's `dp_rank`: the rank behind the
    /// advertised URL, pinned with `X-data-parallel-rank`. `None` when the
    /// URL is this target alone.
    pub dp_rank: Option<u32>,
}

/// The targets a sidecar reports (DESIGN.md §6):
/// - no data parallelism: the engine, as `worker_id`;
/// - `data_parallel_rank` R (vLLM's external load balancing, where each rank
///   has its own API server, so one sidecar per rank): rank R, as
///   `worker_id`, reached at its own URL;
/// - `data_parallel_size` N without a rank (internal load balancing: one API
///   server for every rank): every rank r as `{worker_id}-dp{r}`, reached at
///   the one URL with `X-data-parallel-rank: r`.
fn rank_targets(worker_id: &str, size: u32, rank: Option<u32>) -> Result<Vec<RankTarget>, ConfigError> {
    let plain = |rank| RankTarget { rank, worker_id: WorkerId::new(worker_id), dp_rank: None };
    match rank {
        Some(r) if r >= MAX_DP_RANKS => {
            Err(ConfigError::new("data_parallel_rank", format!("must be below {MAX_DP_RANKS}")))
        }
        Some(r) if size > 1 && r >= size => {
            Err(ConfigError::new("data_parallel_rank", format!("{r} is not a rank of data_parallel_size {size}")))
        }
        Some(r) => Ok(vec![plain(r)]),
        None if size == 1 => Ok(vec![plain(0)]),
        None => {
            let longest = format!("{worker_id}-dp{}", size - 1);
            if longest.len() > MAX_WORKER_ID_LEN {
                return Err(ConfigError::new(
                    "worker_id",
                    format!("with data_parallel_size {size} the rank ids ({longest}) exceed {MAX_WORKER_ID_LEN} bytes"),
                ));
            }
            Ok((0..size)
                .map(|r| RankTarget {
                    rank: r,
                    worker_id: WorkerId::new(format!("{worker_id}-dp{r}")),
                    dp_rank: Some(r),
                })
                .collect())
        }
    }
}

/// A secret that never shows in logs.
#[derive(Clone)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub worker_id: WorkerId,
    /// vLLM's HTTP base URL (`/v1/models`, `/metrics`).
    pub engine_url: String,
    /// vLLM's `--api-key`, if it has one.
    pub engine_api_key: Option<Secret>,
    /// Where routers should send this worker's requests.
    pub advertise_url: String,
    /// Base model; `None` = the first model the engine lists.
    pub model: Option<ModelName>,
    pub events: ZmqEndpoint,
    pub replay: Option<ZmqEndpoint>,
    /// ZMQ topic prefix to subscribe to; empty = all.
    pub topic: String,
    /// What this sidecar reports to routers: one target per followed rank.
    pub targets: Vec<RankTarget>,
    /// Router base URLs; a DNS name stands for every address of one family it
    /// resolves to (`kvroute_shared::resolve`).
    pub routers: Vec<String>,
    pub internal_token: Option<Secret>,
    pub fast_interval: Duration,
    /// The slow loop: engine snapshot, router re-resolution, and full syncs
    /// to routers that speak only protocol v1.
    pub sync_interval: Duration,
    /// Full syncs to v2 routers when no digest mismatch asked for one (a
    /// safety net; `5s` restores the paper's constant snapshots).
    pub full_sync_interval: Duration,
    /// `None` = read from the engine's `vllm:cache_config_info`, else 16.
    pub block_size: Option<BlockSize>,
    /// The python hook's snapshot endpoint (rank 0; + rank for others).
    pub engine_snapshot: Option<ZmqEndpoint>,
    /// Extra CA roots for `https://` routers.
    pub tls_ca: Option<std::path::PathBuf>,
    /// Unsent changes per router before it is switched to a full sync.
    pub max_pending_changes: usize,
}

/// A configuration value that is missing or malformed.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration `{field}`: {message}")]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
}

impl ConfigError {
    fn new(field: &'static str, message: impl Into<String>) -> Self {
        ConfigError { field, message: message.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_rank_ports() {
        let raw = RawConfig {
            events: Some("tcp://10.0.0.1:5557".into()),
            router: vec!["http://r:8080".into()],
            ..RawConfig::default()
        };
        let c = raw.validate("host-1").unwrap();
        assert_eq!(c.worker_id.as_str(), "host-1");
        assert_eq!(c.engine_url, "http://127.0.0.1:8000");
        assert_eq!(c.advertise_url, c.engine_url);
        assert_eq!(c.topic, "", "vLLM's default topic is empty; an empty prefix receives every topic");
        assert_eq!(c.fast_interval, Duration::from_millis(100));
        assert_eq!(c.events.for_rank(2), "tcp://10.0.0.1:5559");
        assert_eq!(format!("{:?}", Secret("x".into())), "***");
    }

    #[test]
    fn bad_values_name_the_field() {
        let e = RawConfig::default().validate("h").unwrap_err();
        assert_eq!(e.field, "events");
        let raw = RawConfig { events: Some("tcp://h:1".into()), router: vec!["r:1".into()], ..RawConfig::default() };
        assert_eq!(raw.validate("h").unwrap_err().field, "router");
        let raw = RawConfig { events: Some("tcp://h:1".into()), block_size: Some(0), ..RawConfig::default() };
        assert_eq!(raw.validate("h").unwrap_err().field, "block_size");
        let raw = RawConfig { events: Some("tcp://h:1".into()), ..RawConfig::default() };
        let e = raw.validate("h").unwrap_err();
        assert!(e.field == "router" && e.message.contains("KVROUTE_SIDECAR_ROUTER"), "{e}");
        let events = || Some("tcp://h:1".to_owned());
        let zero = Some(Duration::ZERO);
        for (field, raw) in [
            ("sync_interval", RawConfig { events: events(), sync_interval: zero, ..RawConfig::default() }),
            ("full_sync_interval", RawConfig { events: events(), full_sync_interval: zero, ..RawConfig::default() }),
            (
                "fast_interval",
                RawConfig { events: events(), fast_interval: Some(Duration::from_secs(3)), ..RawConfig::default() },
            ),
            (
                "internal_token",
                RawConfig { events: events(), internal_token: Some("short".into()), ..RawConfig::default() },
            ),
            ("events", RawConfig { events: Some("tcp://*:5557".into()), ..RawConfig::default() }),
            ("model", RawConfig { events: events(), model: Some("m".repeat(1025)), ..RawConfig::default() }),
            ("router", RawConfig { events: events(), router: vec!["http://".into()], ..RawConfig::default() }),
            (
                "advertise_url",
                RawConfig { events: events(), advertise_url: Some("http://u:p@h:1".into()), ..RawConfig::default() },
            ),
        ] {
            assert_eq!(raw.validate("h").unwrap_err().field, field);
        }
        let e = RawConfig { events: Some("tcp://*:5557".into()), ..RawConfig::default() }.validate("h").unwrap_err();
        assert!(e.message.contains("tcp://127.0.0.1:5557"), "{e}");
    }

    #[test]
    fn data_parallel_ranks_become_targets() {
        let cfg = |size, rank, events: &str| {
            RawConfig {
                worker_id: Some("eng".into()),
                events: Some(events.into()),
                data_parallel_size: size,
                data_parallel_rank: rank,
                router: vec!["http://r:8080".into()],
                ..RawConfig::default()
            }
            .validate("h")
        };
        let ids =
            |c: Config| c.targets.into_iter().map(|t| (t.worker_id.to_string(), t.rank, t.dp_rank)).collect::<Vec<_>>();
        assert_eq!(ids(cfg(None, None, "tcp://h:1").unwrap()), [("eng".into(), 0, None)]);
        // Internal load balancing: every rank behind the one URL, pinned by header.
        let internal = cfg(Some(2), None, "tcp://h:5557").unwrap();
        assert_eq!(
            (internal.events.for_rank(0), internal.events.for_rank(1)),
            ("tcp://h:5557".into(), "tcp://h:5558".into())
        );
        assert_eq!(ids(internal), [("eng-dp0".into(), 0, Some(0)), ("eng-dp1".into(), 1, Some(1))]);
        // External load balancing: this rank alone, at its own URL.
        assert_eq!(ids(cfg(Some(4), Some(3), "tcp://h:1").unwrap()), [("eng".into(), 3, None)]);
        assert_eq!(cfg(Some(2), Some(2), "tcp://h:1").unwrap_err().field, "data_parallel_rank");
        // Ranks at ports that are not consecutive are listed one by one.
        let listed = cfg(Some(2), None, "tcp://a:9, tcp://b:7").unwrap();
        assert_eq!((listed.events.for_rank(0), listed.events.for_rank(1)), ("tcp://a:9".into(), "tcp://b:7".into()));
        assert_eq!(cfg(Some(3), None, "tcp://a:9,tcp://b:7").unwrap_err().field, "events");
        // Ranks whose sockets would be bound on one port are refused, naming both.
        let ports = |size, rank, replay: &str, snapshot: Option<&str>| {
            RawConfig {
                events: Some("tcp://h:5557".into()),
                replay: Some(replay.into()),
                engine_snapshot: snapshot.map(Into::into),
                data_parallel_size: Some(size),
                data_parallel_rank: rank,
                router: vec!["http://r:8080".into()],
                ..RawConfig::default()
            }
            .validate("h")
        };
        let e = ports(2, None, "tcp://h:5558", None).unwrap_err();
        assert!(e.field == "replay" && e.message.contains("rank 1's events"), "{e}");
        let e = ports(4, None, "tcp://h:6557", Some("tcp://h:5560")).unwrap_err();
        assert!(e.field == "engine_snapshot" && e.message.contains("rank 3's events"), "{e}");
        assert!(ports(4, None, "tcp://h:6557", Some("tcp://h:7557")).is_ok());
        // One rank of several (external load balancing): only its own
        // sockets, the others' engines being elsewhere or their own concern.
        assert!(ports(2, Some(1), "tcp://h:5558", None).is_ok());
        assert!(ports(2, Some(1), "tcp://h:5557", None).unwrap_err().message.contains("rank 1's events"));
    }

    #[test]
    fn flags_override_lower_layers() {
        let hi = RawConfig { topic: Some("a".into()), ..RawConfig::default() };
        let lo = RawConfig { topic: Some("b".into()), model: Some("m".into()), ..RawConfig::default() };
        let m = hi.or(lo);
        assert_eq!((m.topic.as_deref(), m.model.as_deref()), (Some("a"), Some("m")));
    }
}
