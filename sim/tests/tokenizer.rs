//! With `--tokenizer`, the simulator tokenizes as vLLM does: chat requests go
//! through the model's chat template, and `/tokenize`, render and the prompt
//! token count all agree with HF transformers' ids (`chat-goldens.jsonl`).

mod common;

use common::start;
use kvroute_sim::Config;
use serde_json::{Value, json};

#[tokio::test]
async fn qwen3_chat_matches_the_hf_goldens() {
    let dir = match kvroute_shared::testdata::tokenizer_dir("qwen3") {
        Ok(d) => d,
        Err(why) => {
            panic!("no qwen3 tokenizer: {why} (or place the shared test data at ../shared/testdata)")
        }
    };
    let goldens = kvroute_shared::testdata::project_testdata().join("tokenizers/qwen3/chat-goldens.jsonl");
    let mut config = Config::for_model("qwen3-8b");
    config.tokenizer = Some(dir);
    let sim = start(config).await;
    let text = std::fs::read_to_string(goldens).expect("goldens");
    let lines: Vec<&str> = text.lines().take(5).collect();
    assert_eq!(lines.len(), 5, "the goldens file holds fewer than 5 conversations");
    for line in lines {
        let g: Value = serde_json::from_str(line).expect("json");
        let body = json!({
            "model": "qwen3-8b",
            "messages": g["messages"],
            "add_generation_prompt": g["add_generation_prompt"],
            "chat_template_kwargs": g["chat_template_kwargs"],
            "max_tokens": 1,
        });
        let (st, tok) = sim.post("/tokenize", body.clone()).await;
        assert_eq!(st, 200, "{tok}");
        assert_eq!(tok["tokens"], g["token_ids"], "{line}");
        let (_, render) = sim.post("/v1/chat/completions/render", body.clone()).await;
        assert_eq!(render["token_ids"], g["token_ids"]);
        let (st, done) = sim.post("/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{done}");
        assert_eq!(done["usage"]["prompt_tokens"], g["token_ids"].as_array().expect("ids").len());
    }
}
