//! One completion request as a benchmark client sees it: send a token-id
//! prompt, time the first streamed chunk (TTFT) and the end of the stream,
//! and note which worker the router picked (`x-kvroute-worker`).

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;

use crate::error::BenchError;

/// The header the router names its chosen worker in.
pub const WORKER_HEADER: &str = "x-kvroute-worker";

#[derive(Debug, Clone)]
pub struct Outcome {
    pub ttft: Duration,
    pub latency: Duration,
    pub worker: Option<String>,
}

/// An HTTP client for loopback benchmarking: no proxy (requests must only
/// reach 127.0.0.1), generous pools so a concurrency cap of 64 reuses
/// connections instead of opening new ones.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().pool_max_idle_per_host(256).tcp_nodelay(true).build().unwrap_or_default()
}

/// A token-id completion request. `ignore_eos` (real vLLM with random
/// weights) makes the engine decode exactly `max_tokens`; the simulator
/// always does, so its requests leave the field out.
pub fn completion_body(model: &str, prompt: &[u32], max_tokens: u32, stream: bool, ignore_eos: bool) -> Vec<u8> {
    let mut body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if ignore_eos {
        body["ignore_eos"] = serde_json::Value::Bool(true);
    }
    serde_json::to_vec(&body).unwrap_or_default()
}

/// A text completion request (the simulator: no `ignore_eos` needed).
pub fn text_completion_body(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> Vec<u8> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream});
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Sends a completion and reads the whole answer. With a streaming body the
/// TTFT is the arrival of the first non-empty body chunk; without, it equals
/// the latency. A stream (`text/event-stream`) counts as answered only if it
/// ends with `data: [DONE]` and carries no error event (a router reports a
/// failure after the first chunk as one): any 200 with a body counted.
pub async fn complete(
    client: &reqwest::Client,
    base: &str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<Outcome, BenchError> {
    let url = format!("{base}/v1/completions");
    let http = |source| BenchError::Http { url: url.clone(), source };
    let started = Instant::now();
    let resp = client
        .post(&url)
        .header("content-type", "application/json")
        .timeout(timeout)
        .body(body)
        .send()
        .await
        .map_err(http)?;
    let worker = resp.headers().get(WORKER_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(BenchError::Unexpected {
            url,
            message: format!("{status}: {}", text.chars().take(300).collect::<String>()),
        });
    }
    let sse = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut ttft = None;
    let mut stream = resp.bytes_stream();
    // The stream's last bytes and what was seen: `[DONE]` or an error event
    // may straddle two chunks.
    let (mut tail, mut done, mut error) = (Vec::new(), false, false);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(http)?;
        if ttft.is_none() && !chunk.is_empty() {
            ttft = Some(started.elapsed());
        }
        if sse {
            tail.extend_from_slice(&chunk);
            let has = |needle: &[u8]| tail.windows(needle.len()).any(|w| w == needle);
            error |= has(b"data: {\"error\"");
            done = has(b"data: [DONE]");
            let keep = tail.len().saturating_sub(32);
            tail.drain(..keep);
        }
    }
    let latency = started.elapsed();
    if sse && (error || !done) {
        let why = if error { "an error event in the stream" } else { "the stream ended without data: [DONE]" };
        return Err(BenchError::Unexpected { url, message: why.into() });
    }
    Ok(Outcome { ttft: ttft.unwrap_or(latency), latency, worker })
}
