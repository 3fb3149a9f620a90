//! HTTP API tests against a real `Sim` on `127.0.0.1:0`: one per endpoint,
//! SSE framing, errors, metrics and the fault API.

mod common;

use std::time::Duration;

use common::start;
use kvroute_sim::Config;
use kvroute_sim::http::bodies::filler_text;
use serde_json::{Value, json};

#[tokio::test]
async fn completion_reports_prefix_hits_in_usage() {
    let sim = start(Config::for_model("m")).await;
    let prompt: Vec<u32> = (0..100).collect();
    let (st, first) = sim.post("/v1/completions", json!({"model": "m", "prompt": prompt})).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["text"], filler_text(16));
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["completion_tokens"], 16);
    assert_eq!(first["usage"]["total_tokens"], 116);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, again) = sim.post("/v1/completions", json!({"model": "m", "prompt": prompt, "max_tokens": 3})).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    assert_eq!(again["usage"]["completion_tokens"], 3);
    // 96 tokens = exactly 6 blocks: the last block may not hit in full.
    let (_, exact) = sim.post("/v1/completions", json!({"model": "m", "prompt": &prompt[..96]})).await;
    assert_eq!(exact["usage"]["prompt_tokens_details"]["cached_tokens"], 80);
    // Another adapter or salt shares nothing.
    let (_, lora) = sim.post("/v1/completions", json!({"model": "sql-adapter", "prompt": prompt})).await;
    assert_eq!(lora["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(lora["model"], "sql-adapter");
    let (_, salted) = sim.post("/v1/completions", json!({"model": "m", "prompt": prompt, "cache_salt": "x"})).await;
    assert_eq!(salted["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn chat_completion_and_text_prompts() {
    let sim = start(Config::for_model("m")).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4});
    let (st, v) = sim.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], filler_text(4));
    // vLLM takes an `x-request-id` as the request's id.
    let sent = sim.client.post(format!("{}/v1/chat/completions", sim.base)).header("x-request-id", "req-9").json(&body);
    let v: serde_json::Value = sent.send().await.unwrap().json().await.unwrap();
    assert_eq!(v["id"], "chatcmpl-req-9");
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": "héllo"})).await;
    assert_eq!(st, 200);
    assert_eq!(v["usage"]["prompt_tokens"], 6, "byte fallback: one token per UTF-8 byte");
}

fn sse_frames(body: &str) -> Vec<&str> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body:?}");
    body.split_inclusive("\n\n")
        .map(|f| {
            assert!(f.starts_with("data: ") && f.ends_with("\n\n"), "bad frame {f:?}");
            &f[6..f.len() - 2]
        })
        .collect()
}

#[tokio::test]
async fn streaming_completion_framing_and_usage() {
    let sim = start(Config::for_model("m")).await;
    let body = json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (st, ct, text) = sim.post_raw("/v1/completions", body).await;
    assert_eq!(st, 200);
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let frames = sse_frames(&text);
    assert_eq!(frames.len(), 5 + 1 + 1, "{text}");
    let chunks: Vec<Value> = frames[..6].iter().map(|f| serde_json::from_str(f).expect("json")).collect();
    let joined: String = chunks[..5].iter().map(|c| c["choices"][0]["text"].as_str().expect("text")).collect();
    assert_eq!(joined, filler_text(5));
    assert!(chunks[3]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);
    assert_eq!(chunks[5]["usage"]["prompt_tokens"], 3);
    assert_eq!(frames[6], "[DONE]");
}

#[tokio::test]
async fn streaming_chat_starts_with_the_role() {
    let sim = start(Config::for_model("m")).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true});
    let (_, _, text) = sim.post_raw("/v1/chat/completions", body).await;
    let frames = sse_frames(&text);
    assert_eq!(frames.len(), 1 + 2 + 1, "no usage chunk unless asked: {text}");
    let first: Value = serde_json::from_str(frames[0]).expect("json");
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let second: Value = serde_json::from_str(frames[1]).expect("json");
    assert_eq!(second["choices"][0]["delta"]["content"], filler_text(1));
}

