//! Command-line flags and how they layer over the config file and the
//! environment: file < `KVROUTE_*` env < flags. `main` passes the process
//! environment in; nothing here reads it.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use config::{Config as Layers, File, FileFormat};

use crate::config::RawConfig;

#[derive(Debug, Parser)]
#[command(name = "kvroute-router", version, about = "Prefix-cache-aware router for vLLM workers")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the token ids and block keys the router computes for an OpenAI
    /// request body read from stdin (compare with vLLM's /tokenize).
    Tokenize(TokenizeArgs),
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// Model directory with tokenizer.json (+ tokenizer_config.json for chat).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// The router's `max_prompt_tokens` (the engine's max_model_len): what
    /// `truncate_prompt_tokens: -1` keeps (one token less for a request that
    /// generates).
    #[arg(long, default_value_t = 262_144)]
    pub max_prompt_tokens: usize,
    /// The engines' --default-chat-template-kwargs (a JSON object), as the
    /// server takes it.
    #[arg(long, value_name = "JSON")]
    pub default_chat_template_kwargs: Option<String>,
    /// The engines run with --exclude-tools-when-tool-choice-none.
    #[arg(long)]
    pub exclude_tools_when_tool_choice_none: bool,
}

/// Flags of the server. Each one, when given, overrides the file and env.
#[derive(Debug, Default, Args)]
pub struct ServeArgs {
    /// TOML config file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to serve on [default: 127.0.0.1:8080].
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["host", "port"])]
    pub listen: Option<String>,
    /// vllm-router/SMG spelling of --listen: the host part [default: 127.0.0.1].
    #[arg(long, value_name = "HOST")]
    pub host: Option<String>,
    /// vllm-router/SMG spelling of --listen: the port part [default: 8080].
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// Also serve /metrics (plain HTTP, nothing else) on this address; /metrics
    /// stays on the main listener too [default: none].
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["prometheus_port", "prometheus_host"])]
    pub metrics_listen: Option<String>,
    /// vllm-router/SMG spelling of --metrics-listen: the port part (turns the
    /// metrics listener on).
    #[arg(long, value_name = "PORT")]
    pub prometheus_port: Option<u16>,
    /// vllm-router/SMG spelling of --metrics-listen: the host part
    /// [default: 127.0.0.1]; needs --prometheus-port.
    #[arg(long, value_name = "HOST", requires = "prometheus_port")]
    pub prometheus_host: Option<String>,
    /// A static worker, ID=URL (repeatable); ID=URL#dp-rank=R for data-parallel
    /// rank R behind a URL serving every rank (sent as X-data-parallel-rank).
    /// Sidecars register others.
    #[arg(long = "worker", value_name = "ID=URL")]
    pub workers: Vec<String>,
    /// vllm-router/SMG spelling: static workers by URL alone (space-separated
    /// or repeated); each worker's id is its URL's host:port.
    #[arg(long = "worker-urls", value_name = "URL", num_args = 1..)]
    pub worker_urls: Vec<String>,
    /// Another replica of this router (repeatable): they exchange what they
    /// have in flight per worker every --replica-exchange-interval. One link
    /// per pair suffices; listing every replica, this one included, works too.
    #[arg(long = "replica", value_name = "URL")]
    pub replicas: Vec<String>,
    /// How often to report to each replica [default: 100ms].
    #[arg(long, value_name = "DURATION")]
    pub replica_exchange_interval: Option<String>,
    /// Between full reports, tell each replica this router's new per-worker
    /// figures once this long after the last report when it routes a
    /// request; 0 for full reports only [default: 10ms].
    #[arg(long, value_name = "DURATION")]
    pub replica_news_interval: Option<String>,
    /// Log level or filter, e.g. `debug` or `kvroute_router=debug` [env:
    /// KVROUTE_LOG; default: info].
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Log line format [env: KVROUTE_LOG_FORMAT; default: text].
    #[arg(long, value_name = "FORMAT", value_parser = ["text", "json"])]
    pub log_format: Option<String>,
    /// Tokenizer directory for every model without its own --model-tokenizer
    /// [default: none: prompts are keyed by their bytes, an approximation].
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// A model's own tokenizer directory, MODEL=DIR (repeatable).
    #[arg(long = "model-tokenizer", value_name = "MODEL=DIR")]
    pub model_tokenizers: Vec<String>,
    /// The engines' --default-chat-template-kwargs (a JSON object, e.g.
    /// '{"enable_thinking": false}'): chats are rendered as the engines
    /// render them [default: none].
    #[arg(long, value_name = "JSON")]
    pub default_chat_template_kwargs: Option<String>,
    /// The engines run with --exclude-tools-when-tool-choice-none: a chat
    /// with tool_choice "none" is rendered without its tools.
    #[arg(long)]
    pub exclude_tools_when_tool_choice_none: bool,
    /// Tokens per KV block; must equal the engines' --block-size [default: 16].
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Routing policy [default: predicted_ttft].
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(crate::policy::POLICY_NAMES.iter().copied()))]
    pub policy: Option<String>,
    /// Bearer token required on /debug/* and /admin/* (≥ 16 characters) [default: none, open].
    #[arg(long, value_name = "TOKEN")]
    pub admin_token: Option<String>,
    /// Bearer token sidecars and router replicas must present on /internal/*
    /// (≥ 16 characters).
    #[arg(long, value_name = "TOKEN")]
    pub internal_token: Option<String>,
    /// Serve /internal/* without a token on a non-loopback address.
    #[arg(long)]
    pub allow_insecure_internal: bool,
    /// How long an unconfirmed speculative entry lives [default: 10s].
    #[arg(long, value_name = "DURATION")]
    pub speculative_ttl: Option<String>,
    /// Interval of active health checks [default: 2s].
    #[arg(long, value_name = "DURATION")]
    pub health_check_interval: Option<String>,
    /// Other workers tried when an attempt fails before any byte was sent; after two server failures the request may have caused (5xx, dropped, broken), no third [default: 2].
    #[arg(long)]
    pub retries: Option<u32>,
    /// Time allowed for a non-streamed answer (vLLM sends it whole) and a queued stream's first token [default: 3600s].
    #[arg(long, value_name = "DURATION")]
    pub first_byte_timeout: Option<String>,
    /// Largest request body in bytes [default: 16777216].
    #[arg(long)]
    pub max_body_bytes: Option<u64>,
    /// Requests in flight before new ones are shed with 503 [default: 4096].
    #[arg(long)]
    pub max_concurrent_requests: Option<u64>,
    /// Serve HTTPS: PEM certificate chain (with --tls-key).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle trusted for https:// workers.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Any config-file key, dotted for a table's (`predicted_ttft.room_ratio=0`);
    /// repeatable, applied over everything else.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

