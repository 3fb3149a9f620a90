//! kvroute-router: an OpenAI-compatible proxy that sends each request to the
//! vLLM worker holding the longest cached prefix of it, without overloading
//! anyone. Sidecars keep its cache map true (`internal`); other replicas
//! tell it what they have in flight (`replicas`); `routing` turns a request
//! into keys and a decision by a `policy`; `proxy` forwards it.
//!
//! Tests and embedders call [`run`] with a listener they bound themselves (or
//! [`run_with`] with the metrics listener too), or [`build_state`] + [`app`]
//! to drive the router in-process.

pub mod admin;
pub mod cli;
pub mod config;
pub mod context;
pub mod error;
pub mod health;
pub mod index;
pub mod internal;
pub mod metrics;
pub mod passthrough;
pub mod policy;
pub mod process_metrics;
pub mod proxy;
pub mod replicas;
pub mod request_id;
pub mod routing;
pub mod sessions;
pub mod state;
pub mod tls;
pub mod tokenizer_check;
pub mod workers;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::routing::{delete, get, post};
use axum::serve::ListenerExt;
use kvroute_serve as serve;
use kvroute_shared::openai::Endpoint;
use kvroute_shared::tokenize::{PromptTokenizer, TokenizeError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use config::Config;
use state::{AppState, Tokenizers};
use workers::{Source, Target};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot load the tokenizer for {model}: {source}")]
    Tokenizer {
        model: String,
        #[source]
        source: TokenizeError,
    },
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot register worker: {0}")]
    Worker(#[from] workers::RegistryError),
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot read CA bundle {path}: {message}")]
    Ca { path: std::path::PathBuf, message: String },
    #[error("the router's {0} task ended: stopped (the log says how)")]
    TaskEnded(&'static str),
}

/// Loads tokenizers, registers static workers: the state `app` serves.
pub fn build_state(config: Config, shutdown: CancellationToken) -> Result<Arc<AppState>, RunError> {
    let load = |model: &str, dir: &std::path::Path| -> Result<Arc<PromptTokenizer>, RunError> {
        let tokenizer =
            PromptTokenizer::load(dir).map_err(|source| RunError::Tokenizer { model: model.into(), source })?;
        if !tokenizer.has_chat_template() {
            tracing::warn!(
                dir = %dir.display(),
                "no chat template (tokenizer_config.json's chat_template, or chat_template.jinja): \
                 /v1/chat/completions for {model} are placed by their plain text, not by what the engines cache"
            );
        }
        Ok(Arc::new(tokenizer))
    };
    let default = match &config.raw.tokenizer {
        Some(dir) => load("the default model", dir)?,
        None => {
            tracing::warn!(
                "no --tokenizer: keying prompts by UTF-8 bytes (approximate mode); keys will not match a real \
                 engine's KV events"
            );
            Arc::new(PromptTokenizer::Bytes)
        }
    };
    let mut by_model = std::collections::BTreeMap::new();
    for (model, dir) in &config.raw.tokenizers {
        by_model.insert(model.clone(), load(model, dir)?);
    }
    let statics = config.workers.clone();
    let capacity = config.raw.approx_capacity_blocks;
    let client = upstream_client(&config)?;
    let state = Arc::new(AppState::new(config, Tokenizers { by_model, default }, shutdown, client));
    for w in statics {
        let (worker, _) =
            state.workers.upsert(&w.id, Some(Target { url: &w.url, dp_rank: w.dp_rank }), None, Source::Static)?;
        state.map.write().index.set_approximate(worker.slot, Some(capacity));
    }
    Ok(state)
}

/// An idle pooled connection to a worker is closed after this: vLLM's
/// server closes its own after 5 s (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`), and a
/// request written as it does fails as "closed after sending", which is
/// retried elsewhere (its cache lost) and counted as a failure the request
/// may have caused. Kept under it, the router closes first.
const UPSTREAM_IDLE: std::time::Duration = std::time::Duration::from_secs(4);

/// The client for workers: pooled keep-alive connections, no overall timeout
/// (answers stream for minutes), extra CA roots for `https://` workers.
/// It reaches workers directly, whatever `HTTP_PROXY`/`HTTPS_PROXY`/
/// `ALL_PROXY` say: set for a host's outbound traffic and not excluded for
/// pod addresses, they sent prompts (and the client's `Authorization`)
/// through the proxy, which may buffer a stream, and made a refused
/// connection the proxy's 502, charged to the worker as its own failure.
/// It follows no redirect: a worker's 307 re-sent the prompt wherever it
/// pointed (another worker, counted on the first; the router itself; an
/// internal address), and an ingress's http→https 301 turned every
/// completion into a GET whose 405 went to the client, uncharged.
fn upstream_client(config: &Config) -> Result<reqwest::Client, RunError> {
    let mut b = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(config.raw.connect_timeout)
        .pool_idle_timeout(UPSTREAM_IDLE)
        .tcp_nodelay(true);
    if let Some(path) = &config.raw.tls_ca {
        let pem = std::fs::read(path).map_err(|e| RunError::Ca { path: path.clone(), message: e.to_string() })?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| RunError::Ca { path: path.clone(), message: e.to_string() })?;
        for cert in certs {
            b = b.add_root_certificate(cert);
        }
    }
    Ok(b.build()?)
}

/// The router's HTTP surface.
pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(|s, id, h, b| proxy::handle(s, Endpoint::Completions, id, h, b)))
        .route("/v1/chat/completions", post(|s, id, h, b| proxy::handle(s, Endpoint::ChatCompletions, id, h, b)))
        .route("/v1/models", get(admin::models))
        .route("/v1/context", post(context::create))
        .route("/v1/context/{id}", delete(context::delete))
        .route("/health", get(admin::health))
        .route("/ready", get(admin::ready))
        .route("/metrics", get(admin::metrics))
        .merge(
            Router::new()
                .route("/debug/route", post(admin::debug_route))
                .route("/debug/index", get(admin::debug_index))
                .route("/admin/workers", get(admin::workers))
                .route_layer(axum::middleware::from_fn_with_state(state.clone(), admin::require_admin_token)),
        )
        .route(kvroute_shared::wire::EVICTION_PATH, post(internal::eviction))
        .route(kvroute_shared::wire::SYNC_PATH, post(internal::sync))
        .route(replicas::REPLICA_PATH, post(replicas::report))
        .fallback(passthrough::forward)
        // A wrong method on a route of the router's own: an OpenAI-shaped
        // 405, not axum's empty one.
        .method_not_allowed_fallback(|| async { error::RouterError::MethodNotAllowed })
        .layer(axum::middleware::from_fn(request_id::ensure))
        .with_state(state)
}