#[tokio::test]
async fn bad_requests_get_vllm_shaped_errors() {
    let mut config = Config::for_model("m");
    config.max_model_len = 64;
    let sim = start(config).await;
    let (st, v) = sim.post("/v1/completions", json!({"model": "m"})).await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["type"], "BadRequestError");
    assert_eq!(v["error"]["code"], 400);
    assert!(v["error"]["message"].as_str().expect("msg").contains("prompt"), "{v}");
    let (st, v) = sim.post("/v1/completions", json!({"model": "nope", "prompt": "x"})).await;
    assert_eq!(st, 404);
    assert_eq!(v["error"]["type"], "NotFoundError");
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": vec![1; 64]})).await;
    assert_eq!(st, 400);
    assert!(v["error"]["message"].as_str().expect("msg").contains("maximum context length is 64"), "{v}");
    // As vLLM 0.32: max_tokens is what the context leaves, at most (60 + 16
    // tokens asked of 64: 4 generated), and past the context it is refused.
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": vec![1; 60]})).await;
    assert_eq!((st, v["usage"]["completion_tokens"].as_u64()), (200, Some(4)), "{v}");
    // Prompt by prompt in a batch: 4 for the long one, 16 for the short.
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": [vec![1; 60], vec![1; 10]]})).await;
    assert_eq!((st, v["usage"]["completion_tokens"].as_u64()), (200, Some(20)), "{v}");
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": "x", "max_tokens": 65})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("max_tokens")), "{v}");
    // A request naming no model is for the served one.
    let (st, v) = sim.post("/v1/completions", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!((st, v["model"].as_str()), (200, Some("m")), "{v}");
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": "x", "max_tokens": 0})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("max_tokens")));
    let (st, _) = sim.post("/v1/chat/completions", json!({"model": "m", "messages": []})).await;
    assert_eq!(st, 400);
}

#[tokio::test]
async fn small_endpoints() {
    let sim = start(Config::for_model("m")).await;
    assert_eq!(sim.get("/health").await.0, 200);
    let (_, v) = sim.get("/version").await;
    assert!(v.contains("\"version\""), "{v}");
    let (_, models) = sim.get("/v1/models").await;
    let models: Value = serde_json::from_str(&models).expect("json");
    assert_eq!(models["data"][0]["id"], "m");
    assert_eq!(models["data"][1]["id"], "sql-adapter");
    assert_eq!(models["data"][1]["parent"], "m");

    let (st, tok) = sim.post("/tokenize", json!({"prompt": "abc"})).await;
    assert_eq!(st, 200, "{tok}");
    assert_eq!(tok["tokens"], json!([97, 98, 99]));
    assert_eq!(tok["count"], 3);
    assert_eq!(tok["max_model_len"], 32768);
    let (st, tok) = sim.post("/tokenize", json!({"model": "m", "messages": [{"role": "user", "content": "a"}]})).await;
    assert_eq!(st, 200, "{tok}");
    assert!(tok["count"].as_u64().expect("count") > 1);

    let (st, r) = sim.post("/v1/completions/render", json!({"model": "m", "prompt": [5, 6], "max_tokens": 7})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r[0]["token_ids"], json!([5, 6]));
    assert_eq!(r[0]["sampling_params"]["max_tokens"], 7);
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "a"}]});
    let (st, r) = sim.post("/v1/chat/completions/render", chat.clone()).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["token_ids"], tok["tokens"], "render and tokenize agree");

    let (_, info) = sim.get("/sim/info").await;
    let info: Value = serde_json::from_str(&info).expect("json");
    assert_eq!(info["listen"], sim.base);
    assert_eq!(info["block_size"], 16);
    assert!(info["kv_events"].is_null());
    assert_eq!(sim.post("/reset_prefix_cache", json!({})).await, (200, json!({"success": true})));
}

