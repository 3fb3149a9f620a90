//! `POST /v1/completions` and `POST /v1/chat/completions`: validate and
//! tokenize like vLLM, run the request through the engine, answer in one body
//! or as SSE.
//!
//! A completions `prompt` holding a batch runs as one engine request per entry,
//! submitted in order, as vLLM's server does; the answer has one choice per
//! entry (`index` = entry), `usage` sums the entries' tokens, and its
//! `cached_tokens` is the last entry's (the first to answer when streaming),
//! a quirk of vLLM's that is kept.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_shared::openai::{CompletionRequest, Endpoint, Prompt, PromptRequest};
use kvroute_shared::wire::DP_RANK_HEADER;
use rand::Rng;
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot};

use super::bodies::{self, Head, Kind};
use super::{ApiError, AppState, RankEngine, Shared, sse};
use crate::engine::hashing::BlockExtras;
use crate::engine::{Outcome, Sink, Submission};

/// The options vLLM reads that the shared request view does not.
#[derive(Debug, Default, Deserialize)]
struct EngineOptions {
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Accepted and echoed by render; the simulator never stops at an EOS.
    #[serde(default)]
    ignore_eos: bool,
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
    /// The model it is for (the served one when it names none).
    pub model: String,
    /// One token list per prompt (a chat request has one).
    pub prompts: Vec<Vec<u32>>,
    /// Per prompt (clamped to what the context leaves it).
    pub max_tokens: Vec<u32>,
    pub lora_id: Option<u32>,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// Parses, checks the model, tokenizes and checks lengths, as vLLM's OpenAI
/// server does before a request reaches the engine.
pub fn prepare(s: &Shared, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let mut req = PromptRequest::parse(endpoint, body)?;
    // -1: truncated to the context, as vLLM does.
    req.resolve_truncation(s.config.max_model_len);
    // An empty conversation is the chat template's to judge; the models
    // the sim stands in for (Qwen3's, Llama's templates) raise on it.
    if let PromptRequest::Chat(c) = &req
        && c.messages.is_empty()
    {
        return Err(ApiError::BadRequest {
            message: "the chat template found no messages".into(),
            param: Some("messages".into()),
        });
    }
    // Plain serde here: the body already parsed once, so only these options
    // can fail, and path tracking over a long token array costs real time.
    let options: EngineOptions = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest { message: e.to_string(), param: Some("stream_options".into()) })?;
    // vLLM serves a request naming no model (or "") its base model.
    let model = match req.model() {
        "" => s.config.model.as_str(),
        named => named,
    };
    let lora_id = s.config.lora_id(model);
    if model != s.config.model.as_str() && lora_id.is_none() {
        return Err(ApiError::ModelNotFound(model.to_owned()));
    }
    let prompts = prompt_tokens(s, &req)?;
    // (vLLM runs a chat without max_tokens to its context's end or EOS; the
    // sim has no EOS and gives it the completions default.)
    let asked = req.max_tokens().unwrap_or(s.config.default_max_tokens);
    if asked == 0 {
        return Err(ApiError::BadRequest {
            message: "max_tokens must be at least 1, got 0.".into(),
            param: Some("max_tokens".into()),
        });
    }
    if asked as usize > s.config.max_model_len {
        return Err(ApiError::BadRequest {
            message: format!(
                "max_tokens={asked} cannot be greater than max_model_len={}. Please request fewer output tokens.",
                s.config.max_model_len
            ),
            param: Some("max_tokens".into()),
        });
    }
    // As vLLM 0.32's `get_max_tokens`, prompt by prompt: what the context
    // leaves it, at most.
    let mut max_tokens = Vec::with_capacity(prompts.len());
    for tokens in &prompts {
        let left = u32::try_from(s.config.max_model_len.saturating_sub(tokens.len())).unwrap_or(u32::MAX);
        let n = asked.min(left);
        check_length(s, tokens.len(), n)?;
        max_tokens.push(n);
    }
    let include_usage = options.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let model = model.to_owned();
    Ok(Prepared { req, model, prompts, max_tokens, lora_id, include_usage, ignore_eos: options.ignore_eos })
}

/// Token ids of every prompt of the request, in order.
fn prompt_tokens(s: &Shared, req: &PromptRequest) -> Result<Vec<Vec<u32>>, ApiError> {
    let tokenize = |r: &PromptRequest| s.tokenizer.prompt_tokens(r).map_err(|e| ApiError::bad(e.to_string()));
    let prompts = match req {
        PromptRequest::Completion(c) => match c.prompt() {
            Prompt::TokenBatch(batch) => batch.clone(),
            Prompt::TextBatch(texts) => {
                // One copy of the request without its batch, then one entry each.
                let base = CompletionRequest { prompt: None, ..c.clone() };
                texts
                    .iter()
                    .map(|t| {
                        tokenize(&PromptRequest::Completion(CompletionRequest {
                            prompt: Some(Prompt::Text(t.clone())),
                            ..base.clone()
                        }))
                    })
                    .collect::<Result<_, _>>()?
            }
            Prompt::Text(_) | Prompt::Tokens(_) => vec![tokenize(req)?],
        },
        PromptRequest::Chat(_) => vec![tokenize(req)?],
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::BadRequest { message: "The prompt is empty.".into(), param: Some("prompt".into()) });
    }
    Ok(prompts)
}