/// Top-level keys that `KVROUTE_<KEY>` may set (lists are comma-separated):
/// every scalar of [`RawConfig`] (test `the_limits_have_their_variables_too`).
/// Other `KVROUTE_` variables belong to the scripts and the vLLM plugin.
const ENV_KEYS: &[&str] = &[
    "listen",
    "metrics_listen",
    "workers",
    "replicas",
    "replica_exchange_interval",
    "replica_news_interval",
    "tokenizer",
    "block_size",
    "policy",
    "internal_token",
    "admin_token",
    "allow_insecure_internal",
    "speculative_ttl",
    "health_check_interval",
    "health_check_timeout",
    "eject_after_failures",
    "worker_expiry",
    "retries",
    "connect_timeout",
    "first_byte_timeout",
    "idle_timeout",
    "body_read_timeout",
    "header_read_timeout",
    "keep_alive_timeout",
    "max_connections",
    "first_token_timeout",
    "first_token_timeout_per_1k_tokens",
    "max_body_bytes",
    "max_body_bytes_in_flight",
    "max_messages",
    "max_prompt_tokens",
    "default_chat_template_kwargs",
    "exclude_tools_when_tool_choice_none",
    "max_concurrent_requests",
    "approx_capacity_blocks",
    "session_ttl",
    "head_tokens",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "consistent_hash_load_factor",
    "worker_tokens_file",
    "max_sessions",
    "max_session_ttl",
    "max_sync_keys",
    "max_internal_body_bytes",
    "shutdown_grace",
    "drain_delay",
];