#[tokio::test]
async fn a_batch_of_prompts_runs_each_and_answers_one_choice_each() {
    let sim = start(Config::for_model("m")).await;
    let a: Vec<u32> = (0..40).collect();
    let b: Vec<u32> = (100..120).collect();
    sim.post("/v1/completions", json!({"model": "m", "prompt": a, "max_tokens": 1})).await;
    let body = json!({"model": "m", "prompt": [b, a], "max_tokens": 3, "ignore_eos": true});
    let (st, v) = sim.post("/v1/completions", body).await;
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2);
    assert_eq!((choices[0]["index"].as_u64(), choices[1]["index"].as_u64()), (Some(0), Some(1)));
    assert_eq!(choices[1]["text"], filler_text(3));
    assert_eq!(v["usage"]["prompt_tokens"], 60);
    assert_eq!(v["usage"]["completion_tokens"], 6);
    // vLLM reports the last prompt's cached tokens, not the sum.
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 32);

    let body = json!({"model": "m", "prompt": ["ab", "cde"], "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (st, _, text) = sim.post_raw("/v1/completions", body).await;
    assert_eq!(st, 200);
    let frames = sse_frames(&text);
    let chunks: Vec<Value> =
        frames[..frames.len() - 1].iter().map(|f| serde_json::from_str(f).expect("json")).collect();
    assert_eq!(chunks.len(), 2 * 2 + 1, "{text}");
    for i in 0..2 {
        let texts: String = chunks[..4]
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .map(|c| c["choices"][0]["text"].as_str().expect("text"))
            .collect();
        assert_eq!(texts, filler_text(2));
    }
    assert_eq!(chunks[4]["usage"]["prompt_tokens"], 5);
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 4);

    let (st, r) =
        sim.post("/v1/completions/render", json!({"model": "m", "prompt": ["ab", "c"], "cache_salt": "s"})).await;
    assert_eq!(st, 200, "{r}");
    let r = r.as_array().expect("a list of GenerateRequest");
    assert_eq!(r.len(), 2);
    assert_eq!((&r[0]["token_ids"], &r[1]["token_ids"]), (&json!([97, 98]), &json!([99])));
    let id = r[0]["request_id"].as_str().expect("id");
    assert!(id.starts_with("cmpl-") && id.ends_with("-0"), "{id}");
    assert_eq!(r[1]["cache_salt"], "s");
    assert!(r[0]["sampling_params"].get("max_tokens").is_none(), "16 is vLLM's default, left out");
    let (_, one) = sim.post("/v1/completions/render", json!({"model": "m", "prompt": "ab", "ignore_eos": true})).await;
    assert!(!one[0]["request_id"].as_str().expect("id").ends_with("-0"));
    assert_eq!(one[0]["sampling_params"]["ignore_eos"], true);
}

#[tokio::test]
async fn reset_is_refused_while_a_request_holds_blocks() {
    let mut config = Config::for_model("m");
    // 0.5 ms a step: the stream runs for seconds unless its client leaves.
    config.pace = kvroute_sim::config::Pace::Scaled(10.0);
    let sim = start(config).await;
    let body = json!({"model": "m", "prompt": vec![9; 40], "max_tokens": 20_000, "stream": true});
    let mut resp = sim.client.post(format!("{}/v1/completions", sim.base)).json(&body).send().await.expect("send");
    resp.chunk().await.expect("chunk").expect("a first token: the request runs");
    assert_eq!(sim.post("/reset_prefix_cache", json!({})).await, (200, json!({"success": false})));
    drop(resp);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sim.post("/reset_prefix_cache", json!({})).await.1 != json!({"success": true}) {
        assert!(std::time::Instant::now() < deadline, "reset still refused after the client left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Freed by the client's leaving, not by the stream's end.
    // Left to run, it generates exactly 20,000.
    let generated = generation_tokens(&sim).await;
    assert!(generated < 20_000.0, "{generated} of 20,000 tokens generated: not cancelled");
}

/// `vllm:generation_tokens_total` of rank 0.
async fn generation_tokens(sim: &common::Running) -> f64 {
    let (_, text) = sim.get("/metrics").await;
    let prefix = "vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} ";
    let line = text.lines().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| panic!("no {prefix}in\n{text}"));
    line.parse().expect("a number")
}

#[tokio::test]
async fn metrics_use_vllm_names() {
    let sim = start(Config::for_model("m")).await;
    let prompt: Vec<u32> = (0..40).collect();
    sim.post("/v1/completions", json!({"model": "m", "prompt": prompt})).await;
    sim.post("/v1/completions", json!({"model": "m", "prompt": prompt})).await;
    let (st, text) = sim.get("/metrics").await;
    assert_eq!(st, 200);
    let labels = "{engine=\"0\",model_name=\"m\"}";
    for line in [
        format!("vllm:num_requests_running{labels} 0.0"),
        format!("vllm:num_requests_waiting{labels} 0.0"),
        format!("vllm:kv_cache_usage_perc{labels} 0.0"),
        format!("vllm:prefix_cache_queries_total{labels} 80.0"),
        format!("vllm:prefix_cache_hits_total{labels} 32.0"),
        format!("vllm:time_to_first_token_seconds_count{labels} 2"),
        "# HELP vllm:num_requests_running Number of requests in model execution batches.".to_owned(),
        "# TYPE vllm:num_requests_running gauge".to_owned(),
        "# TYPE vllm:prefix_cache_hits counter".to_owned(),
        "# TYPE vllm:time_to_first_token_seconds histogram".to_owned(),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    // Label order is free in the exposition format (here `le` comes first).
    let bucket = |le: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("vllm:time_to_first_token_seconds_bucket{")
                    && l.contains(&format!("le=\"{le}\""))
                    && l.contains("engine=\"0\"")
                    && l.contains("model_name=\"m\"")
            })
            .unwrap_or_else(|| panic!("no le={le} bucket in\n{text}"))
    };
    assert!(bucket("+Inf").ends_with("} 2"), "{}", bucket("+Inf"));
    bucket("0.001");
    // Each family once (the collector is not registered twice).
    assert_eq!(text.matches("# TYPE vllm:prefix_cache_hits counter").count(), 1);
    assert!(!text.contains("# EOF"), "vLLM's 0.0.4 text format has no EOF marker");
    assert!(text.contains("block_size=\"16\""), "{text}");
    let info = text.lines().find(|l| l.starts_with("vllm:cache_config_info{")).expect("cache_config_info");
    assert!(info.contains("num_gpu_blocks=\"28000\"") && info.ends_with("} 1.0"), "{info}");
}