fn check_length(s: &Shared, prompt_len: usize, max_tokens: u32) -> Result<(), ApiError> {
    // A prompt that fills the context leaves no token to generate.
    if prompt_len >= s.config.max_model_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {} tokens. However, your prompt contains {} input tokens, \
             which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
            s.config.max_model_len, prompt_len
        )));
    }
    let total = prompt_len + max_tokens as usize;
    // The last generated token takes no KV slot; block 0 is the null block.
    let needed = (total - 1).div_ceil(s.config.block_size.get());
    let usable = s.config.num_blocks.saturating_sub(1) as usize;
    if needed > usable {
        return Err(ApiError::bad(format!(
            "The request needs {needed} KV-cache blocks but the engine has only {usable}."
        )));
    }
    Ok(())
}

pub async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(&s, Endpoint::Completions, &headers, &body).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn chat(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(&s, Endpoint::ChatCompletions, &headers, &body).await.unwrap_or_else(IntoResponse::into_response)
}

/// The rank a request runs on, as vLLM's API server picks it: the one
/// `X-data-parallel-rank` names (out of range: 400, as vLLM's "is out of
/// range"; not an integer: ignored, as vLLM does), else the least loaded by
/// vLLM's score, 4 × waiting + running, ties taken in turn.
fn pick_rank<'a>(s: &'a Shared, headers: &HeaderMap) -> Result<&'a RankEngine, ApiError> {
    let named = headers.get(DP_RANK_HEADER).and_then(|v| v.to_str().ok()).and_then(|t| t.trim().parse::<i64>().ok());
    if let Some(r) = named {
        return s.ranks.iter().find(|e| i64::from(e.rank) == r).ok_or_else(|| {
            let served: Vec<u32> = s.ranks.iter().map(|e| e.rank).collect();
            ApiError::bad(format!("data_parallel_rank {r} is out of range (this server serves {served:?})."))
        });
    }
    let turn = s.next_rank.fetch_add(1, Relaxed);
    let n = s.ranks.len();
    let score = |e: &RankEngine| 4 * e.metrics.waiting.load(Relaxed) + e.metrics.running.load(Relaxed);
    Ok((0..n).map(|i| &s.ranks[(turn + i) % n]).min_by_key(|e| score(e)).expect("at least one rank"))
}

async fn generate(s: &Shared, endpoint: Endpoint, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let faults = *s.faults.borrow();
    if faults.reject > 0.0 && rand::thread_rng().r#gen::<f64>() < faults.reject {
        let status = StatusCode::from_u16(faults.reject_status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        return Err(ApiError::Injected(status));
    }
    let p = prepare(s, endpoint, body)?;
    let rank = pick_rank(s, headers)?;
    let kind = match endpoint {
        Endpoint::Completions => Kind::Completion,
        Endpoint::ChatCompletions => Kind::Chat,
    };
    let id = match headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        // vLLM takes the header as the request's id (`_base_request_id`).
        Some(given) => format!("{}-{given}", kind.prefix()),
        None => response_id(s, kind),
    };
    let head = Head { kind, id, created: unix_now(), model: p.model.clone() };
    let extras = BlockExtras {
        lora_name: p.lora_id.map(|_| p.model.clone()),
        cache_salt: p.req.cache_salt().map(str::to_owned),
    };
    let stream = p.req.stream();
    let mut streams = Vec::new();
    let mut waiters = Vec::new();
    for (prompt, max_tokens) in p.prompts.into_iter().zip(p.max_tokens.iter().copied()) {
        let sink = if stream {
            let (tx, rx) = mpsc::unbounded_channel();
            streams.push(rx);
            Sink::Stream(tx)
        } else {
            let (tx, rx) = oneshot::channel();
            waiters.push(rx);
            Sink::Once(tx)
        };
        let sub = Submission { prompt, max_tokens, extras: extras.clone(), lora_id: p.lora_id, arrival, sink };
        rank.engine.submit(sub).map_err(|_| ApiError::EngineGone)?;
    }
    if stream {
        return Ok(sse::response(head, p.max_tokens, p.include_usage, streams));
    }
    let mut outcomes = Vec::with_capacity(waiters.len());
    for rx in waiters {
        match rx.await {
            Ok(Ok(outcome)) => outcomes.push(outcome),
            Ok(Err(rejected)) => return Err(ApiError::bad(rejected.to_string())),
            Err(_) => return Err(ApiError::EngineGone),
        }
    }
    let usage = Outcome::batch(&outcomes, outcomes.len().saturating_sub(1));
    let choices: Vec<u32> = outcomes.iter().map(|o| o.completion_tokens).collect();
    Ok(Json(bodies::full(&head, &choices, &usage)).into_response())
}

/// `cmpl-…` / `chatcmpl-…`: unique per process is all clients need.
pub fn response_id(s: &Shared, kind: Kind) -> String {
    format!("{}-{:016x}{:08x}", kind.prefix(), s.started, s.next_id.fetch_add(1, Relaxed))
}

impl Outcome {
    /// The `usage` of a batch: token counts summed, `cached_tokens` taken
    /// from entry `cached_from` (vLLM reports one entry's, not the sum).
    pub fn batch(outcomes: &[Outcome], cached_from: usize) -> Outcome {
        Outcome {
            prompt_tokens: outcomes.iter().map(|o| o.prompt_tokens).sum(),
            cached_tokens: outcomes.get(cached_from).map_or(0, |o| o.cached_tokens),
            completion_tokens: outcomes.iter().map(|o| o.completion_tokens).sum(),
        }
    }
}

/// Seconds since the Unix epoch (the `created` field).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