/// The optional metrics listener's surface: `/metrics` alone, so a scrape
/// port can be opened to Prometheus without exposing the API.
pub fn metrics_app(state: Arc<AppState>) -> Router {
    Router::new().route("/metrics", get(admin::metrics)).with_state(state)
}

/// The sockets a router serves on.
#[derive(Debug)]
pub struct Listeners {
    /// The API, `/metrics`, the sidecars' and the admin endpoints (TLS when configured).
    pub api: TcpListener,
    /// `metrics_listen`: `/metrics` again, in plain HTTP.
    pub metrics: Option<TcpListener>,
}

/// Open connections the metrics listener keeps at most (Prometheus needs one
/// or two; the cap keeps a stray client from using the API's budget of file
/// descriptors).
const METRICS_MAX_CONNECTIONS: usize = 64;

/// Serves until `shutdown` resolves: then `/ready` answers 503 while it
/// serves on for `drain_delay`, its listener closes, and the requests in
/// flight get `shutdown_grace`, at whose end the answers still streaming are
/// ended with an error event; the other replicas get its last report (1 s at
/// most). A task the router needs that ends before (a panic) stops it too,
/// with [`RunError::TaskEnded`]. Binds `metrics_listen` itself when set; use
/// [`run_with`] to pass that listener in.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let metrics = match config.raw.metrics_listen {
        Some(addr) => Some(TcpListener::bind(addr).await?),
        None => None,
    };
    run_with(Listeners { api: listener, metrics }, config, shutdown).await
}

