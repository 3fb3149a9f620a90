//! Bounded fuzzing of chat-template rendering with arbitrary messages: the
//! real Qwen3 template either renders or fails with a template error naming
//! the line — it never panics.

use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::testdata::tokenizer_dir;
use kvroute_shared::tokenize::{PromptTokenizer, TokenizeError};
use proptest::prelude::*;
use serde_json::{Value, json};

fn qwen3() -> &'static PromptTokenizer {
    static TOK: std::sync::OnceLock<PromptTokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| match tokenizer_dir("qwen3") {
        Ok(dir) => PromptTokenizer::load(&dir).expect("qwen3 loads"),
        Err(why) => {
            panic!("no qwen3 tokenizer: {why} (or place the shared test data at ../shared/testdata)")
        }
    })
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
        let tok = qwen3();
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

fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("<|im_start|>".to_string()),
        Just("<|im_end|>".to_string()),
        Just("<think>".to_string()),
        Just("</think>".to_string()),
        Just("<|endoftext|>".to_string()),
        Just("<|im_start".to_string()),
        Just("\n".to_string()),
        Just("  ".to_string()),
        Just("naïve café — 東京 🚀".to_string()),
        "[a-zA-Z0-9 .,'!?]{0,12}",
        ".{0,6}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Segment-wise encoding (with its cache, cold and warm) is exactly
    /// whole-text encoding.
    #[test]
    fn segment_cache_is_exact(pieces in proptest::collection::vec(piece(), 0..12)) {
        let tok = qwen3();
        prop_assert!(tok.caches_segments(), "qwen3's added tokens allow segment caching");
        let text: String = pieces.concat();
        let whole = tok.encode_uncached(&text, false).unwrap();
        prop_assert_eq!(&tok.encode(&text, false).unwrap(), &whole, "cold: {:?}", text);
        prop_assert_eq!(&tok.encode(&text, false).unwrap(), &whole, "warm: {:?}", text);
    }
}