/// `KVROUTE_` variables of the project's other programs (the sidecar, the
/// vLLM plugin, scripts and tests), which the router leaves alone.
const OTHERS_ENV: &[&str] = &[
    "LOG",
    "LOG_FORMAT",
    "SIDECAR_",
    "HOOKS_",
    "SNAPSHOT_ENDPOINT",
    "IMAGE",
    "COMMIT",
    "PYTHON",
    "VLLM_",
    "TINY_",
    "CONFORMANCE_",
];

/// The `KVROUTE_` variables in `env` that the router does not read and no
/// other kvroute program does: most likely a misspelt key
/// (`KVROUTE_BLOCKSIZE`), which would otherwise be dropped without a word
/// (an unknown key in the file is an error).
pub fn unknown_env(env: impl IntoIterator<Item = (String, String)>) -> Vec<String> {
    let mut unknown: Vec<String> = env
        .into_iter()
        .filter_map(|(k, _)| {
            let rest = k.strip_prefix("KVROUTE_")?;
            let known = ENV_KEYS.contains(&rest.to_ascii_lowercase().as_str())
                || OTHERS_ENV.iter().any(|o| if o.ends_with('_') { rest.starts_with(o) } else { rest == *o });
            (!known).then_some(k)
        })
        .collect();
    unknown.sort();
    unknown
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("config: {0}")]
    Config(#[from] config::ConfigError),
    #[error("--model-tokenizer {0:?} is not MODEL=DIR")]
    ModelTokenizer(String),
    #[error("--worker-urls {0:?} is not an http(s) URL with a host")]
    WorkerUrl(String),
    #[error("--set {0:?} is not KEY=VALUE")]
    Set(String),
}

/// `HOST:PORT` from the peers' separate host and port flags (host default
/// loopback); an IPv6 host gets the brackets a socket address needs.
fn socket_addr(host: Option<&str>, port: u16) -> String {
    let host = host.unwrap_or("127.0.0.1");
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// `--worker-urls URL`: the worker's id is the URL's `host:port`, stable
/// across restarts and independent of the order URLs are given in.
fn worker_from_url(url: &str) -> Result<String, CliError> {
    let bad = || CliError::WorkerUrl(url.to_owned());
    let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://")).ok_or_else(bad)?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return Err(bad());
    }
    Ok(format!("{authority}={url}"))
}

