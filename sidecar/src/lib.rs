//! kvroute-sidecar: runs beside one vLLM worker, follows its KV-cache events
//! over ZMQ, translates engine block hashes into router block keys
//! (DESIGN.md §1) and pushes the worker's key set to every router replica
//! (DESIGN.md §2): net deltas every fast interval, full syncs every sync
//! interval, load from the engine's metrics on every push.
//!
//! Layout: [`decode`] (vLLM's wire format) → [`translate`] (engine hash → key,
//! refcounts) → [`coalesce`] (per-router net delta) inside [`state`];
//! [`subscribe`] + [`replay`] feed it, [`push`] + [`supervisor`] drain it;
//! [`engine`] + [`load`] + [`snapshot`] talk to the engine; [`zmtp`] is the
//! ZeroMQ wire protocol [`subscribe`], [`replay`] and [`snapshot`] speak;
//! [`http`] serves `/health` and `/metrics`.

pub mod cli;
pub mod coalesce;
pub mod config;
pub mod decode;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod push;
pub mod replay;
pub mod routers;
pub mod silence;
pub mod snapshot;
pub mod state;
pub mod subscribe;
pub mod supervisor;
pub mod translate;
pub mod zmtp;

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvroute_shared::wire::ServedModel;
use kvroute_shared::{BlockSize, ModelName};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

pub use config::{Config, RawConfig};

use crate::engine::{EngineClient, EngineView};
use crate::metrics::Metrics;
use crate::push::{HttpRouterClient, Pusher};
use crate::state::WorkerState;
use crate::subscribe::RankSource;
use crate::supervisor::Supervisor;
use crate::translate::{Rank, Translator};

/// The sidecar could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot build the HTTP client")]
    HttpClient(#[source] reqwest::Error),
    #[error("the sidecar's {0} task ended: stopped (the log says how)")]
    TaskEnded(&'static str),
    #[error("cannot use CA bundle {path}: {message}")]
    Ca { path: std::path::PathBuf, message: String },
    #[error(
        "--block-size is {configured} but the engine reports {engine} (vllm:cache_config_info): \
         set --block-size to the engine's (and the routers' block_size with it), or leave it unset"
    )]
    BlockSize { configured: BlockSize, engine: BlockSize },
    #[error(
        "--model is \"{configured}\" but the engine serves {served} (/v1/models): set --model to one of them \
         (vLLM's --served-model-name), or leave it unset for the first"
    )]
    ModelNotServed { configured: ModelName, served: String },
    #[error(
        "the engine refused {url} ({status}): it was started with --api-key; give the sidecar the same key \
         (--engine-api-key, or KVROUTE_SIDECAR_ENGINE_API_KEY)"
    )]
    EngineRefused { url: String, status: u16 },
}

/// The `/health` and `/metrics` server's connection limits: its clients are
/// a probe and a scraper, and anything else that reaches its port (it is
/// often bound to every interface) must not hold connections for ever
/// (slow-loris: headers a byte at a time, or nothing at all) and exhaust
/// the file descriptors its pushes to the routers need.
const SERVER_LIMITS: kvroute_serve::Limits = kvroute_serve::Limits {
    max_connections: 256,
    header_read_timeout: std::time::Duration::from_secs(10),
    keep_alive_timeout: std::time::Duration::from_secs(75),
    write_timeout: std::time::Duration::from_secs(30),
};

/// The client for the engine and the routers, trusting `--tls-ca` for
/// `https://` routers. It reaches them directly, whatever the proxy
/// variables say, and follows no redirect (the router's reasons:
/// `kvroute_router::upstream_client`); a push redirected elsewhere would
/// carry the internal token there.
fn http_client(config: &Config) -> Result<reqwest::Client, RunError> {
    let mut b = reqwest::Client::builder().no_proxy().redirect(reqwest::redirect::Policy::none());
    if let Some(path) = &config.tls_ca {
        let ca = |message: String| RunError::Ca { path: path.clone(), message };
        let pem = std::fs::read(path).map_err(|e| ca(e.to_string()))?;
        for cert in reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| ca(e.to_string()))? {
            b = b.add_root_certificate(cert);
        }
    }
    b.build().map_err(RunError::HttpClient)
}

