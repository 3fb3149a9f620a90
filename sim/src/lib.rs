//! kvroute-sim: a simulated vLLM engine for tests, benchmarks and the no-GPU
//! compose profile.
//!
//! It answers vLLM's OpenAI API ([`http`]), keeps a paged prefix cache with
//! vLLM v1's LRU and refcount semantics ([`engine`]), times steps with a
//! prefill/decode cost model, and publishes KV-cache events with the exact
//! bytes real vLLM sends ([`events`]), so the router and sidecar can be tested
//! against it as if it were a GPU worker.
//!
//! Embedding: [`Sim::start`] binds everything (tests pass a listener bound to
//! `127.0.0.1:0` and ZMQ endpoints with port 0) and reports the bound
//! addresses in [`Sim::info`]; [`Sim::serve`] runs until shutdown. [`run`]
//! does both.

pub mod cluster;
pub mod config;
pub mod engine;
pub mod events;
pub mod faults;
pub mod http;
pub mod metrics;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use bytes::Bytes;
use kvroute_shared::tokenize::{PromptTokenizer, TokenizeError};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket};

pub use config::{Args, Config};
pub use http::{AppState, SimInfo, app};

use engine::Engine;
use events::publisher::PublisherParts;
use events::replay::ReplayBuffer;
use metrics::EngineMetrics;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot load the tokenizer: {0}")]
    Tokenizer(#[source] TokenizeError),
    #[error("cannot bind ZMQ endpoint {endpoint}: {source}")]
    ZmqBind {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("cannot start the engine thread: {0}")]
    EngineThread(#[source] std::io::Error),
    #[error("HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// A simulator with every socket bound, not yet serving HTTP.
#[derive(Debug)]
pub struct Sim {
    state: AppState,
    listener: TcpListener,
    cancel: CancellationToken,
}

impl Sim {
    pub async fn start(listener: TcpListener, config: Config) -> Result<Sim, SimError> {
        let tokenizer = match &config.tokenizer {
            Some(dir) => PromptTokenizer::load(dir).map_err(SimError::Tokenizer)?,
            None => PromptTokenizer::Bytes,
        };
        let listen = listener.local_addr().map(|a| format!("http://{a}")).map_err(SimError::Serve)?;
        let (faults_tx, faults_rx) = watch::channel(config.faults);
        let cancel = CancellationToken::new();

        let mut ranks = Vec::with_capacity(config.dp_ranks.len());
        for &rank in &config.dp_ranks {
            let metrics = Arc::new(EngineMetrics::default());
            let mut kv_events = None;
            let mut kv_replay = None;
            let mut events_tx = None;
            if let Some(ev) = &config.events {
                let buffer = Arc::new(ReplayBuffer::new(ev.buffer));
                let topic = Bytes::from(ev.topic.clone().into_bytes());
                let mut socket = PubSocket::new();
                kv_events = Some(bind(&mut socket, &events::rank_endpoint(&ev.endpoint, rank)).await?);
                if let Some(rep) = &ev.replay_endpoint {
                    let mut router = RouterSocket::new();
                    kv_replay = Some(bind(&mut router, &events::rank_endpoint(rep, rank)).await?);
                    let task = events::replay::serve(router, buffer.clone(), topic.clone(), ev.format, cancel.clone());
                    tokio::spawn(task);
                }
                let (tx, rx) = mpsc::unbounded_channel();
                events_tx = Some(tx);
                let parts = PublisherParts { topic, format: ev.format, buffer, faults: faults_rx.clone(), rank };
                tokio::spawn(events::publisher::run(socket, parts, rx, cancel.clone()));
            }
            let engine = Engine::start(&config, metrics.clone(), faults_rx.clone(), events_tx)
                .map_err(SimError::EngineThread)?;
            ranks.push(http::RankEngine { rank, engine, metrics, kv_events, kv_replay });
        }
        let info = SimInfo {
            model: config.model.to_string(),
            loras: config.loras.iter().map(ToString::to_string).collect(),
            listen,
            block_size: config.block_size.get(),
            num_blocks: config.num_blocks,
            max_model_len: config.max_model_len,
            kv_events: ranks[0].kv_events.clone(),
            kv_replay: ranks[0].kv_replay.clone(),
            dp_ranks: ranks
                .iter()
                .map(|r| http::RankInfo {
                    rank: r.rank,
                    kv_events: r.kv_events.clone(),
                    kv_replay: r.kv_replay.clone(),
                })
                .collect(),
            kv_events_topic: config.events.as_ref().map(|e| e.topic.clone()),
            kv_events_format: config.events.as_ref().map(|e| e.format),
            kv_events_hash_bytes: match config.hash_mode {
                engine::hashing::HashMode::Int => 0,
                engine::hashing::HashMode::Bytes32 => 32,
            },
        };
        let started =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let state = Arc::new(http::Shared {
            config,
            ranks,
            next_rank: std::sync::atomic::AtomicUsize::new(0),
            tokenizer,
            faults: faults_tx,
            info,
            next_id: AtomicU64::new(0),
            started,
        });
        Ok(Sim { state, listener, cancel })
    }

    pub fn info(&self) -> &SimInfo {
        &self.state.info
    }

    /// The lines parent processes parse to find the bound addresses:
    /// `listening on http://ADDR`, `kv-events on tcp://…`, `kv-replay on tcp://…`.
    pub fn discovery_lines(&self) -> Vec<String> {
        let info = self.info();
        let mut lines = vec![format!("listening on {}", info.listen)];
        if let Some(e) = &info.kv_events {
            lines.push(format!("kv-events on {e}"));
        }
        if let Some(r) = &info.kv_replay {
            lines.push(format!("kv-replay on {r}"));
        }
        // Further data-parallel ranks (their ports are not base + rank when
        // bound to port 0).
        for r in info.dp_ranks.iter().skip(1) {
            if let Some(e) = &r.kv_events {
                lines.push(format!("kv-events rank {} on {e}", r.rank));
            }
            if let Some(e) = &r.kv_replay {
                lines.push(format!("kv-replay rank {} on {e}", r.rank));
            }
        }
        lines
    }

    pub fn state(&self) -> AppState {
        self.state.clone()
    }

    /// Serves HTTP until `shutdown` resolves, then stops the event tasks. The
    /// engine thread stops when the last request handle is gone.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), SimError> {
        let Sim { state, listener, cancel } = self;
        // Streamed tokens go out at once, as from vLLM's server (no Nagle).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
            let _ = tcp.set_nodelay(true);
        });
        let result = axum::serve(listener, app(state)).with_graceful_shutdown(shutdown).await;
        cancel.cancel();
        result.map_err(SimError::Serve)
    }
}

/// Binds, then serves until `shutdown` resolves.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    Sim::start(listener, config).await?.serve(shutdown).await
}

async fn bind<S: Socket>(socket: &mut S, endpoint: &str) -> Result<String, SimError> {
    let bound = socket
        .bind(&events::bindable_endpoint(endpoint))
        .await
        .map_err(|source| SimError::ZmqBind { endpoint: endpoint.to_owned(), source })?;
    Ok(bound.to_string())
}
