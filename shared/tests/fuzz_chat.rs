//! Bounded fuzzing of chat-template rendering with arbitrary messages: the
//! real Qwen3 template either renders or fails with a template error naming
//! the line — it never panics.

use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::testdata::tokenizer_dir;
use kvroute_shared::tokenize::{PromptTokenizer, TokenizeError};
use proptest::prelude::*;
use serde_json::{Value, json};

fn qwen3() -> Option<&'static PromptTokenizer> {
    static TOK: std::sync::OnceLock<Option<PromptTokenizer>> = std::sync::OnceLock::new();
    TOK.get_or_init(|| match tokenizer_dir("qwen3") {
        Ok(dir) => Some(PromptTokenizer::load(&dir).expect("qwen3 loads")),
        Err(why) => {
            eprintln!("SKIPPED: no qwen3 tokenizer: {why}");
            None
        }
    })
    .as_ref()
}

fn content() -> impl Strategy<Value = Value> {
    prop_oneof![
        ".{0,40}".prop_map(Value::String),
        Just(Value::Null),
        proptest::collection::vec(".{0,10}".prop_map(|t| json!({"type": "text", "text": t})), 0..3)
            .prop_map(Value::Array),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            Just("system".to_string()),
            Just("user".to_string()),
            Just("assistant".to_string()),
            Just("tool".to_string()),
            "[a-z]{1,6}"
        ],
        content(),
        any::<bool>(),
    )
        .prop_map(|(role, content, tools)| {
            let mut m = json!({"role": role, "content": content});
            if tools && role == "assistant" {
                m["tool_calls"] = json!([{"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
            }
            m
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_conversations_render_or_fail_cleanly(
        messages in proptest::collection::vec(message(), 1..8),
        generation in any::<bool>(),
        thinking in any::<bool>(),
    ) {
        let Some(tok) = qwen3() else { return Ok(()) };
        let body = json!({
            "model": "qwen3", "messages": messages, "add_generation_prompt": generation,
            "chat_template_kwargs": {"enable_thinking": thinking},
        });
        let req = PromptRequest::parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        match tok.prompt_tokens(&req) {
            // An unknown role renders to nothing with this template, as in HF.
            Ok(ids) => prop_assert!(ids.len() < 10_000),
            Err(TokenizeError::Template { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }
}
