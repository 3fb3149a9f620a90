//! `kvroute-router tokenize`: the operator's parity check against vLLM's
//! `/tokenize` prints exactly the ids the router keys by.

use std::io::Write;
use std::process::{Command, Stdio};

use kvroute_shared::testdata::{project_testdata, tokenizer_dir};
use kvroute_shared::{BlockKey, BlockSize, KeyRoot, block_keys};
use serde_json::{Value, json};

fn run(args: &[&str], body: &Value) -> (bool, Value, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .arg("tokenize")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(body.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.success(), stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn qwen3_chat_matches_hf_transformers_and_keys_follow() {
    let dir = tokenizer_dir("qwen3").unwrap_or_else(|why| {
        panic!("no qwen3 tokenizer: {why} (or place the shared test data at ../shared/testdata)")
    });
    let goldens = std::fs::read_to_string(project_testdata().join("tokenizers/qwen3/chat-goldens.jsonl")).unwrap();
    let g: Value = serde_json::from_str(goldens.lines().nth(2).unwrap()).unwrap();
    let body =
        json!({"model": "qwen3", "messages": g["messages"], "add_generation_prompt": g["add_generation_prompt"]});
    let (ok, out, err) = run(&["--tokenizer", dir.to_str().unwrap(), "--block-size", "16"], &body);
    assert!(ok, "{err}");
    assert_eq!(out["token_ids"], g["token_ids"]);
    let ids: Vec<u32> = serde_json::from_value(g["token_ids"].clone()).unwrap();
    let want = block_keys(KeyRoot::new("qwen3", None), &ids, BlockSize::DEFAULT);
    let got: Vec<BlockKey> = serde_json::from_value(out["block_keys"].clone()).unwrap();
    assert_eq!(got, want);
}

#[test]
fn token_id_prompts_pass_through_and_bad_bodies_fail_clearly() {
    let (ok, out, _) = run(&["--block-size", "4"], &json!({"model": "m", "prompt": [1, 2, 3, 4, 5]}));
    assert!(ok);
    assert_eq!(out["token_ids"], json!([1, 2, 3, 4, 5]));
    assert_eq!(out["block_keys"].as_array().unwrap().len(), 1);
    let (ok, _, err) = run(&[], &json!({"model": "m", "prompt": {"x": 1}}));
    assert!(!ok);
    assert!(err.contains("prompt"), "{err}");
    let (ok, _, err) = run(&["--tokenizer", "/nonexistent/model"], &json!({"model": "m", "prompt": "hi"}));
    assert!(!ok);
    assert!(err.contains("/nonexistent/model/tokenizer.json"), "{err}");
}
