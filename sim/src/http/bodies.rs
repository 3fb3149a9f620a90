//! Response bodies in vLLM's OpenAI shapes, and the deterministic filler text
//! the simulator "generates" (token `i` of every answer is the same word, so
//! tests can predict the text from `max_tokens`).

use serde_json::{Value, json};

use crate::engine::Outcome;

const FILLER: &[&str] = &[" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."];

/// The text of generated token `index`.
pub fn filler(index: u32) -> &'static str {
    FILLER[index as usize % FILLER.len()]
}

/// The whole generated text of `n` tokens.
pub fn filler_text(n: u32) -> String {
    (0..n).map(filler).collect()
}

/// Which OpenAI object family a response belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

impl Kind {
    /// What its ids start with: `cmpl-…`, `chatcmpl-…`.
    pub fn prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }
    }
}

/// What every body of one response shares.
#[derive(Clone, Debug)]
pub struct Head {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

pub fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens as usize,
        "completion_tokens": o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

/// A non-streaming response: one choice per entry of `choices` (its
/// generated token count), `usage` for them all.
pub fn full(h: &Head, choices: &[u32], usage_of: &Outcome) -> Value {
    match h.kind {
        Kind::Completion => {
            let choices: Vec<Value> = choices
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    json!({"index": i, "text": filler_text(*n), "logprobs": null, "finish_reason": "length",
                           "stop_reason": null, "prompt_logprobs": null})
                })
                .collect();
            json!({
                "id": h.id, "object": "text_completion", "created": h.created, "model": h.model,
                "choices": choices,
                "usage": usage(usage_of),
                "service_tier": null, "system_fingerprint": null, "kv_transfer_params": null,
            })
        }
        Kind::Chat => json!({
            "id": h.id, "object": "chat.completion", "created": h.created, "model": h.model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": filler_text(usage_of.completion_tokens),
                                     "refusal": null, "annotations": null, "audio": null, "function_call": null,
                                     "tool_calls": [], "reasoning_content": null},
                         "logprobs": null, "finish_reason": "length", "stop_reason": null}],
            "service_tier": null, "system_fingerprint": null,
            "usage": usage(usage_of),
            "prompt_logprobs": null, "kv_transfer_params": null,
        }),
    }
}

fn chunk_object(kind: Kind) -> &'static str {
    match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    }
}

/// Generated token `index` of choice `choice`; `last` carries
/// `finish_reason: "length"`.
pub fn token_chunk(h: &Head, choice: usize, index: u32, last: bool) -> Value {
    let finish = if last { json!("length") } else { Value::Null };
    let choice = match h.kind {
        Kind::Completion => json!({"index": choice, "text": filler(index), "logprobs": null,
                                   "finish_reason": finish, "stop_reason": null}),
        Kind::Chat => json!({"index": choice, "delta": {"content": filler(index)}, "logprobs": null,
                             "finish_reason": finish, "stop_reason": null}),
    };
    json!({"id": h.id, "object": chunk_object(h.kind), "created": h.created, "model": h.model, "choices": [choice]})
}

/// vLLM's first chat chunk: the assistant role with empty content.
pub fn role_chunk(h: &Head) -> Value {
    json!({"id": h.id, "object": chunk_object(h.kind), "created": h.created, "model": h.model,
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                        "finish_reason": null}]})
}

/// `stream_options.include_usage`: a last chunk with no choices.
pub fn usage_chunk(h: &Head, o: &Outcome) -> Value {
    json!({"id": h.id, "object": chunk_object(h.kind), "created": h.created, "model": h.model,
           "choices": [], "usage": usage(o)})
}
