//! Golden tests: kvroute must agree byte for byte with independent
//! implementations — Python hashlib for block keys, HF tokenizers and HF
//! transformers' `apply_chat_template` for token ids.

use std::path::PathBuf;

use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::testdata::{project_testdata, tokenizer_dir};
use kvroute_shared::tokenize::PromptTokenizer;
use kvroute_shared::{BlockKey, BlockSize, KeyRoot, block_keys};
use serde_json::{Value, json};

fn jsonl(path: PathBuf) -> Vec<Value> {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn load(name: &str) -> PromptTokenizer {
    match tokenizer_dir(name) {
        Ok(dir) => PromptTokenizer::load(&dir).unwrap(),
        Err(why) => {
            panic!("no {name} tokenizer: {why} (or place the shared test data at ../shared/testdata)")
        }
    }
}

#[test]
fn block_keys_match_python_reference() {
    let path = project_testdata().join("block-keys.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for c in cases {
        let salt = c["cache_salt"].as_str().unwrap();
        let root = KeyRoot::new(c["model"].as_str().unwrap(), Some(salt));
        assert_eq!(root.0.to_hex(), c["root"].as_str().unwrap());
        let tokens: Vec<u32> = serde_json::from_value(c["token_ids"].clone()).unwrap();
        let bs = BlockSize::new(c["block_size"].as_u64().unwrap() as u32).unwrap();
        let want: Vec<BlockKey> = serde_json::from_value(c["keys"].clone()).unwrap();
        assert_eq!(block_keys(root, &tokens, bs), want, "case {c}");
    }
}

#[test]
fn encode_goldens_match_hf_tokenizers() {
    for name in ["gpt2", "qwen3"] {
        let tok = load(name);
        let goldens = jsonl(project_testdata().join(format!("tokenizers/{name}/encode-goldens.jsonl")));
        assert!(!goldens.is_empty());
        for g in goldens {
            let body = json!({"model": "m", "prompt": g["prompt"], "add_special_tokens": g["add_special_tokens"]});
            let req = PromptRequest::parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
            let want: Vec<u32> = serde_json::from_value(g["token_ids"].clone()).unwrap();
            assert_eq!(tok.prompt_tokens(&req).unwrap(), want, "{name}: {:?}", g["prompt"]);
        }
    }
}

#[test]
fn chat_goldens_match_hf_transformers() {
    let tok = load("qwen3");
    let goldens = jsonl(project_testdata().join("tokenizers/qwen3/chat-goldens.jsonl"));
    assert!(goldens.len() >= 6);
    for g in goldens {
        let body = json!({
            "model": "qwen3",
            "messages": g["messages"],
            "add_generation_prompt": g["add_generation_prompt"],
            "chat_template_kwargs": g["chat_template_kwargs"],
        });
        let req = PromptRequest::parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        let PromptRequest::Chat(chat) = &req else { unreachable!() };
        assert_eq!(tok.render_chat(chat).unwrap(), g["rendered"].as_str().unwrap());
        let want: Vec<u32> = serde_json::from_value(g["token_ids"].clone()).unwrap();
        assert_eq!(tok.prompt_tokens(&req).unwrap(), want);
    }
}

#[test]
fn qwen3_template_renders_tools_and_tool_calls() {
    let tok = load("qwen3");
    let body = json!({
        "model": "qwen3",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "content": "sunny"}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    });
    let req = PromptRequest::parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
    let PromptRequest::Chat(chat) = &req else { unreachable!() };
    let text = tok.render_chat(chat).unwrap();
    // Python's json.dumps separators, as HF's tojson renders tools and
    // arguments; the tool as vLLM dumps it (`"description": null`).
    assert!(
        text.contains(
            r#"{"type": "function", "function": {"name": "weather", "description": null, "parameters": {"type": "object"}}}"#
        ),
        "{text}"
    );
    assert!(text.contains(r#"{"name": "weather", "arguments": {"city": "Paris"}}"#), "{text}");
    assert!(text.contains("<tool_response>\nsunny\n</tool_response>"), "{text}");
}

/// vLLM builds every message anew before rendering (`chat_utils.py`): a
/// null or missing content is `""`, and Qwen3's template, which takes a
/// string, gets text parts joined. Rendered raw, the null raised
/// "cannot perform a containment check" and the parts "no method named
/// startswith": a 400 for the agent loop that sends back what vLLM
/// answered a tool call with.
#[test]
fn qwen3_renders_null_content_and_text_parts_as_vllm_passes_them() {
    let tok = load("qwen3");
    let call = json!([{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]);
    let render = |messages: Value| {
        let body = json!({"model": "qwen3", "messages": messages});
        let req = PromptRequest::parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        let PromptRequest::Chat(chat) = &req else { unreachable!() };
        tok.render_chat(chat).unwrap_or_else(|e| panic!("{messages}: {e}"))
    };
    let plain = render(json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}
    ]));
    for messages in [
        json!([
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": call},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "21C"}]}
        ]),
        json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": call, "refusal": null},
            {"role": "tool", "tool_call_id": "c1", "content": "21C"}
        ]),
    ] {
        assert_eq!(render(messages), plain);
    }
    assert!(plain.contains("<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>"), "{plain}");
}

#[test]
fn chat_without_template_is_a_clear_error() {
    let tok = load("gpt2");
    let body = json!({"model": "gpt2", "messages": [{"role": "user", "content": "hi"}]});
    let req = PromptRequest::parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
    let err = tok.prompt_tokens(&req).unwrap_err();
    assert!(err.to_string().contains("no chat template"), "{err}");
}
