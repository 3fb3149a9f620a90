//! The OpenAI-compatible HTTP API, answering like vLLM's `vllm serve`, plus the
//! simulator's own `/sim/*` admin endpoints.
//!
//! Handlers do parsing, validation and tokenization on the request's task and
//! hand the engine token ids; the only hop is the engine channel.

pub mod admin;
pub mod bodies;
pub mod completions;
pub mod metrics;
pub mod sse;
pub mod tokenize;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_shared::tokenize::PromptTokenizer;
use kvroute_shared::wire::{DecodeError, ErrorBody};
use serde::Serialize;
use tokio::sync::watch;

use crate::config::Config;
use crate::engine::Engine;
use crate::faults::Faults;
use crate::metrics::EngineMetrics;

/// Where a running simulator can be reached: `GET /sim/info`.
#[derive(Clone, Debug, Serialize)]
pub struct SimInfo {
    pub model: String,
    pub loras: Vec<String>,
    /// `http://ADDR` as bound.
    pub listen: String,
    pub block_size: usize,
    pub num_blocks: u32,
    pub max_model_len: usize,
    /// The PUB endpoint as bound (port resolved), when events are on.
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
    pub kv_events_topic: Option<String>,
    pub kv_events_format: Option<crate::events::EventFormat>,
    /// 0 = u64 hashes, 32 = raw digests.
    pub kv_events_hash_bytes: u8,
    /// Every data-parallel rank served, with its endpoints as bound (the
    /// first is `kv_events` / `kv_replay`).
    pub dp_ranks: Vec<RankInfo>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RankInfo {
    pub rank: u32,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
}

/// One data-parallel rank: an engine with its own cache, scheduler, metrics
/// and event ports.
#[derive(Debug)]
pub struct RankEngine {
    pub rank: u32,
    pub engine: Engine,
    pub metrics: Arc<EngineMetrics>,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
}

#[derive(Debug)]
pub struct Shared {
    pub config: Config,
    /// One per data-parallel rank served (one without data parallelism).
    pub ranks: Vec<RankEngine>,
    /// Breaks load ties between ranks in turn.
    pub next_rank: std::sync::atomic::AtomicUsize,
    pub tokenizer: PromptTokenizer,
    pub faults: watch::Sender<Faults>,
    pub info: SimInfo,
    /// Response ids (`cmpl-…`): unique per process is all clients need.
    pub next_id: AtomicU64,
    pub started: u64,
}

pub type AppState = Arc<Shared>;

pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/completions/render", post(tokenize::render_completion))
        .route("/v1/chat/completions/render", post(tokenize::render_chat))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/v1/models", get(admin::models))
        .route("/health", get(admin::health))
        .route("/version", get(admin::version))
        .route("/reset_prefix_cache", post(admin::reset_prefix_cache))
        .route("/metrics", get(metrics::metrics))
        .route("/sim/info", get(admin::info))
        .route("/sim/cache", get(admin::cache))
        .route("/sim/faults", get(admin::get_faults).post(admin::set_faults))
        .with_state(state)
}

/// Every error the API answers with; [`IntoResponse`] is the one place that
/// picks status codes, in vLLM's error shape.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { message: String, param: Option<String> },
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("fault injection: request rejected")]
    Injected(StatusCode),
    #[error("the engine has stopped")]
    EngineGone,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: None }
    }
}

impl From<DecodeError> for ApiError {
    fn from(e: DecodeError) -> Self {
        let param = (e.field != ".").then(|| e.field.clone());
        ApiError::BadRequest { message: e.to_string(), param }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self {
            ApiError::BadRequest { .. } => (StatusCode::BAD_REQUEST, "BadRequestError"),
            ApiError::ModelNotFound(_) => (StatusCode::NOT_FOUND, "NotFoundError"),
            ApiError::Injected(s) if *s == StatusCode::SERVICE_UNAVAILABLE => (*s, "ServiceUnavailableError"),
            ApiError::Injected(s) => (*s, "InternalServerError"),
            ApiError::EngineGone => (StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError"),
        };
        let mut body = ErrorBody::new(status.as_u16(), kind, self.to_string());
        if let ApiError::BadRequest { param: Some(p), .. } = self {
            body = body.with_param(p);
        }
        (status, axum::Json(body)).into_response()
    }
}