/// Runs the sidecar until `shutdown` resolves: serves `/health` and `/metrics`
/// on `listener`, follows the engine's events and pushes to the routers.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    let metrics = Arc::new(Metrics::new());
    let targets_slot = Arc::new(OnceLock::new());
    let cancel = CancellationToken::new();
    let app = http::app(http::AppState {
        worker_id: config.worker_id.clone(),
        metrics: metrics.clone(),
        targets: targets_slot.clone(),
    });
    let server_cancel = cancel.clone();
    let server = tokio::spawn(kvroute_serve::serve(listener, app, SERVER_LIMITS, server_cancel));

    if let Some(router) = loopback_advertised_to_remote(&config.advertise_url, &config.routers) {
        warn!(
            advertise_url = %config.advertise_url,
            router = %router,
            "the advertised URL is a loopback address but a router is elsewhere: it would send this worker's \
             requests to its own host; set --advertise-url to an address the routers reach"
        );
    }
    let http = http_client(&config)?;
    let engine = EngineClient::new(http.clone(), config.engine_url.clone(), config.engine_api_key.clone());
    tokio::pin!(shutdown);
    let running = tokio::select! {
        () = &mut shutdown => {
            cancel.cancel();
            return finish(server).await;
        }
        r = start(&config, engine, http, metrics, &cancel) => match r {
            Ok(running) => running,
            Err(e) => {
                cancel.cancel();
                let _ = finish(server).await;
                return Err(e);
            }
        },
    };
    let Running { targets, mut tasks } = running;
    let _ = targets_slot.set(targets);
    info!(worker.id = %config.worker_id, targets = config.targets.len(), "sidecar running");
    let ended = tokio::select! {
        () = &mut shutdown => None,
        (task, how) = tasks.one_ended() => {
            tracing::error!(task, how, "a task the sidecar needs ended: stopping");
            Some(task)
        }
    };
    info!("shutting down");
    cancel.cancel();
    tasks.join_all().await;
    finish(server).await?;
    ended.map_or(Ok(()), |task| Err(RunError::TaskEnded(task)))
}

/// The first router not on this host, when `advertise` is a loopback URL
/// (the default: the engine's, usually `http://127.0.0.1:8000`).
fn loopback_advertised_to_remote<'a>(advertise: &str, routers: &'a [String]) -> Option<&'a String> {
    let loopback = |u: &str| match reqwest::Url::parse(u).ok().and_then(|u| u.host().map(|h| h.to_owned())) {
        Some(url::Host::Domain(d)) => d == "localhost",
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    if !loopback(advertise) {
        return None;
    }
    routers.iter().find(|r| !loopback(r))
}

struct Running {
    targets: Vec<http::Target>,
    /// Each runs until the sidecar stops: one that ends before (a panic)
    /// stops the sidecar with an error. Its `/health` answered while its
    /// heartbeats carried a frozen key set whose digest still matched, and
    /// the routers trusted it.
    tasks: kvroute_serve::critical::Critical,
}

