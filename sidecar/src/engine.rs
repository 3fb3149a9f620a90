//! The engine's HTTP side: served models (`/v1/models`), block size and load
//! (`/metrics`), and a background task that keeps the latest load and model
//! list for the pushers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_shared::body::{MAX_ENGINE_METRICS_BYTES, read_within};
use kvroute_shared::wire::{Load, MAX_MODELS_BYTES, ModelAliases, ServedModel, model_aliases, parse_served_models};
use kvroute_shared::{BlockSize, ModelName};
use parking_lot::RwLock;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Secret;
use crate::metrics::Metrics;
use crate::silence::{SILENT_AFTER, SilenceWatch, Transition};
use kvroute_shared::engine_metrics::{parse_block_size, parse_loads, parse_prefix_caching, parse_prompt_tokens};

/// How often the engine's `/metrics` is scraped.
pub const LOAD_INTERVAL: Duration = Duration::from_secs(1);

/// A request to the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine request to {url} failed")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("engine at {0} lists no model")]
    NoModel(String),
    #[error("{url} answered more than {limit} bytes")]
    TooLarge { url: String, limit: usize },
    #[error("{url} answered no model list: {detail}")]
    BadModels { url: String, detail: String },
    #[error("{url} answered {status}, a redirect (not followed: the engine's URL is the server's own)")]
    Redirected { url: String, status: u16 },
}

/// Client for the engine's HTTP endpoints.
#[derive(Clone, Debug)]
pub struct EngineClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<Secret>,
}

impl EngineClient {
    /// `api_key`: the engine's `--api-key`, sent as a bearer token.
    pub fn new(http: reqwest::Client, base: String, api_key: Option<Secret>) -> Self {
        EngineClient { http, base, api_key }
    }

    /// The body at `path`, at most `limit` bytes of it.
    async fn get(&self, path: &str, limit: usize) -> Result<Vec<u8>, EngineError> {
        let url = format!("{}{path}", self.base);
        let wrap = |source| EngineError::Http { url: url.clone(), source };
        let mut req = self.http.get(&url).timeout(Duration::from_secs(2));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(&key.0);
        }
        let resp = req.send().await.and_then(|r| r.error_for_status()).map_err(wrap)?;
        if resp.status().is_redirection() {
            return Err(EngineError::Redirected { url, status: resp.status().as_u16() });
        }
        read_within(reqwest::Body::from(resp), limit).await.map_err(wrap)?.ok_or(EngineError::TooLarge { url, limit })
    }

    /// The served models, base model first (as vLLM lists them): a list
    /// the routers would take in a sync (`wire::check_models`).
    pub async fn models(&self) -> Result<Vec<ServedModel>, EngineError> {
        let body = self.get("/v1/models", MAX_MODELS_BYTES).await?;
        let bad = |detail: String| EngineError::BadModels { url: format!("{}/v1/models", self.base), detail };
        let models = parse_served_models(&body).map_err(|e| bad(e.to_string()))?;
        if models.is_empty() {
            return Err(EngineError::NoModel(self.base.clone()));
        }
        Ok(models)
    }

    async fn metrics_text(&self) -> Result<String, EngineError> {
        let body = self.get("/metrics", MAX_ENGINE_METRICS_BYTES).await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// The engine's block size and whether its prefix caching is on, from
    /// `vllm:cache_config_info`, as far as it says.
    pub async fn cache_config(&self) -> (Option<BlockSize>, Option<bool>) {
        let Ok(text) = self.metrics_text().await else { return (None, None) };
        (parse_block_size(&text).and_then(|b| BlockSize::new(b).ok()), parse_prefix_caching(&text))
    }
}

/// The latest engine facts the pushers attach to messages.
#[derive(Debug)]
pub struct EngineView {
    /// The whole engine's load, then each followed data-parallel rank's.
    load: RwLock<(Option<Load>, BTreeMap<u32, Load>)>,
    /// The served names, and which of them key as `base` (its aliases).
    models: RwLock<(Vec<ModelName>, ModelAliases)>,
    /// The name this sidecar keys the base model's blocks by.
    base: ModelName,
    /// The ranks whose own load is wanted (targets behind one URL).
    ranks: Vec<u32>,
}

impl EngineView {
    /// `served`: the engine's `/v1/models`; `base`: the name the sidecar
    /// keys the base model's blocks by; `ranks`: the data-parallel ranks
    /// reported as targets of their own.
    pub fn new(served: &[ServedModel], base: ModelName, ranks: Vec<u32>) -> Self {
        let view = EngineView { load: RwLock::new((None, BTreeMap::new())), models: RwLock::default(), base, ranks };
        view.set_served(served);
        view
    }