/// [`run`] on listeners the caller bound (the configured `listen` and
/// `metrics_listen` addresses are not looked at).
pub async fn run_with(
    listeners: Listeners,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let Listeners { api: listener, metrics } = listeners;
    let token = CancellationToken::new();
    let grace = config.raw.shutdown_grace;
    // Misconfigured TLS fails before anything starts.
    let tls = match (&config.raw.tls_cert, &config.raw.tls_key) {
        (Some(cert), Some(key)) => Some(tls::server_config(cert, key)?),
        _ => None,
    };
    let state = build_state(config, token.clone())?;
    // However this returns: the replica exchange stops with the server.
    let _drained = state.drained.clone().drop_guard();
    // Each runs until the router stops: one that ends before (a panic) stops
    // the router with an error, for its supervisor to restart it. Without
    // health checks no ejected worker came back; without housekeeping no
    // speculative entry or silent sidecar expired; the process served on.
    let mut critical = serve::critical::Critical::default();
    let span = |name| tracing::info_span!("task", name);
    critical.spawn("health checks", health::run_health_checks(state.clone()).instrument(span("health_checks")));
    critical.spawn("housekeeping", health::run_housekeeping(state.clone()).instrument(span("housekeeping")));
    critical.spawn("replica exchange", replicas::run(state.clone()).instrument(span("replicas")));

    let (stop, stopping_state) = (token.clone(), state.clone());
    tokio::spawn(async move {
        shutdown.await;
        stopping_state.draining.store(true, std::sync::atomic::Ordering::Relaxed);
        let delay = stopping_state.config.raw.drain_delay;
        if !delay.is_zero() {
            tracing::info!(?delay, "stopping: serving on while load balancers drain this router (/ready is 503)");
            tokio::time::sleep(delay).await;
        }
        stop.cancel();
    });
    let router = app(state.clone());
    let limits = serve::Limits {
        max_connections: state.config.raw.max_connections,
        header_read_timeout: state.config.raw.header_read_timeout,
        keep_alive_timeout: state.config.raw.keep_alive_timeout,
        write_timeout: state.config.raw.idle_timeout,
    };
    let metrics_task = metrics.map(|listener| {
        let limits = serve::Limits { max_connections: METRICS_MAX_CONNECTIONS, ..limits };
        tokio::spawn(serve::serve(listener, metrics_app(state.clone()), limits, token.clone()))
    });
    let stopping = token.clone();
    let mut serve = match tls {
        Some(config) => {
            let listener = tls::TlsListener::new(listener, config, state.config.raw.max_connections)?;
            tokio::spawn(serve::serve(listener, router, limits, stopping))
        }
        // Nagle would hold a streamed token back until the previous one is
        // acknowledged (~40 ms stalls on loopback): every chunk goes out now.
        None => {
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            tokio::spawn(serve::serve(listener, router, limits, stopping))
        }
    };
    let flatten =
        |r: Result<(), tokio::task::JoinError>| r.map_err(|join| RunError::Serve(std::io::Error::other(join)));
    // Scrapes are short: the metrics listener is not waited for.
    let _stop_metrics = metrics_task.map(|t| t.abort_handle()).map(AbortOnDrop);
    let mut ended = None;
    let served = tokio::select! {
        r = &mut serve => Some(flatten(r)),
        _ = token.cancelled() => None,
        // They end at a stop too (the token is theirs): only one that ends
        // before is a failure.
        (task, how) = critical.one_ended() => {
            if !token.is_cancelled() {
                tracing::error!(task, how, "a task the router needs ended: stopping");
                ended = Some(task);
                token.cancel();
            }
            None
        }
    };
    let served = match served {
        Some(r) => r,
        None => match tokio::time::timeout(grace, &mut serve).await {
            Ok(r) => flatten(r),
            Err(_) => {
                tracing::warn!(?grace, "shutdown grace period over: ending the answers still under way");
                // Streams end with an error event, given a moment to reach
                // their clients; then the drain loop is stopped, not left
                // waiting after `run` returns.
                state.cut.cancel();
                if tokio::time::timeout(CUT_FLUSH, &mut serve).await.is_err() {
                    serve.abort();
                }
                Ok(())
            }
        },
    };
    // The other replicas are told this one has nothing left in flight
    // before `run` returns: the binary's runtime ends right after it, and
    // the last reports were cancelled unsent (the peers counted this
    // router's requests until they forgot it, a second later). The server
    // may have ended on its own (an error): the other tasks stop too.
    token.cancel();
    state.drained.cancel();
    if tokio::time::timeout(REPLICAS_FAREWELL, critical.join_all()).await.is_err() {
        tracing::warn!("the router's tasks did not all end in time (the last reports to the other replicas?)");
    }
    match ended {
        Some(task) => Err(RunError::TaskEnded(task)),
        None => served,
    }
}

/// How long the answers cut at the end of the shutdown grace get to send
/// their last event.
const CUT_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

/// How long `run` waits for the last reports to the other replicas (each
/// is bounded at 0.5 s on its own).
const REPLICAS_FAREWELL: std::time::Duration = std::time::Duration::from_secs(1);

/// Aborts a task when the function that spawned it returns.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
