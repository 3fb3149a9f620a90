//! Token ids without generation: `POST /tokenize` (vLLM's shape
//! `{"count", "max_model_len", "tokens", "token_strs"}`) and the render
//! endpoints `POST /v1/completions/render`, `POST /v1/chat/completions/render`
//! (token ids plus sampling parameters, like vLLM's `GenerateRequest`).

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_shared::openai::{Endpoint, PromptRequest};
use serde_json::{Map, Value, json};

use super::completions::prepare;
use super::{ApiError, AppState};

/// `/tokenize` takes a completions-style `prompt` or a chat-style `messages`;
/// `model` is optional there (vLLM defaults it), so it is filled in before the
/// shared parser, which requires it.
pub async fn tokenize(State(s): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let mut obj: Map<String, Value> = kvroute_shared::wire::decode(&body)?;
        obj.entry("model").or_insert_with(|| Value::String(s.config.model.to_string()));
        let endpoint = if obj.contains_key("messages") { Endpoint::ChatCompletions } else { Endpoint::Completions };
        let bytes = serde_json::to_vec(&obj).map_err(|e| ApiError::bad(e.to_string()))?;
        let req = PromptRequest::parse(endpoint, &bytes)?;
        let model = req.model();
        if model != s.config.model.as_str() && s.config.lora_id(model).is_none() {
            return Err(ApiError::ModelNotFound(model.to_owned()));
        }
        let tokens = s.tokenizer.prompt_tokens(&req).map_err(|e| ApiError::bad(e.to_string()))?;
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": s.config.max_model_len,
            "tokens": tokens,
            "token_strs": null,
        }))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn render_completion(State(s): State<AppState>, body: Bytes) -> Response {
    render(&s, Endpoint::Completions, &body)
}

pub async fn render_chat(State(s): State<AppState>, body: Bytes) -> Response {
    render(&s, Endpoint::ChatCompletions, &body)
}

fn render(s: &super::Shared, endpoint: Endpoint, body: &[u8]) -> Response {
    match prepare(s, endpoint, body) {
        Ok(p) => Json(json!({
            "model": p.req.model(),
            "token_ids": p.tokens,
            "sampling_params": {"max_tokens": p.max_tokens},
            "cache_salt": p.req.cache_salt(),
            "stream": p.req.stream(),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}