#[tokio::test]
async fn faults_api_rejects_and_validates() {
    let sim = start(Config::for_model("m")).await;
    let (st, v) = sim.post("/sim/faults", json!({"reject": 1.0, "reject_status": 500})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["reject"], 1.0);
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": "x"})).await;
    assert_eq!(st, 500);
    assert_eq!(v["error"]["type"], "InternalServerError");
    sim.post("/sim/faults", json!({"reject_status": 503})).await;
    assert_eq!(sim.post("/v1/completions", json!({"model": "m", "prompt": "x"})).await.0, 503);
    let (st, v) = sim.post("/sim/faults", json!({"reject": 2.0})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("reject")));
    let (st, _) = sim.post("/sim/faults", json!({"bogus": 1})).await;
    assert_eq!(st, 400);
    sim.post("/sim/faults", json!({"reject": 0.0})).await;
    assert_eq!(sim.post("/v1/completions", json!({"model": "m", "prompt": "x"})).await.0, 200);
    let (_, now) = sim.get("/sim/faults").await;
    let now: Value = serde_json::from_str(&now).expect("json");
    assert_eq!(now["reject_status"], 503);
}

#[tokio::test]
async fn timed_mode_streams_and_frees_blocks_when_the_client_leaves() {
    let mut config = Config::for_model("m");
    // 1000× faster than an H100: each step ≈ 5 µs + 70 ns per prefill token.
    config.pace = kvroute_sim::config::Pace::Scaled(1000.0);
    let sim = start(config).await;
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": vec![7; 200], "max_tokens": 4})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // A long stream the client abandons after the first chunk.
    let body = json!({"model": "m", "prompt": vec![8; 200], "max_tokens": 30_000, "stream": true});
    let mut resp = sim.client.post(format!("{}/v1/completions", sim.base)).json(&body).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.expect("chunk").expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    drop(resp);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = sim.get("/metrics").await;
        let running = text.lines().any(|l| l == "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0");
        let empty = text.lines().any(|l| l == "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0");
        if running && empty {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "abandoned stream still running:\n{text}");
        tokio::task::yield_now().await;
    }
    // Ended by the client's leaving: at this pace the whole stream takes
    // about 2 s, and would free its blocks too, after exactly 30,004 tokens
    // (with the first request's 4).
    let generated = generation_tokens(&sim).await;
    assert!(generated < 30_004.0, "{generated} of 30,004 tokens generated: not cancelled");
}