impl ServeArgs {
    /// Layers file, env and flags into one raw config.
    pub fn load(&self, env: impl IntoIterator<Item = (String, String)>) -> Result<RawConfig, CliError> {
        let mut b = Layers::builder();
        if let Some(path) = &self.config {
            b = b.add_source(File::from(path.as_path()).format(FileFormat::Toml));
        }
        for (k, v) in env {
            let Some(key) = k.strip_prefix("KVROUTE_").map(str::to_ascii_lowercase) else { continue };
            if !ENV_KEYS.contains(&key.as_str()) {
                continue;
            }
            b = if key == "workers" || key == "replicas" {
                b.set_override(key, v.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect::<Vec<_>>())?
            } else {
                b.set_override(key, v)?
            };
        }
        let mut set = |key: &str, v: Option<config::Value>| -> Result<(), CliError> {
            if let Some(v) = v {
                b = std::mem::take(&mut b).set_override(key, v)?;
            }
            Ok(())
        };
        let listen = match (&self.listen, &self.host, self.port) {
            (Some(l), _, _) => Some(l.clone()),
            (None, None, None) => None,
            (None, host, port) => Some(socket_addr(host.as_deref(), port.unwrap_or(8080))),
        };
        set("listen", listen.map(Into::into))?;
        let metrics_listen = match (&self.metrics_listen, self.prometheus_port) {
            (Some(l), _) => Some(l.clone()),
            (None, Some(port)) => Some(socket_addr(self.prometheus_host.as_deref(), port)),
            (None, None) => None,
        };
        set("metrics_listen", metrics_listen.map(Into::into))?;
        let mut workers = self.workers.clone();
        for url in self.worker_urls.iter().flat_map(|s| s.split_whitespace()) {
            workers.push(worker_from_url(url)?);
        }
        set("workers", (!workers.is_empty()).then(|| workers.into()))?;
        set("replicas", (!self.replicas.is_empty()).then(|| self.replicas.clone().into()))?;
        set("replica_exchange_interval", self.replica_exchange_interval.clone().map(Into::into))?;
        set("replica_news_interval", self.replica_news_interval.clone().map(Into::into))?;
        set("tokenizer", self.tokenizer.as_ref().map(|p| p.display().to_string().into()))?;
        set("block_size", self.block_size.map(|n| i64::from(n).into()))?;
        set("default_chat_template_kwargs", self.default_chat_template_kwargs.clone().map(Into::into))?;
        set("exclude_tools_when_tool_choice_none", self.exclude_tools_when_tool_choice_none.then_some(true.into()))?;
        set("policy", self.policy.clone().map(Into::into))?;
        set("internal_token", self.internal_token.clone().map(Into::into))?;
        set("admin_token", self.admin_token.clone().map(Into::into))?;
        set("allow_insecure_internal", self.allow_insecure_internal.then_some(true.into()))?;
        set("speculative_ttl", self.speculative_ttl.clone().map(Into::into))?;
        set("health_check_interval", self.health_check_interval.clone().map(Into::into))?;
        set("retries", self.retries.map(|n| i64::from(n).into()))?;
        set("first_byte_timeout", self.first_byte_timeout.clone().map(Into::into))?;
        set("max_body_bytes", self.max_body_bytes.map(|n| (n as i64).into()))?;
        set("max_concurrent_requests", self.max_concurrent_requests.map(|n| (n as i64).into()))?;
        for (key, path) in [("tls_cert", &self.tls_cert), ("tls_key", &self.tls_key), ("tls_ca", &self.tls_ca)] {
            set(key, path.as_ref().map(|p| p.display().to_string().into()))?;
        }
        // `--model-tokenizer` pairs go in after the rest is read, not as
        // override paths: a path's keys are `[A-Za-z0-9_-]`, and served
        // model names hold `/` and `.` (`Qwen/Qwen2.5-7B` failed to parse,
        // `qwen2.5-7b` became a nested table).
        let mut model_tokenizers = Vec::new();
        for spec in &self.model_tokenizers {
            match spec.split_once('=') {
                Some((model, dir)) if !model.is_empty() && !dir.is_empty() => {
                    model_tokenizers.push((model.to_owned(), PathBuf::from(dir)));
                }
                _ => return Err(CliError::ModelTokenizer(spec.clone())),
            }
        }
        for kv in &self.sets {
            match kv.split_once('=') {
                Some((key, value)) if !key.is_empty() && key.split('.').all(|k| !k.is_empty()) => {
                    set(key, Some(value.to_owned().into()))?;
                }
                _ => return Err(CliError::Set(kv.clone())),
            }
        }
        let mut raw: RawConfig = b.build()?.try_deserialize()?;
        raw.tokenizers.extend(model_tokenizers);
        Ok(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_reaches_any_key_and_misspellings_fail() {
        let parse = |sets: &[&str]| {
            let argv = ["kvroute-router"].into_iter().chain(sets.iter().flat_map(|s| ["--set", s]));
            Cli::try_parse_from(argv).unwrap().serve.load(Vec::new())
        };
        let raw = parse(&["predicted_ttft.room_ratio=0", "retries=5", "policy=round_robin"]).unwrap();
        assert_eq!((raw.retries, raw.policy.as_str()), (5, "round_robin"));
        assert_eq!(raw.predicted_ttft.room_ratio, 0.0);
        assert_ne!(crate::policy::PredictedTtftParams::default().room_ratio, 0.0);
        assert!(matches!(parse(&["retries"]), Err(CliError::Set(_))));
        assert!(matches!(parse(&["predicted_ttft..x=1"]), Err(CliError::Set(_))));
        assert!(parse(&["predicted_ttft.room_ration=0"]).is_err(), "an unknown key is refused");
    }

    #[test]
    fn model_tokenizers_take_served_model_names_as_they_are() {
        let parse = |specs: &[&str]| {
            let argv = ["kvroute-router"].into_iter().chain(specs.iter().flat_map(|s| ["--model-tokenizer", s]));
            Cli::try_parse_from(argv).unwrap().serve.load(Vec::new())
        };
        let raw = parse(&["Qwen/Qwen2.5-7B-Instruct=/models/qwen", "llama-3.1-8b=/models/llama=v2"]).unwrap();
        let dirs: Vec<(&str, &str)> = raw.tokenizers.iter().map(|(m, d)| (m.as_str(), d.to_str().unwrap())).collect();
        assert_eq!(dirs, [("Qwen/Qwen2.5-7B-Instruct", "/models/qwen"), ("llama-3.1-8b", "/models/llama=v2")]);
        for bad in ["qwen", "=/models/qwen", "qwen="] {
            assert!(matches!(parse(&[bad]), Err(CliError::ModelTokenizer(_))), "{bad}");
        }
    }

    #[test]
    fn peer_spellings_host_port_and_worker_urls() {
        let cli = Cli::try_parse_from([
            "kvroute-router",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--worker-urls",
            "http://10.0.0.1:8000",
            "http://vllm-b:8000/",
            "--worker",
            "c=http://10.0.0.3:8000",
        ])
        .unwrap();
        let raw = cli.serve.load(Vec::new()).unwrap();
        assert_eq!(raw.listen.to_string(), "0.0.0.0:9000");
        assert_eq!(
            raw.workers,
            ["c=http://10.0.0.3:8000", "10.0.0.1:8000=http://10.0.0.1:8000", "vllm-b:8000=http://vllm-b:8000/"]
        );
        let v6 = Cli::try_parse_from(["kvroute-router", "--host", "::1"]).unwrap().serve.load(Vec::new()).unwrap();
        assert_eq!(v6.listen.to_string(), "[::1]:8080");
        assert!(Cli::try_parse_from(["kvroute-router", "--listen", "127.0.0.1:1", "--port", "2"]).is_err());
        let bad = Cli::try_parse_from(["kvroute-router", "--worker-urls", "vllm:8000"]).unwrap();
        assert!(matches!(bad.serve.load(Vec::new()), Err(CliError::WorkerUrl(_))));
    }

    #[test]
    fn metrics_listener_and_its_peer_spelling() {
        let load = |args: &[&str]| {
            let argv = std::iter::once("kvroute-router").chain(args.iter().copied());
            Cli::try_parse_from(argv).map(|cli| cli.serve.load(Vec::new()).unwrap().metrics_listen)
        };
        assert_eq!(load(&[]).unwrap(), None);
        assert_eq!(load(&["--metrics-listen", "0.0.0.0:9090"]).unwrap(), Some("0.0.0.0:9090".parse().unwrap()));
        assert_eq!(load(&["--prometheus-port", "29000"]).unwrap(), Some("127.0.0.1:29000".parse().unwrap()));
        assert_eq!(
            load(&["--prometheus-host", "::", "--prometheus-port", "29000"]).unwrap(),
            Some("[::]:29000".parse().unwrap())
        );
        // A host alone says nothing about a port; two spellings at once are ambiguous.
        assert!(load(&["--prometheus-host", "0.0.0.0"]).is_err());
        assert!(load(&["--metrics-listen", "127.0.0.1:1", "--prometheus-port", "2"]).is_err());
        let env = [("KVROUTE_METRICS_LISTEN".to_string(), "127.0.0.1:9191".to_string())];
        assert_eq!(ServeArgs::default().load(env).unwrap().metrics_listen, Some("127.0.0.1:9191".parse().unwrap()));
    }

    #[test]
    fn flags_beat_env_beat_file() {
        let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("router.toml");
        std::fs::write(
            &file,
            "policy = \"round_robin\"\nretries = 5\nblock_size = 32\n[cache_aware]\nload_weight = 2.0\n\
             [predicted_ttft]\nimposed_cap_us = inf\n",
        )
        .unwrap();
        let args = ServeArgs { config: Some(file), policy: Some("least_loaded".into()), ..Default::default() };
        let env = [("KVROUTE_RETRIES".to_string(), "7".to_string()), ("KVROUTE_POLICY".into(), "power_of_two".into())];
        let raw = args.load(env).unwrap();
        assert_eq!(raw.policy, "least_loaded");
        assert_eq!(raw.retries, 7);
        assert_eq!(raw.block_size, 32);
        assert_eq!(raw.cache_aware.load_weight, 2.0);
        // README: `inf` removes the cap.
        assert_eq!(raw.predicted_ttft.imposed_cap_us, f64::INFINITY);
        raw.validate().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn env_lists_and_durations() {
        let env = [
            ("KVROUTE_WORKERS".to_string(), "a=http://x:1,b=http://y:2".to_string()),
            ("KVROUTE_SPECULATIVE_TTL".into(), "3s".into()),
            ("KVROUTE_SIDECAR_WORKER_ID".into(), "ignored".into()),
        ];
        let raw = ServeArgs::default().load(env).unwrap();
        assert_eq!(raw.workers.len(), 2);
        let env = [
            ("KVROUTE_REPLICAS".to_string(), "http://r1:8080,http://r2:8080".to_string()),
            ("KVROUTE_REPLICA_EXCHANGE_INTERVAL".into(), "250ms".into()),
            ("KVROUTE_REPLICA_NEWS_INTERVAL".into(), "0s".into()),
        ];
        let listed = ServeArgs::default().load(env).unwrap();
        assert_eq!(listed.replica_news_interval, std::time::Duration::ZERO);
        assert_eq!(listed.replicas, ["http://r1:8080", "http://r2:8080"]);
        assert_eq!(listed.replica_exchange_interval, std::time::Duration::from_millis(250));
        let argv = ["kvroute-router", "--replica", "http://r1:8080", "--replica", "http://r2:8080"];
        let flags = Cli::try_parse_from(argv).unwrap().serve.load(Vec::new()).unwrap();
        assert_eq!(flags.replicas, ["http://r1:8080", "http://r2:8080"]);
        assert_eq!(raw.speculative_ttl, std::time::Duration::from_secs(3));
    }

    /// The README names `KVROUTE_<KEY>` for every key; these were read
    /// from the file and flags only, their variables silently ignored.
    #[test]
    fn the_limits_have_their_variables_too() {
        let env = [
            ("KVROUTE_CONSISTENT_HASH_LOAD_FACTOR", "2.5"),
            ("KVROUTE_WORKER_TOKENS_FILE", "/etc/kvroute/worker-tokens"),
            ("KVROUTE_MAX_SESSIONS", "7"),
            ("KVROUTE_MAX_SESSION_TTL", "2h"),
            ("KVROUTE_MAX_SYNC_KEYS", "1000"),
            ("KVROUTE_MAX_INTERNAL_BODY_BYTES", "65536"),
            ("KVROUTE_SHUTDOWN_GRACE", "3s"),
        ];
        let raw = ServeArgs::default().load(env.map(|(k, v)| (k.to_owned(), v.to_owned()))).unwrap();
        assert_eq!(raw.consistent_hash_load_factor, 2.5);
        assert_eq!(raw.worker_tokens_file.as_deref(), Some(std::path::Path::new("/etc/kvroute/worker-tokens")));
        assert_eq!((raw.max_sessions, raw.max_sync_keys, raw.max_internal_body_bytes), (7, 1000, 65536));
        assert_eq!(raw.max_session_ttl, std::time::Duration::from_secs(7200));
        assert_eq!(raw.shutdown_grace, std::time::Duration::from_secs(3));
    }

    #[test]
    fn misspelt_variables_are_named() {
        let env = [
            ("KVROUTE_BLOCK_SIZE", "32"),
            ("KVROUTE_BLOCKSIZE", "32"),
            ("KVROUTE_LOG", "debug"),
            ("KVROUTE_SIDECAR_ROUTER", "http://r"),
            ("KVROUTE_HOOKS_DISABLE", "1"),
            ("KVROUTE_POLICY_", "x"),
            ("PATH", "/bin"),
        ];
        let unknown = unknown_env(env.map(|(k, v)| (k.to_owned(), v.to_owned())));
        assert_eq!(unknown, ["KVROUTE_BLOCKSIZE", "KVROUTE_POLICY_"]);
    }

    #[test]
    fn unknown_file_keys_fail() {
        let dir = std::env::temp_dir().join(format!("kvroute-cli-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("router.toml");
        std::fs::write(&file, "polcy = \"round_robin\"\n").unwrap();
        let err = ServeArgs { config: Some(file), ..Default::default() }.load([]).unwrap_err();
        assert!(err.to_string().contains("polcy"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
