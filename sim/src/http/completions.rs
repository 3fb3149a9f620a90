//! `POST /v1/completions` and `POST /v1/chat/completions`: validate and
//! tokenize like vLLM, run the request through the engine, answer in one body
//! or as SSE.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_shared::openai::{Endpoint, PromptRequest};
use rand::Rng;
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot};

use super::bodies::{self, Head, Kind};
use super::{ApiError, AppState, Shared, sse};
use crate::engine::hashing::BlockExtras;
use crate::engine::{Outcome, Rejected, Sink, StreamEvent, Submission};

/// The streaming options vLLM reads that the shared request view does not.
#[derive(Debug, Default, Deserialize)]
struct StreamExtras {
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// A request that passed every check, with the engine's view of it.
#[derive(Debug)]
pub struct Prepared {
    pub req: PromptRequest,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    pub lora_id: Option<u32>,
    pub include_usage: bool,
}

/// Parses, checks the model, tokenizes and checks lengths, as vLLM's OpenAI
/// server does before a request reaches the engine.
pub fn prepare(s: &Shared, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let req = PromptRequest::parse(endpoint, body)?;
    // Plain serde here: the body already parsed once, so only `stream_options`
    // can fail, and path tracking over a long token array costs real time.
    let extras: StreamExtras = serde_json::from_slice(body).map_err(|e| ApiError::BadRequest {
        message: format!("stream_options: {e}"),
        param: Some("stream_options".into()),
    })?;
    let model = req.model();
    let lora_id = s.config.lora_id(model);
    if model != s.config.model.as_str() && lora_id.is_none() {
        return Err(ApiError::ModelNotFound(model.to_owned()));
    }
    let tokens = s.tokenizer.prompt_tokens(&req).map_err(|e| ApiError::bad(e.to_string()))?;
    if tokens.is_empty() {
        return Err(ApiError::BadRequest { message: "The prompt is empty.".into(), param: Some("prompt".into()) });
    }
    let max_tokens = req.max_tokens().unwrap_or(s.config.default_max_tokens);
    if max_tokens == 0 {
        return Err(ApiError::BadRequest {
            message: "max_tokens must be at least 1, got 0.".into(),
            param: Some("max_tokens".into()),
        });
    }
    let total = tokens.len() + max_tokens as usize;
    if total > s.config.max_model_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the \
             messages, {} in the completion). Please reduce the length of the messages or completion.",
            s.config.max_model_len,
            total,
            tokens.len(),
            max_tokens
        )));
    }
    let needed = total.div_ceil(s.config.block_size.get());
    if needed > s.config.num_blocks as usize {
        return Err(ApiError::bad(format!(
            "The request needs {needed} KV-cache blocks but the engine has only {}.",
            s.config.num_blocks
        )));
    }
    let include_usage = extras.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    Ok(Prepared { req, tokens, max_tokens, lora_id, include_usage })
}

pub async fn completions(State(s): State<AppState>, body: Bytes) -> Response {
    generate(&s, Endpoint::Completions, &body).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn chat(State(s): State<AppState>, body: Bytes) -> Response {
    generate(&s, Endpoint::ChatCompletions, &body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn generate(s: &Shared, endpoint: Endpoint, body: &[u8]) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let faults = *s.faults.borrow();
    if faults.reject > 0.0 && rand::thread_rng().r#gen::<f64>() < faults.reject {
        let status = StatusCode::from_u16(faults.reject_status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        return Err(ApiError::Injected(status));
    }
    let p = prepare(s, endpoint, body)?;
    let (kind, prefix) = match endpoint {
        Endpoint::Completions => (Kind::Completion, "cmpl"),
        Endpoint::ChatCompletions => (Kind::Chat, "chatcmpl"),
    };
    let head = Head {
        kind,
        id: format!("{prefix}-{:016x}{:08x}", s.started, s.next_id.fetch_add(1, Relaxed)),
        created: unix_now(),
        model: p.req.model().to_owned(),
    };
    let extras = BlockExtras {
        lora_name: p.lora_id.map(|_| p.req.model().to_owned()),
        cache_salt: p.req.cache_salt().map(str::to_owned),
    };
    let (sink, waiter) = if p.req.stream() {
        let (tx, rx) = mpsc::unbounded_channel();
        (Sink::Stream(tx), Waiter::Stream(rx))
    } else {
        let (tx, rx) = oneshot::channel();
        (Sink::Once(tx), Waiter::Once(rx))
    };
    let sub = Submission { prompt: p.tokens, max_tokens: p.max_tokens, extras, lora_id: p.lora_id, arrival, sink };
    s.engine.submit(sub).map_err(|_| ApiError::EngineGone)?;
    match waiter {
        Waiter::Stream(rx) => Ok(sse::response(head, p.max_tokens, p.include_usage, rx)),
        Waiter::Once(rx) => match rx.await {
            Ok(Ok(outcome)) => Ok(Json(bodies::full(&head, &outcome)).into_response()),
            Ok(Err(rejected)) => Err(ApiError::bad(rejected.to_string())),
            Err(_) => Err(ApiError::EngineGone),
        },
    }
}

enum Waiter {
    Once(oneshot::Receiver<Result<Outcome, Rejected>>),
    Stream(mpsc::UnboundedReceiver<StreamEvent>),
}

/// Seconds since the Unix epoch (the `created` field).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