    pub(crate) fn set_served(&self, served: &[ServedModel]) {
        let aliases = model_aliases(served, &self.base);
        *self.models.write() = (served.iter().map(|m| m.name.clone()).collect(), aliases);
    }

    /// The whole engine's load.
    pub fn load(&self) -> Option<Load> {
        self.load.read().0
    }

    /// Rank `dp_rank`'s own load (its `engine="R"` series), else the whole
    /// engine's (an engine that does not label its series by rank).
    pub fn load_for(&self, dp_rank: Option<u32>) -> Option<Load> {
        let loads = self.load.read();
        dp_rank.and_then(|r| loads.1.get(&r).copied()).or(loads.0)
    }

    /// Takes the loads from a `/metrics` page, and returns how many
    /// data-parallel engines it lists (its `engine="N"` series); `None`
    /// (the last loads stay) when it has no load.
    fn set_loads(&self, text: &str) -> Option<usize> {
        let (Some(whole), by_engine) = parse_loads(text) else { return None };
        let ranks = self.ranks.iter().filter_map(|&r| Some((r, *by_engine.get(&r)?))).collect();
        *self.load.write() = (Some(whole), ranks);
        Some(by_engine.len())
    }

    pub fn models(&self) -> Vec<ModelName> {
        self.models.read().0.clone()
    }

    /// The served names that key as the base (`--served-model-name a b`).
    pub fn aliases(&self) -> ModelAliases {
        self.models.read().1.clone()
    }

    #[cfg(test)]
    pub fn set_models(&self, models: Vec<ModelName>) {
        self.set_served(&models.into_iter().map(|name| ServedModel { name, parent: None }).collect::<Vec<_>>());
    }
}

/// Scrapes load every [`LOAD_INTERVAL`] and the model list every
/// `models_every`. `followed`: the engines (data-parallel ranks) this
/// sidecar follows; an engine listing more is logged as an error, once.
pub async fn watch(
    client: EngineClient,
    view: Arc<EngineView>,
    metrics: Arc<Metrics>,
    models_every: Duration,
    followed: usize,
    cancel: CancellationToken,
) {
    let mut unfollowed = UnfollowedRanks { followed, logged: false };
    let mut load_tick = tokio::time::interval(LOAD_INTERVAL);
    // Silence is judged over SILENT_AFTER, far longer than a scrape.
    debug_assert!(SILENT_AFTER > LOAD_INTERVAL * 2);
    let mut silence = SilenceWatch::default();
    let mut models_tick = tokio::time::interval(models_every);
    load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    models_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = load_tick.tick() => {
                let text = client.metrics_text().await.ok();
                match text.as_deref().and_then(|t| view.set_loads(t)) {
                    Some(listed) => {
                        metrics.engine_data_parallel_engines.set(listed as i64);
                        unfollowed.check(listed);
                    }
                    None => {
                        metrics.load_scrape_failures.inc();
                    }
                }
                let prompt_tokens = text.as_deref().and_then(parse_prompt_tokens);
                match silence.observe(tokio::time::Instant::now(), prompt_tokens, metrics.event_batches.get()) {
                    Some(Transition::WentSilent { prompt_tokens, for_secs }) => {
                        metrics.silent_periods.inc();
                        warn!(
                            prompt_tokens, for_secs,
                            "the engine is serving requests but no KV event arrived: check that the sidecar's --topic \
                             matches the engine's kv-events topic (vLLM's default is empty) and that the engine's \
                             event endpoint contains '*' (vLLM binds only then)"
                        );
                    }
                    Some(Transition::Recovered) => info!("KV events arrive again"),
                    None => {}
                }
                metrics.events_silent.set(i64::from(silence.is_silent()));
            }
            _ = models_tick.tick() => {
                match client.models().await {
                    Ok(served) => view.set_served(&served),
                    // Down or restarting: its list comes back with it.
                    Err(EngineError::Http { .. }) => {}
                    Err(e) => warn!(error = %e, "the engine's model list is refused; the last one is kept"),
                }
            }
        }
    }
}

/// An engine that runs more data-parallel engines than the sidecar follows
/// (vLLM's `--data-parallel-size 2` beside a sidecar left at 1) has its
/// other ranks' caches unknown to every router, and the requests the engine
/// balances onto them routed as if they were cached: said once, as an error.
struct UnfollowedRanks {
    followed: usize,
    logged: bool,
}

