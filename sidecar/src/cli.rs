//! Command-line flags. Each maps onto a [`RawConfig`] field; flags win over the
//! environment (`KVROUTE_SIDECAR_*`) and the config file, which `main` reads.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::config::RawConfig;

/// kvroute-sidecar: vLLM KV-cache events → kvroute routers.
#[derive(Debug, Parser)]
#[command(name = "kvroute-sidecar", version)]
pub struct Cli {
    /// Config file (TOML; keys as the flags with `_`, e.g. `sync_interval = "5s"`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// This worker's id as routers know it [default: hostname].
    #[arg(long)]
    pub worker_id: Option<String>,
    /// vLLM's HTTP base URL [default: http://127.0.0.1:8000].
    #[arg(long)]
    pub engine_url: Option<String>,
    /// vLLM's --api-key, sent as a bearer token to the engine (it guards
    /// /v1/* with it) [env: KVROUTE_SIDECAR_ENGINE_API_KEY].
    #[arg(long, value_name = "KEY")]
    pub engine_api_key: Option<String>,
    /// Log level or filter [env: KVROUTE_LOG; default: info].
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Log line format [env: KVROUTE_LOG_FORMAT; default: text].
    #[arg(long, value_name = "FORMAT", value_parser = ["text", "json"])]
    pub log_format: Option<String>,
    /// URL routers should send requests to [default: the engine URL].
    #[arg(long)]
    pub advertise_url: Option<String>,
    /// Base model name [default: the first model of the engine's /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// vLLM's KV-event PUB endpoint, tcp://HOST:PORT (rank r at port + r), or
    /// one per data-parallel rank, comma-separated (required).
    #[arg(long)]
    pub events: Option<String>,
    /// vLLM's replay (ROUTER) endpoint, tcp://HOST:PORT.
    #[arg(long)]
    pub replay: Option<String>,
    /// ZMQ topic prefix to subscribe to [default: empty = every topic, which
    /// matches vLLM's default topic "" and any topic an operator sets].
    #[arg(long)]
    pub topic: Option<String>,
    /// The engine's data-parallel ranks, vLLM's --data-parallel-size [default: 1].
    /// Without --data-parallel-rank (vLLM's internal load balancing: one API
    /// server for all ranks), every rank r is its own routing target,
    /// WORKER_ID-dpR, reached at the advertised URL with X-data-parallel-rank.
    /// Rank r's events, replay and snapshot endpoints are base port + r.
    #[arg(long)]
    pub data_parallel_size: Option<u32>,
    /// Follow only this rank, reported as WORKER_ID at its own URL: vLLM's
    /// external load balancing, where each rank has its own API server (run a
    /// sidecar per rank).
    #[arg(long)]
    pub data_parallel_rank: Option<u32>,
    /// Router base URL (required; repeatable; a DNS name means all its
    /// addresses, IPv4 ones when it has any).
    #[arg(long)]
    pub router: Vec<String>,
    /// Bearer token for the routers' /internal endpoints (≥ 16 characters).
    #[arg(long)]
    pub internal_token: Option<String>,
    /// Change push interval: the stores, evictions, load and heartbeat
    /// pushed to /internal/eviction [default: 100ms].
    #[arg(long, value_parser = humantime_serde::re::humantime::parse_duration)]
    pub fast_interval: Option<Duration>,
    /// Slow-loop interval: engine snapshot, router re-resolution, and the
    /// full sync to routers that speak only protocol v1 [default: 5s].
    #[arg(long, value_parser = humantime_serde::re::humantime::parse_duration)]
    pub sync_interval: Option<Duration>,
    /// Full sync to protocol-v2 routers when no digest mismatch asked for one
    /// earlier: a safety net; 5s restores the paper's constant snapshots
    /// [default: 5m].
    #[arg(long, value_parser = humantime_serde::re::humantime::parse_duration)]
    pub full_sync_interval: Option<Duration>,
    /// Engine block size [default: vllm:cache_config_info's block_size, else 16].
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Address for /health and /metrics [default: 127.0.0.1:9100].
    #[arg(long)]
    pub listen: Option<String>,
    /// The vLLM plugin's snapshot endpoint (kvroute_hooks), tcp://HOST:PORT.
    #[arg(long)]
    pub engine_snapshot: Option<String>,
    /// PEM CA bundle trusted for https:// routers (a private CA).
    #[arg(long)]
    pub tls_ca: Option<String>,
}

impl Cli {
    /// The flags as a config layer (the `config` flag itself is not part of it).
    pub fn into_raw(self) -> RawConfig {
        RawConfig {
            worker_id: self.worker_id,
            engine_url: self.engine_url,
            engine_api_key: self.engine_api_key,
            advertise_url: self.advertise_url,
            model: self.model,
            events: self.events,
            replay: self.replay,
            topic: self.topic,
            data_parallel_size: self.data_parallel_size,
            data_parallel_rank: self.data_parallel_rank,
            router: self.router,
            internal_token: self.internal_token,
            fast_interval: self.fast_interval,
            sync_interval: self.sync_interval,
            full_sync_interval: self.full_sync_interval,
            block_size: self.block_size,
            listen: self.listen,
            engine_snapshot: self.engine_snapshot,
            max_pending_changes: None,
            tls_ca: self.tls_ca,
        }
    }
}