#[tokio::test]
async fn cache_lists_cached_blocks_as_router_keys() {
    use kvroute_shared::{BlockKey, BlockSize, KeyRoot, block_keys};
    let sim = start(Config::for_model("m")).await;
    let prompt: Vec<u32> = (0..40).collect();
    // One token each: only prompt blocks get cached (see the next test for generated ones).
    sim.post("/v1/completions", json!({"model": "m", "prompt": prompt, "max_tokens": 1})).await;
    let salted = json!({"model": "sql-adapter", "prompt": &prompt[..16], "cache_salt": "t", "max_tokens": 1});
    sim.post("/v1/completions", salted).await;
    let (st, v) = sim.get("/sim/cache").await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&v).unwrap();
    let mut want = block_keys(KeyRoot::new("m", None), &prompt, BlockSize::DEFAULT);
    want.extend(block_keys(KeyRoot::new("sql-adapter", Some("t")), &prompt[..16], BlockSize::DEFAULT));
    want.sort();
    let got: Vec<BlockKey> = serde_json::from_value(v["block_keys"].clone()).unwrap();
    assert_eq!(got, want);
    assert_eq!(v["count"], 3);
    sim.post("/reset_prefix_cache", json!({})).await;
    let (_, v) = sim.get("/sim/cache").await;
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["count"], 0);
}

#[tokio::test]
async fn generated_blocks_are_cached_too() {
    let sim = start(Config::for_model("m")).await;
    // 20 prompt tokens and 29 generated: the KV of 48 tokens is computed, 3 full blocks.
    let (st, v) = sim.post("/v1/completions", json!({"model": "m", "prompt": vec![5; 20], "max_tokens": 29})).await;
    assert_eq!(st, 200, "{v}");
    let (_, v) = sim.get("/sim/cache").await;
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["count"], 3);
}

/// `rank`'s sample of a counter family, from `/metrics`.
fn rank_sample(text: &str, family: &str, rank: u32) -> f64 {
    let prefix = format!("{family}{{engine=\"{rank}\",");
    let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {prefix} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn data_parallel_ranks_have_their_own_caches_and_obey_the_rank_header() {
    let sim = start(Config { dp_ranks: vec![0, 1], ..Config::for_model("m") }).await;
    let prompt: Vec<u32> = (0..64).collect();
    let send = |rank: Option<&'static str>| {
        let mut rb =
            sim.client.post(format!("{}/v1/completions", sim.base)).json(&json!({"model": "m", "prompt": prompt}));
        if let Some(r) = rank {
            rb = rb.header("x-data-parallel-rank", r);
        }
        rb.send()
    };
    for _ in 0..2 {
        assert_eq!(send(Some("1")).await.unwrap().status(), 200);
    }
    let (_, text) = sim.get("/metrics").await;
    assert_eq!(rank_sample(&text, "vllm:request_success_total", 1), 2.0);
    assert_eq!(rank_sample(&text, "vllm:request_success_total", 0), 0.0);
    // The second request hit rank 1's cache; rank 0 never saw the prompt.
    assert_eq!(rank_sample(&text, "vllm:prefix_cache_hits_total", 1), 48.0);
    assert_eq!(rank_sample(&text, "vllm:prefix_cache_queries_total", 0), 0.0);
    assert_eq!(text.matches("# TYPE vllm:request_success counter").count(), 1, "one family, a series per rank");
    let (_, zero) = sim.get("/sim/cache?rank=0").await;
    let (_, one) = sim.get("/sim/cache?rank=1").await;
    let count = |t: &str| serde_json::from_str::<Value>(t).unwrap()["count"].as_u64().unwrap();
    assert_eq!((count(&zero), count(&one)), (0, 4));
    // A rank this server does not serve is refused; vLLM ignores one that is
    // not an integer.
    for (rank, status) in [("2", 400), ("-1", 400), ("x", 200)] {
        assert_eq!(send(Some(rank)).await.unwrap().status(), status, "rank {rank}");
    }
    // Without the header the least loaded rank serves: idle ranks take turns.
    for _ in 0..4 {
        assert_eq!(send(None).await.unwrap().status(), 200);
    }
    let (_, text) = sim.get("/metrics").await;
    assert!(rank_sample(&text, "vllm:request_success_total", 0) >= 1.0, "{text}");
}