/// Learns what only the engine knows, then starts every task.
async fn start(
    config: &Config,
    engine: EngineClient,
    http: reqwest::Client,
    metrics: Arc<Metrics>,
    cancel: &CancellationToken,
) -> Result<Running, RunError> {
    // Waited for even when `--model` is given: the engine must be up for its
    // block size to be checked, and a name it does not serve (a typo, the
    // HF id instead of `--served-model-name`) roots every key where no
    // request's key is.
    let served = discover_models(&engine).await?;
    let models: Vec<ModelName> = served.iter().map(|m| m.name.clone()).collect();
    let base_model = match &config.model {
        Some(m) if !models.contains(m) => {
            return Err(RunError::ModelNotServed {
                configured: m.clone(),
                served: models.iter().map(ModelName::as_str).collect::<Vec<_>>().join(", "),
            });
        }
        Some(m) => m.clone(),
        None => models[0].clone(),
    };
    let (engine_block_size, prefix_caching) = engine.cache_config().await;
    if prefix_caching == Some(false) {
        // Not refused: an embedding, encoder-decoder or attention-free model
        // runs without it (vLLM turns it off), and its requests are still
        // balanced by the router; a generative one was started without it.
        tracing::error!(
            "the engine runs without prefix caching (vllm:cache_config_info enable_prefix_caching=\"False\"): it \
             reuses no cached block and publishes none, so routing to it is by load alone; for a generative model, \
             start vLLM with --enable-prefix-caching"
        );
    }
    let block_size = match (config.block_size, engine_block_size) {
        // Keys chunked by another size than the engine's never match a
        // request: refused at start, not counted in a metric nobody reads.
        (Some(b), Some(e)) if b != e => return Err(RunError::BlockSize { configured: b, engine: e }),
        (Some(b), Some(_)) => b,
        (Some(b), None) => {
            // vLLM may choose another size than it was given (hybrid and
            // MLA models): said, where nothing confirms the flag.
            warn!(
                block_size = b.get(),
                "the engine's /metrics has no vllm:cache_config_info (vLLM started with --disable-log-stats?): \
                 its block size cannot be checked against --block-size"
            );
            b
        }
        (None, Some(e)) => e,
        (None, None) => {
            warn!(
                "the engine's /metrics has no vllm:cache_config_info (vLLM started with --disable-log-stats?): \
                 assuming block size 16; pass --block-size with the engine's, or the keys may never match"
            );
            BlockSize::DEFAULT
        }
    };
    info!(model = %base_model, block_size = block_size.get(), "engine facts");
    let ranks = config.targets.iter().filter_map(|t| t.dp_rank).collect();
    let view = Arc::new(EngineView::new(&served, base_model.clone(), ranks));
    let client = Arc::new(HttpRouterClient::new(http, config.internal_token.clone()));
    let mut tasks = kvroute_serve::critical::Critical::default();
    let mut targets = Vec::new();
    // Each target (a data-parallel rank, or the whole engine) is followed and
    // pushed on its own: its own key set, epoch, seqs and digests.
    for target in &config.targets {
        let rank = target.rank;
        let translator = Translator::new(base_model.clone(), block_size, metrics.translate.clone());
        let state = Arc::new(WorkerState::new(translator, metrics.clone(), config.max_pending_changes));
        let source = RankSource {
            rank: Rank(rank),
            events: config.events.for_rank(rank),
            replay: config.replay.as_ref().map(|r| r.for_rank(rank)),
            topic: config.topic.clone(),
        };
        let span = info_span!("subscribe", rank);
        tasks.spawn("event subscription", subscribe::run(source, state.clone(), cancel.clone()).instrument(span));
        let pusher = Arc::new(Pusher {
            client: client.clone(),
            worker_id: target.worker_id.clone(),
            advertise_url: config.advertise_url.clone(),
            dp_rank: target.dp_rank,
            block_size,
            engine: view.clone(),
            state: state.clone(),
            fast_interval: config.fast_interval,
            full_sync_interval: config.full_sync_interval,
            v1_sync_interval: config.sync_interval,
            seq: Default::default(),
        });
        let supervisor = Supervisor {
            router_urls: config.routers.clone(),
            snapshot_endpoints: config
                .engine_snapshot
                .iter()
                .map(|ep| (Rank(rank), ep.for_rank(rank), config.events.port_for_rank(rank)))
                .collect(),
            sync_interval: config.sync_interval,
            pusher,
            state: state.clone(),
        };
        let span = info_span!("supervisor", worker.id = %target.worker_id);
        tasks.spawn("push supervisor", supervisor.run(cancel.clone()).instrument(span));
        targets.push((target.worker_id.clone(), state));
    }
    let followed = config.targets.len();
    let watch = engine::watch(engine, view, metrics, config.sync_interval, followed, cancel.clone());
    tasks.spawn("engine watch", watch);
    Ok(Running { targets, tasks })
}

/// Waits for the engine to list its models (it may still be loading
/// weights): its served models (never empty), once it lists them. An engine
/// that refuses the sidecar (401, 403: started with `--api-key`, which
/// guards `/v1/*`) is an error, not a wait: it would refuse for ever.
async fn discover_models(engine: &EngineClient) -> Result<Vec<ServedModel>, RunError> {
    let mut backoff = Duration::from_millis(200);
    loop {
        match engine.models().await {
            Ok(models) => return Ok(models),
            Err(crate::engine::EngineError::Http { url, source })
                if source.status().is_some_and(|s| s == 401 || s == 403) =>
            {
                return Err(RunError::EngineRefused { url, status: source.status().map_or(0, |s| s.as_u16()) });
            }
            Err(e) => {
                warn!(error = %e, "waiting for the engine to list its models");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// How long the sidecar's own HTTP server gets to finish its answers at
/// shutdown: a client that grants an HTTP/2 answer no window (a scrape of
/// `/metrics`) held the server's drain, and with it the sidecar's exit, for
/// ever.
const SERVER_GRACE: Duration = Duration::from_secs(5);

async fn finish(mut server: tokio::task::JoinHandle<()>) -> Result<(), RunError> {
    // A panicked server task has nothing left to wait for.
    if tokio::time::timeout(SERVER_GRACE, &mut server).await.is_err() {
        warn!(grace = ?SERVER_GRACE, "the HTTP server did not drain in time: exiting without it");
        server.abort();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::loopback_advertised_to_remote;

    #[test]
    fn a_loopback_advertised_url_is_noticed_only_with_a_remote_router() {
        let routers = |rs: &[&str]| rs.iter().map(|r| (*r).to_owned()).collect::<Vec<_>>();
        let local = routers(&["http://127.0.0.1:8080", "http://localhost:8081", "http://[::1]:8082"]);
        assert_eq!(loopback_advertised_to_remote("http://127.0.0.1:8000", &local), None);
        let remote = routers(&["http://127.0.0.1:8080", "http://router-b:8080"]);
        let found = loopback_advertised_to_remote("http://localhost:8000", &remote);
        assert_eq!(found.map(String::as_str), Some("http://router-b:8080"));
        assert_eq!(loopback_advertised_to_remote("http://10.0.0.7:8000", &remote), None);
    }
}
