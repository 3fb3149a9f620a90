//! Token ids without generation: `POST /tokenize` (vLLM's shape
//! `{"count", "max_model_len", "tokens", "token_strs"}`) and the render
//! endpoints: `POST /v1/completions/render` answers a list of vLLM's
//! `GenerateRequest` (one per prompt of a batch), `POST
//! /v1/chat/completions/render` one `GenerateRequest`. (vLLM serves them only
//! with `--enable-scale-out`.)

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_shared::openai::{Endpoint, PromptRequest};
use serde_json::{Map, Value, json};

use super::bodies::Kind;
use super::completions::{Prepared, prepare, response_id};
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
    let p = match prepare(s, endpoint, body) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let (kind, many) = match endpoint {
        Endpoint::Completions => (Kind::Completion, true),
        Endpoint::ChatCompletions => (Kind::Chat, false),
    };
    let id = response_id(s, kind);
    let batch = p.prompts.len() > 1;
    let mut out: Vec<Value> = p
        .prompts
        .iter()
        .enumerate()
        .map(|(i, tokens)| {
            let request_id = if batch { format!("{id}-{i}") } else { id.clone() };
            generate_request(&p, request_id, tokens, p.max_tokens[i])
        })
        .collect();
    match (many, out.pop()) {
        (false, Some(one)) => Json(one).into_response(),
        (_, last) => {
            out.extend(last);
            Json(Value::Array(out)).into_response()
        }
    }
}

/// vLLM's `GenerateRequest` as its render endpoints serialize it. Sampling
/// parameters the simulator does not read are vLLM's defaults; like vLLM
/// (msgspec's `omit_defaults`), `max_tokens` is left out when it is 16 and
/// `ignore_eos` unless set.
fn generate_request(p: &Prepared, request_id: String, tokens: &[u32], max_tokens: u32) -> Value {
    let stream = p.req.stream();
    let mut sampling = json!({
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
        "top_p": 1.0, "min_p": 0.0, "stop": [], "stop_token_ids": [],
    });
    if let Some(m) = sampling.as_object_mut() {
        if p.ignore_eos {
            m.insert("ignore_eos".into(), json!(true));
        }
        if max_tokens != 16 {
            m.insert("max_tokens".into(), json!(max_tokens));
        }
        m.insert("output_kind".into(), json!(if stream { 1 } else { 2 }));
        m.insert("skip_clone".into(), json!(true));
        m.insert("bad_words".into(), json!([]));
        m.insert("skip_reading_prefix_cache".into(), json!(false));
    }
    json!({
        "request_id": request_id, "token_ids": tokens, "token_offsets": null, "features": null,
        "content_parts": null, "sampling_params": sampling, "model": p.model,
        "reasoning_ended": null, "reasoning_parser_kwargs": null, "return_token_ids": null,
        "output_mode": "tokens", "stream": stream, "stream_options": null, "cache_salt": p.req.cache_salt(),
        "priority": 0, "kv_transfer_params": null, "ec_transfer_params": null,
    })
}