impl UnfollowedRanks {
    /// `listed`: the engines the engine's `/metrics` lists. True when logged.
    fn check(&mut self, listed: usize) -> bool {
        if listed <= self.followed || self.logged {
            return false;
        }
        self.logged = true;
        tracing::error!(
            listed,
            followed = self.followed,
            "the engine runs more data-parallel engines than this sidecar follows (its /metrics lists them by \
             engine=\"N\"): the others' caches are unknown to the routers; start the sidecar with the engine's \
             --data-parallel-size (or one sidecar per rank with --data-parallel-rank)"
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::get;

    use super::*;

    #[test]
    fn more_engines_than_followed_are_said_once() {
        let text =
            |n: u32| (0..n).map(|e| format!("vllm:num_requests_running{{engine=\"{e}\"}} 1\n")).collect::<String>();
        let view = EngineView::new(&[], ModelName::new("m"), Vec::new());
        assert_eq!(view.set_loads(&text(2)), Some(2));
        assert_eq!(view.set_loads("# no load\n"), None);
        let mut one = UnfollowedRanks { followed: 1, logged: false };
        assert!(!one.check(1));
        assert!(one.check(2), "two engines, one followed");
        assert!(!one.check(2), "said once");
        let mut two = UnfollowedRanks { followed: 2, logged: false };
        assert!(!two.check(2));
    }

    /// An engine started with `--api-key`: /v1/models answers 401 without it.
    async fn guarded_engine(key: &'static str) -> String {
        let models = move |h: HeaderMap| async move {
            let auth = h.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            if auth == format!("Bearer {key}") {
                Ok(axum::Json(serde_json::json!({"data": [{"id": "m"}]})))
            } else {
                Err(StatusCode::UNAUTHORIZED)
            }
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, Router::new().route("/v1/models", get(models))).await });
        url
    }

    /// Something in front of the engine that redirects is named as such: its
    /// empty answer was read as the page (no model list, no cache config).
    #[tokio::test]
    async fn a_redirect_in_front_of_the_engine_is_named() {
        let redirect = || async { (StatusCode::TEMPORARY_REDIRECT, [("location", "https://elsewhere/v1/models")]) };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, Router::new().route("/v1/models", get(redirect))).await });
        let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
        let client = EngineClient::new(http, url, None);
        assert!(matches!(client.models().await, Err(EngineError::Redirected { status: 307, .. })));
    }

    #[tokio::test]
    async fn the_engines_api_key_is_sent_as_a_bearer_token() {
        let url = guarded_engine("engine-secret").await;
        let http = reqwest::Client::new();
        let with = EngineClient::new(http.clone(), url.clone(), Some(Secret("engine-secret".into())));
        assert_eq!(with.models().await.unwrap(), [ServedModel { name: ModelName::new("m"), parent: None }]);
        let without = EngineClient::new(http, url, None);
        assert!(matches!(without.models().await, Err(EngineError::Http { .. })));
    }

    /// An engine (or whatever answers at its address) whose `/metrics` never
    /// ends and whose `/v1/models` lists what no router would take.
    async fn hostile_engine(models: serde_json::Value) -> String {
        let endless = || async {
            let chunk = bytes::Bytes::from(vec![b'#'; 64 << 10]);
            axum::body::Body::from_stream(futures::stream::repeat_with(move || Ok::<_, std::io::Error>(chunk.clone())))
        };
        let models = move || {
            let models = models.clone();
            async move { axum::Json(models) }
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new().route("/metrics", get(endless)).route("/v1/models", get(models));
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    #[tokio::test]
    async fn an_endless_metrics_page_is_refused_at_its_cap() {
        let client = EngineClient::new(reqwest::Client::new(), hostile_engine(serde_json::json!({})).await, None);
        match client.metrics_text().await {
            Err(EngineError::TooLarge { limit, .. }) => assert_eq!(limit, MAX_ENGINE_METRICS_BYTES),
            other => panic!("{other:?}"),
        }
        assert_eq!(client.cache_config().await, (None, None));
    }

    #[tokio::test]
    async fn a_model_list_no_router_would_take_is_refused_saying_why() {
        let refused = |models: serde_json::Value| async move {
            let client = EngineClient::new(reqwest::Client::new(), hostile_engine(models).await, None);
            match client.models().await {
                Err(e @ EngineError::BadModels { .. }) => e.to_string(),
                other => panic!("{other:?}"),
            }
        };
        let long = serde_json::json!({"data": [{"id": "m".repeat(1025)}]});
        assert!(refused(long).await.contains("models[0]"));
        let many: Vec<_> =
            (0..=kvroute_shared::wire::MAX_MODELS).map(|i| serde_json::json!({"id": format!("m{i}")})).collect();
        assert!(refused(serde_json::json!({ "data": many })).await.contains("at most 1024"));
        assert!(refused(serde_json::json!({"data": "m"})).await.contains("invalid type"));
    }
}
