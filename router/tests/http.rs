//! The router's HTTP behaviour against fake upstream workers on loopback:
//! proxying, streaming without buffering, retries, disconnects, sessions,
//! internal auth, and every error status.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use kvroute_router::config::Secret;
use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::tokenize::PromptTokenizer;
use kvroute_shared::{BlockKey, BlockSize, KeyRoot, block_keys};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

mod support;
use support::{Refused, TOKEN, TestRouter, eventually, refused_url, router, serve_engine};

/// How a fake worker answers completions.
#[derive(Clone)]
enum Behaviour {
    /// 200 with a JSON body naming the worker.
    Ok,
    /// This status, always.
    Status(u16),
    /// Never answers.
    Hang,
    /// SSE headers at once (as vLLM sends them), then nothing: a wedged engine.
    Wedged,
    /// SSE: chunks are sent when the test pushes them; dropping the response
    /// fires `cancelled`.
    Stream(StreamSlot),
    /// SSE: the first token after this long, then the end of the answer.
    FirstTokenAfter(Duration),
    /// SSE: 64 KB chunks without end; dropping the response fires the sender.
    Endless(Arc<std::sync::Mutex<Option<oneshot::Sender<()>>>>),
}

/// Chunks to send (`None` = fail the stream) and the cancel signal, taken by
/// the one streaming request a fake serves.
type StreamSlot = Arc<tokio::sync::Mutex<Option<(mpsc::Receiver<Option<&'static str>>, oneshot::Sender<()>)>>>;

struct Fake {
    url: String,
    hits: Arc<AtomicUsize>,
}

async fn fake_worker(name: &'static str, behaviour: Behaviour) -> Fake {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let completions = move || {
        let behaviour = behaviour.clone();
        let h = h.clone();
        async move {
            h.fetch_add(1, Ordering::SeqCst);
            match behaviour {
                Behaviour::Ok => axum::Json(json!({"worker": name, "choices": [{"text": "hi"}]})).into_response(),
                Behaviour::Status(s) => {
                    let status = StatusCode::from_u16(s).unwrap();
                    (status, [("retry-after", "7"), ("www-authenticate", "Bearer")], "upstream says no").into_response()
                }
                Behaviour::Hang => futures::future::pending::<Response>().await,
                Behaviour::Wedged => Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>()))
                    .unwrap(),
                Behaviour::FirstTokenAfter(delay) => {
                    let chunks = futures::stream::once(async move {
                        tokio::time::sleep(delay).await;
                        Ok::<_, std::io::Error>(Bytes::from_static(b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n"))
                    })
                    .chain(futures::stream::once(async { Ok(Bytes::from_static(b"data: [DONE]\n\n")) }));
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(chunks))
                        .unwrap()
                }
                Behaviour::Endless(cancel) => {
                    let guard = CancelGuard(cancel.lock().unwrap().take());
                    let chunk = Bytes::from(format!("data: {}\n\n", "x".repeat(64 << 10)));
                    let stream = futures::stream::repeat_with(move || {
                        let _alive = &guard;
                        Ok::<_, std::io::Error>(chunk.clone())
                    });
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap()
                }
                Behaviour::Stream(slot) => {
                    let (rx, cancelled) = slot.lock().await.take().expect("one streaming request per fake");
                    let guard = CancelGuard(Some(cancelled));
                    let stream = futures::stream::unfold((rx, guard), |(mut rx, guard)| async move {
                        match rx.recv().await {
                            Some(Some(chunk)) => Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), (rx, guard))),
                            Some(None) => Some((Err(std::io::Error::other("engine died")), (rx, guard))),
                            None => None,
                        }
                    });
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap()
                }
            }
        }
    };
    let app = Router::new()
        .route("/v1/completions", post(completions.clone()))
        .route("/v1/chat/completions", post(completions))
        .route("/health", get(|| async { "ok" }));
    Fake { url: serve_engine(app).await, hits }
}

/// A [`Behaviour::Stream`] slot: the sender of its chunks, the signal
/// that its response was dropped, and the slot.
fn stream_slot() -> (mpsc::Sender<Option<&'static str>>, oneshot::Receiver<()>, StreamSlot) {
    let (tx, rx) = mpsc::channel(4);
    let (cancel_tx, cancelled) = oneshot::channel();
    (tx, cancelled, Arc::new(tokio::sync::Mutex::new(Some((rx, cancel_tx)))))
}

struct CancelGuard(Option<oneshot::Sender<()>>);
impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// A server that accepts connections and closes them at once: every attempt
/// fails before a byte of response.
async fn slamming_door() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            drop(sock);
        }
    });
    url
}

impl TestRouter {
    async fn complete(&self, body: Value) -> reqwest::Response {
        self.http.post(format!("{}/v1/completions", self.url)).json(&body).send().await.unwrap()
    }

    async fn chat(&self, body: Value) -> reqwest::Response {
        self.http.post(format!("{}/v1/chat/completions", self.url)).json(&body).send().await.unwrap()
    }

    async fn internal(&self, path: &str, body: Value) -> reqwest::Response {
        self.http.post(format!("{}{path}", self.url)).bearer_auth(TOKEN).json(&body).send().await.unwrap()
    }

    /// `/debug/route`'s explanation of where `body` would go.
    async fn explain(&self, body: Value) -> Value {
        self.http.post(format!("{}/debug/route", self.url)).json(&body).send().await.unwrap().json().await.unwrap()
    }
}

fn prompt(n: usize) -> String {
    (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect()
}

/// The keys the router computes for a completion prompt in byte mode.
fn keys_of(model: &str, text: &str) -> Vec<BlockKey> {
    let body = json!({"model": model, "prompt": text});
    let req = PromptRequest::parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
    let tokens = PromptTokenizer::Bytes.prompt_tokens(&req).unwrap();
    block_keys(KeyRoot::new(model, None), &tokens, BlockSize::DEFAULT)
}

async fn error_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

/// An engine that counts requests this router did not send (another router
/// that does not exchange with it, clients that bypass it) ends the router's
/// view of itself as the only one (`sole_router` in `/debug/route`) and as
/// counting every router's requests (`routers_counted`), and
/// the report is counted; its own requests, in flight or just ended, never do.
#[tokio::test]
async fn requests_the_router_did_not_send_end_its_sole_view() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let body = json!({"model": "m", "prompt": prompt(100)});
    let view = r.explain(body.clone()).await;
    assert_eq!((&view["sole_router"], &view["routers_counted"]), (&json!(true), &json!(true)));
    let report = |running: u32| json!({"worker_id": "w1", "evicted_hashes": [], "load": {"running": running, "waiting": 0, "kv_usage": 0.1}});
    // One of its own, ended (or about to): the engine's count of one is it.
    assert_eq!(r.complete(body.clone()).await.status(), 200);
    assert_eq!(r.internal("/internal/eviction", report(1)).await.status(), 200);
    assert_eq!(r.explain(body.clone()).await["sole_router"], true);
    let text = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(text.lines().any(|l| l == "kvroute_foreign_traffic_reports_total 0"), "{text}");
    // Three: two are someone else's.
    assert_eq!(r.internal("/internal/eviction", report(3)).await.status(), 200);
    let view = r.explain(body).await;
    assert_eq!((&view["sole_router"], &view["routers_counted"]), (&json!(false), &json!(false)));
    let text = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(text.lines().any(|l| l == "kvroute_foreign_traffic_reports_total 1"), "{text}");
}

#[tokio::test]
async fn proxies_and_names_the_worker() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let resp = r.complete(json!({"model": "m", "prompt": "hello"})).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kvroute-worker"], "w1");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["worker"], "w1");
}

#[tokio::test]
async fn streams_chunk_by_chunk_without_buffering() {
    let (tx, _cancel_rx, slot) = stream_slot();
    let w = fake_worker("w1", Behaviour::Stream(slot)).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    tx.send(Some("data: {\"n\":1}\n\n")).await.unwrap();
    let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    // The first chunk arrives while the upstream has not sent the second.
    assert_eq!(body.next().await.unwrap().unwrap(), "data: {\"n\":1}\n\n");
    tx.send(Some("data: [DONE]\n\n")).await.unwrap();
    assert_eq!(body.next().await.unwrap().unwrap(), "data: [DONE]\n\n");
    drop(tx);
    assert!(body.next().await.is_none());
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let (tx, cancelled, slot) = stream_slot();
    let w = fake_worker("w1", Behaviour::Stream(slot)).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    tx.send(Some("data: {\"n\":1}\n\n")).await.unwrap();
    let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
    let mut body = resp.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    // The upstream's response stream is dropped: the router let go of it.
    cancelled.await.unwrap();
}

#[tokio::test]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let (tx, _c, slot) = stream_slot();
    let w = fake_worker("w1", Behaviour::Stream(slot)).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    tx.send(Some("data: {\"n\":1}\n\n")).await.unwrap();
    let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
    let mut body = resp.bytes_stream();
    assert_eq!(body.next().await.unwrap().unwrap(), "data: {\"n\":1}\n\n");
    // The engine dies after the client has its first token.
    tx.send(None).await.unwrap();
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.contains("\"type\":\"upstream_error\""), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

/// At the end of the shutdown grace a stream still under way ends with an
/// error event and `[DONE]`: it was cut mid-body when the binary's runtime
/// ended (a truncated body, which clients report as a network error), and
/// in a process embedding the router it went on after `run` returned.
#[tokio::test]
async fn a_stream_under_way_at_the_end_of_the_grace_ends_with_an_error_event() {
    let (tx, _c, slot) = stream_slot();
    let w = fake_worker("w1", Behaviour::Stream(slot)).await;
    let mut r = router(&[("w1", &w.url)], |raw| raw.shutdown_grace = Duration::from_millis(200)).await;
    tx.send(Some("data: {\"n\":1}\n\n")).await.unwrap();
    let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
    let mut body = resp.bytes_stream();
    assert_eq!(body.next().await.unwrap().unwrap(), "data: {\"n\":1}\n\n");
    r.stop();
    let rest = async {
        let mut text = String::new();
        while let Some(chunk) = body.next().await {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        text
    };
    // A deadline for a broken build: the engine never ends the stream.
    let text = tokio::time::timeout(Duration::from_secs(60), rest).await.expect("the stream ended");
    assert!(text.starts_with("data: {\"error\""), "{text}");
    assert!(text.contains("\"type\":\"service_unavailable\""), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    drop(tx);
}

/// An engine dying in the middle of an event: the cut event never reaches
/// the client (ended by a blank line, its cut JSON failed the client's
/// parser before it read the error), and the error is an event of its own.
/// Events split across chunks are passed on whole.
#[tokio::test]
async fn an_event_cut_short_is_dropped_before_the_error_event() {
    let (tx, _c, slot) = stream_slot();
    let w = fake_worker("w1", Behaviour::Stream(slot)).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    tx.send(Some("data: {\"n\":1}\n\ndata: {\"n\"")).await.unwrap();
    let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
    let mut body = resp.bytes_stream();
    assert_eq!(body.next().await.unwrap().unwrap(), "data: {\"n\":1}\n\n");
    tx.send(Some(":2}\n")).await.unwrap();
    tx.send(Some("\ndata: {\"n\":3")).await.unwrap();
    assert_eq!(body.next().await.unwrap().unwrap(), "data: {\"n\":2}\n\n");
    tx.send(None).await.unwrap();
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.starts_with("data: {\"error\""), "{text:?}");
    // Every event the client got is whole JSON, or the end.
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").unwrap_or_else(|| panic!("{event:?}"));
        assert!(data == "[DONE]" || serde_json::from_str::<serde_json::Value>(data).is_ok(), "{event:?}");
    }
}

#[tokio::test]
async fn failures_before_the_first_byte_are_retried_elsewhere() {
    let bad = fake_worker("bad", Behaviour::Status(500)).await;
    let door = slamming_door().await;
    let refused = refused_url();
    let good = fake_worker("good", Behaviour::Ok).await;
    // A 5xx, a connection closed after sending, one refused: each retried.
    for failing in [&bad.url, &door, &refused.url] {
        let r = router(&[("a-failing", failing), ("b-good", &good.url)], |raw| {
            raw.policy = "round_robin".into();
        })
        .await;
        for _ in 0..2 {
            let resp = r.complete(json!({"model": "m", "prompt": "hello"})).await;
            assert_eq!(resp.status(), 200);
            assert_eq!(resp.headers()["x-kvroute-worker"], "b-good");
        }
    }
    assert!(bad.hits.load(Ordering::SeqCst) >= 1);
}

/// A request that two workers failed in a way it can cause itself (here a
/// 5xx; vLLM's `EngineDeadError` answers so before the engine goes down) is
/// sent to no third, whatever `retries` allows: a poison request crashed
/// 1 + `retries` engines and everything in flight on them. Connection
/// refusals, which nothing sent causes, are still retried to the limit.
#[tokio::test]
async fn a_request_two_workers_fail_is_sent_to_no_third() {
    let mut workers = Vec::new();
    for id in ["a", "b", "c", "d"] {
        workers.push((id, fake_worker(id, Behaviour::Status(500)).await));
    }
    let pairs: Vec<(&str, &str)> = workers.iter().map(|(id, w)| (*id, w.url.as_str())).collect();
    let r = router(&pairs, |raw| raw.retries = 3).await;
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": "poison pill"})).await).await;
    assert_eq!(status, 502);
    let hits: usize = workers.iter().map(|(_, w)| w.hits.load(Ordering::SeqCst)).sum();
    assert_eq!(hits, 2, "sent to {hits} workers");
    let refused: Vec<Refused> = (0..3).map(|_| refused_url()).collect();
    let good = fake_worker("good", Behaviour::Ok).await;
    let mut pairs: Vec<(&str, &str)> = vec![("a", &refused[0].url), ("b", &refused[1].url), ("c", &refused[2].url)];
    pairs.push(("d-good", &good.url));
    let r = router(&pairs, |raw| {
        raw.retries = 3;
        raw.policy = "round_robin".into();
        raw.eject_after_failures = 1_000;
    })
    .await;
    let resp = r.complete(json!({"model": "m", "prompt": "hello"})).await;
    assert_eq!(resp.headers()["x-kvroute-worker"], "d-good");
}

/// vLLM sends a stream's headers before any token: a wedged engine's stream
/// must be given up at the first-token deadline and retried elsewhere.
#[tokio::test]
async fn a_stream_without_a_first_token_is_retried_elsewhere() {
    let wedged = fake_worker("wedged", Behaviour::Wedged).await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let r = router(&[("a-wedged", &wedged.url), ("b-good", &good.url)], |raw| {
        raw.policy = "round_robin".into();
        raw.first_token_timeout = Duration::from_millis(200);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    for _ in 0..2 {
        let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-kvroute-worker"], "b-good");
    }
    assert!(wedged.hits.load(Ordering::SeqCst) >= 1, "the wedged worker was tried");
}

/// A wrong method on one of the router's routes is an OpenAI-shaped 405.
#[tokio::test]
async fn a_wrong_method_is_an_openai_shaped_405() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    for (method, path) in [
        (reqwest::Method::GET, "/v1/chat/completions"),
        (reqwest::Method::POST, "/v1/models"),
        (reqwest::Method::PUT, "/v1/completions"),
    ] {
        let (status, body) =
            error_of(r.http.request(method.clone(), format!("{}{path}", r.url)).send().await.unwrap()).await;
        assert_eq!(status, 405, "{method} {path}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{method} {path}: {body}");
    }
    assert_eq!(w.hits.load(Ordering::SeqCst), 0);
}

/// The engine's other client endpoints reach a worker as they are (method,
/// path, query, body, API key) and its answer comes back; engine control
/// and unknown paths do not.
#[tokio::test]
async fn the_engines_other_endpoints_are_forwarded_and_control_ones_are_not() {
    let control = Arc::new(AtomicUsize::new(0));
    let c = control.clone();
    let app = Router::new()
        .route(
            "/v1/embeddings",
            post(
                |headers: axum::http::HeaderMap, uri: axum::http::Uri, axum::Json(body): axum::Json<Value>| async move {
                    let auth = headers.get("authorization").map(|v| v.to_str().unwrap().to_owned());
                    (
                        StatusCode::CREATED,
                        axum::Json(json!({"input": body["input"], "auth": auth, "query": uri.query()})),
                    )
                },
            ),
        )
        .route("/version", get(|| async { axum::Json(json!({"version": "0.32.0"})) }))
        .route("/v1/chat/completions/batch", post(|| async { axum::Json(json!({"object": "batch"})) }))
        .route("/tokenize", post(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .route(
            "/v1/load_lora_adapter",
            post(move || {
                c.fetch_add(1, Ordering::SeqCst);
                async { "loaded" }
            }),
        );
    let engine = serve_engine(app).await;
    let r = router(&[("w1", &engine)], |_| {}).await;
    let resp = r
        .http
        .post(format!("{}/v1/embeddings?x=1", r.url))
        .bearer_auth("client-key")
        .json(&json!({"model": "m", "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["x-kvroute-worker"], "w1");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body, json!({"input": "hello", "auth": "Bearer client-key", "query": "x=1"}));
    let version: Value = r.http.get(format!("{}/version", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(version["version"], "0.32.0");
    // vLLM's batch of chats: the router's own chat route is its prefix.
    let batch = json!({"model": "m", "messages": [[{"role": "user", "content": "a"}]]});
    let resp = r.http.post(format!("{}/v1/chat/completions/batch", r.url)).json(&batch).send().await.unwrap();
    assert_eq!(resp.json::<Value>().await.unwrap(), json!({"object": "batch"}));
    let failed = r.http.post(format!("{}/tokenize", r.url)).json(&json!({"model": "m", "prompt": "x"})).send();
    assert_eq!(failed.await.unwrap().status(), 500);
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    for line in [
        "kvroute_requests_total{worker=\"w1\",outcome=\"passthrough\"} 3",
        "kvroute_requests_total{worker=\"w1\",outcome=\"passthrough_5xx\"} 1",
    ] {
        assert!(metrics.contains(line), "no {line} in\n{metrics}");
    }
    for path in ["/v1/load_lora_adapter", "/reset_prefix_cache", "/internal/other", "/nowhere"] {
        let resp = r.http.post(format!("{}{path}", r.url)).json(&json!({"lora_name": "x"})).send().await.unwrap();
        assert_eq!(resp.status(), 404, "{path}");
    }
    // Paths the engine's server would resolve or decode into control ones,
    // sent as they are (an HTTP client would normalise them first).
    for path in
        ["/v1/embeddings/../load_lora_adapter", "/v1/load_lora%5Fadapter", "/v1/%2e%2e/sleep", "/v1/embeddings//x"]
    {
        let mut raw = tokio::net::TcpStream::connect(r.url.trim_start_matches("http://")).await.unwrap();
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        );
        tokio::io::AsyncWriteExt::write_all(&mut raw, request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut raw, &mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 404"), "{path}: {answer}");
    }
    assert_eq!(control.load(Ordering::SeqCst), 0, "engine control is not the router's to forward");
}

/// Static workers without sidecars learn their models from the engine's
/// `/v1/models`: the router lists them, and a request for one model goes
/// only to the engines serving it.
#[tokio::test]
async fn static_workers_learn_their_models_from_the_engine() {
    async fn engine(model: &'static str) -> String {
        let app = Router::new()
            .route("/v1/models", get(move || async move { axum::Json(json!({"data": [{"id": model}]})) }))
            .route("/health", get(|| async { "ok" }))
            .route(
                "/v1/completions",
                post(move |axum::Json(body): axum::Json<Value>| async move {
                    if body["model"] == model {
                        axum::Json(json!({"choices": [{"text": "hi"}]})).into_response()
                    } else {
                        (StatusCode::NOT_FOUND, "no such model").into_response()
                    }
                }),
            )
            .route("/v1/audio/transcriptions", post(move || async move { model }));
        serve_engine(app).await
    }
    let (a, b) = (engine("alpha").await, engine("beta").await);
    let r = router(&[("a", &a), ("b", &b)], |raw| {
        raw.policy = "round_robin".into();
        raw.health_check_interval = Duration::from_millis(50);
    })
    .await;
    let listed = support::eventually("both models listed", || async {
        let models: Value = r.http.get(format!("{}/v1/models", r.url)).send().await.unwrap().json().await.unwrap();
        let ids: Vec<String> =
            models["data"].as_array()?.iter().map(|m| m["id"].as_str().unwrap().to_owned()).collect();
        (ids.len() == 2).then_some(ids)
    })
    .await;
    assert_eq!(listed, ["alpha", "beta"]);
    for _ in 0..4 {
        let resp = r.complete(json!({"model": "beta", "prompt": "hello"})).await;
        assert_eq!((resp.status(), resp.headers()["x-kvroute-worker"].to_str().unwrap()), (StatusCode::OK, "b"));
    }
    // A form names its model in a field (audio is sent as one): it went to
    // the served model's engine, the first listed, whatever it named.
    let form = "--XyZ\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n\
                --XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nbeta\r\n--XyZ--\r\n";
    for _ in 0..2 {
        let resp = r
            .http
            .post(format!("{}/v1/audio/transcriptions", r.url))
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(form)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-kvroute-worker"], "b");
        assert_eq!(resp.text().await.unwrap(), "beta");
    }
}

/// vLLM takes a request without `model` (or with a null one) as one for its
/// served model: so does the router, keying it as that model's.
#[tokio::test]
async fn a_request_naming_no_model_is_for_the_served_one() {
    let app = Router::new()
        .route("/v1/models", get(|| async { axum::Json(json!({"data": [{"id": "alpha"}]})) }))
        .route("/health", get(|| async { "ok" }))
        .route("/v1/completions", post(|| async { axum::Json(json!({"choices": [{"text": "hi"}]})) }));
    let engine = serve_engine(app).await;
    let r = router(&[("a", &engine)], |raw| raw.health_check_interval = Duration::from_millis(50)).await;
    support::eventually("the engine's model learned", || async {
        let models: Value = r.http.get(format!("{}/v1/models", r.url)).send().await.unwrap().json().await.unwrap();
        (models["data"][0]["id"] == "alpha").then_some(())
    })
    .await;
    let explain = |body: Value| {
        let sent = r.http.post(format!("{}/debug/route", r.url)).json(&body).send();
        async move {
            let resp = sent.await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.json::<Value>().await.unwrap()
        }
    };
    let named = explain(json!({"model": "alpha", "prompt": prompt(200)})).await;
    for body in [json!({"prompt": prompt(200)}), json!({"model": null, "prompt": prompt(200)})] {
        let unnamed = explain(body.clone()).await;
        assert_eq!((&unnamed["model"], &unnamed["block_keys"]), (&named["model"], &named["block_keys"]), "{body}");
        assert_eq!(r.complete(body).await.status(), 200);
    }
}

/// The client's request id and API key reach the engine. A request without
/// a usable id (none, or one longer than any id: vLLM repeats it in every
/// streamed chunk) in its header or its body gets one the router makes; the
/// engine and the client see the same id, on a passed-through request and
/// on the router's own refusal too.
#[tokio::test]
async fn every_request_has_an_id_the_engine_and_the_client_both_see() {
    let echo = |headers: axum::http::HeaderMap| async move {
        let got = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
        axum::Json(json!({"id": got("x-request-id"), "auth": got("authorization"), "host": got("x-forwarded-host")}))
    };
    let app = Router::new().route("/v1/completions", post(echo)).route("/v1/embeddings", post(echo));
    let engine = serve_engine(app).await;
    let r = router(&[("w", &engine)], |_| {}).await;
    let send = |path: &str, id: Option<String>| {
        let mut req = r
            .http
            .post(format!("{}{path}", r.url))
            .header("x-forwarded-host", "evil")
            .bearer_auth("key")
            .json(&json!({"model": "m", "prompt": "hi", "input": "hi"}));
        if let Some(id) = id {
            req = req.header("x-request-id", id);
        }
        async move {
            let resp = req.send().await.unwrap();
            let answered = resp.headers().get("x-request-id").map(|v| v.to_str().unwrap().to_owned());
            (answered, resp.json::<Value>().await.unwrap())
        }
    };
    let (answered, seen) = send("/v1/completions", Some("req-1".into())).await;
    assert_eq!(seen, json!({"id": "req-1", "auth": "Bearer key", "host": null}));
    assert_eq!(answered.as_deref(), Some("req-1"));
    for (path, id) in [
        ("/v1/completions", None),
        ("/v1/completions", Some("x".repeat(300))),
        ("/v1/completions", Some("two words".into())),
        ("/v1/embeddings", None),
    ] {
        let (answered, seen) = send(path, id.clone()).await;
        let made = seen["id"].as_str().unwrap_or_else(|| panic!("{path} {id:?}: the engine got no id: {seen}"));
        assert!(made.len() == 32 && made.bytes().all(|b| b.is_ascii_hexdigit()), "{path} {id:?}: {made}");
        assert_eq!(answered.as_deref(), Some(made), "{path} {id:?}: the client is told the engine's id");
    }
    // vLLM takes a body's `request_id` when no header names one: so does the
    // router, which sends it on as the header (a header still wins).
    for path in ["/v1/completions", "/v1/embeddings"] {
        let body = json!({"model": "m", "prompt": "hi", "input": "hi", "request_id": "job-42"});
        let resp = r.http.post(format!("{}{path}", r.url)).json(&body).send().await.unwrap();
        assert_eq!(resp.headers()["x-request-id"], "job-42", "{path}");
        assert_eq!(resp.json::<Value>().await.unwrap()["id"], "job-42", "{path}");
        let resp = r.http.post(format!("{}{path}", r.url)).header("x-request-id", "hdr-1").json(&body).send();
        let resp = resp.await.unwrap();
        assert_eq!(resp.headers()["x-request-id"], "hdr-1", "{path}");
        assert_eq!(resp.json::<Value>().await.unwrap()["id"], "hdr-1", "{path}");
    }
    // A body id no header can carry is left to the engine, which takes it.
    let body = json!({"model": "m", "prompt": "hi", "request_id": "job 42"});
    let resp = r.http.post(format!("{}/v1/completions", r.url)).json(&body).send().await.unwrap();
    assert!(resp.headers().get("x-request-id").is_none());
    assert_eq!(resp.json::<Value>().await.unwrap()["id"], Value::Null, "no header sent: the engine takes the body's");
    // The router's own refusal names an id too (a client's, or a new one).
    let refused = r.http.post(format!("{}/v1/completions", r.url)).header("x-request-id", "bad-1").body("{").send();
    let refused = refused.await.unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(refused.headers()["x-request-id"], "bad-1");
    let refused = r.http.post(format!("{}/v1/completions", r.url)).body("{").send().await.unwrap();
    assert_eq!(refused.headers()["x-request-id"].len(), 32);
    // Probes are not requests.
    let health = r.http.get(format!("{}/health", r.url)).send().await.unwrap();
    assert!(health.headers().get("x-request-id").is_none());
}

/// A stream whose engine never sends its headers (a dead host, a blocked
/// event loop) is given up at the first-token deadline as a wedged one is,
/// not after `first_byte_timeout` (an hour).
#[tokio::test]
async fn a_stream_whose_headers_never_come_is_retried_at_the_first_token_deadline() {
    let hang = fake_worker("hang", Behaviour::Hang).await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let r = router(&[("a-hang", &hang.url), ("b-good", &good.url)], |raw| {
        raw.policy = "round_robin".into();
        raw.first_token_timeout = Duration::from_millis(200);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    for _ in 0..2 {
        let sent = r.complete(json!({"model": "m", "prompt": "hello", "stream": true}));
        let resp = tokio::time::timeout(Duration::from_secs(20), sent).await.expect("answered, not held an hour");
        assert_eq!(resp.headers()["x-kvroute-worker"], "b-good");
    }
    assert!(hang.hits.load(Ordering::SeqCst) >= 1, "the hanging worker was tried");
}

/// An engine ("busy") that answers a non-streamed request at once and sends
/// a stream's headers at once (as vLLM does) and its first token 900 ms
/// later; and a router in front of it alone, giving a stream 300 ms for its
/// first token, retrying nothing.
async fn busy_engine_and_router() -> (String, TestRouter) {
    let app = Router::new().route(
        "/v1/completions",
        post(|axum::Json(body): axum::Json<Value>| async move {
            if body["stream"] != true {
                return axum::Json(json!({"choices": [{"text": "quick"}]})).into_response();
            }
            let chunks = futures::stream::once(async {
                tokio::time::sleep(Duration::from_millis(900)).await;
                Ok::<_, std::io::Error>(Bytes::from_static(b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n"))
            })
            .chain(futures::stream::once(async { Ok(Bytes::from_static(b"data: [DONE]\n\n")) }));
            Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(chunks)).unwrap()
        }),
    );
    let busy = serve_engine(app).await;
    let r = router(&[("busy", &busy)], |raw| {
        raw.retries = 0;
        raw.first_token_timeout = Duration::from_millis(300);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    (busy, r)
}

/// An engine answering slowly but answering: a stream queued there past the
/// first-token deadline keeps its place while the worker's other answers
/// come, instead of being cancelled, sent to the back of another queue and
/// charged to the worker's health.
#[tokio::test]
async fn a_stream_queued_behind_progress_keeps_its_place() {
    let (_, r) = busy_engine_and_router().await;
    let stream = r.complete(json!({"model": "m", "prompt": "slow one", "stream": true}));
    let progress = async {
        loop {
            assert_eq!(r.complete(json!({"model": "m", "prompt": "quick one"})).await.status(), 200);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let resp = tokio::select! {
        resp = stream => resp,
        () = progress => unreachable!(),
    };
    assert_eq!(resp.status(), 200, "the queued stream was cancelled");
    assert!(resp.text().await.unwrap().contains("[DONE]"));
    assert!(healthy(&r, "busy").await);
}

/// Blocks the engine's sidecar reports filled are progress too: a stream
/// queued behind other routers' (or long non-streamed) work keeps its place.
#[tokio::test]
async fn a_stream_on_an_engine_filling_blocks_keeps_its_place() {
    let (busy, r) = busy_engine_and_router().await;
    let sync = json!({"worker_id": "busy", "url": busy, "hashes": []});
    assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    let stream = r.complete(json!({"model": "m", "prompt": "slow one", "stream": true}));
    let filling = async {
        for n in 1u64.. {
            let batch = json!({"worker_id": "busy", "evicted_hashes": [], "stored_hashes": [format!("{n:016x}")]});
            let resp = r.internal("/internal/eviction", batch).await;
            assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let resp = tokio::select! {
        resp = stream => resp,
        () = filling => unreachable!(),
    };
    assert_eq!(resp.status(), 200, "the queued stream was cancelled");
    assert!(resp.text().await.unwrap().contains("[DONE]"));
}

/// A non-streamed answer on a worker whose sidecar reports the blocks its
/// engine fills is watched as a stream is: waited for while blocks are
/// filled, and given up (retried elsewhere) when a whole window passes
/// without any, a wedged engine, where it waited `first_byte_timeout` (an
/// hour) before. Not one about an image, whose blocks the sidecar does not
/// report.
#[tokio::test]
async fn a_non_streamed_answer_is_waited_for_while_its_engine_fills_blocks() {
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|axum::Json(body): axum::Json<Value>| async move {
                if body["prompt"] == "wedged" {
                    futures::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(900)).await;
                axum::Json(json!({"choices": [{"text": "done"}]}))
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(900)).await;
                axum::Json(json!({"choices": [{"message": {"role": "assistant", "content": "a cat"}}]}))
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let engine = serve_engine(app).await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let r = router(&[("a-engine", &engine), ("b-good", &good.url)], |raw| {
        raw.first_token_timeout = Duration::from_millis(300);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    let stored =
        |n: u64| json!({"worker_id": "a-engine", "evicted_hashes": [], "stored_hashes": [format!("{n:016x}")]});
    let sync = json!({"worker_id": "a-engine", "url": engine, "hashes": []});
    assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    assert_eq!(r.internal("/internal/eviction", stored(1)).await.status(), 200);
    // A session pinned to a-engine (a session pins on its first success):
    // a-engine answers in 900 ms, three windows, and the blocks it fills
    // meanwhile keep the request waiting.
    let send = |session: &str, prompt: String| {
        r.http
            .post(format!("{}/v1/completions", r.url))
            .header("x-session-id", session)
            .json(&json!({"model": "m", "prompt": prompt}))
            .send()
    };
    let pinned = async {
        for n in 0..100 {
            let id = format!("s{n}");
            let resp = send(&id, format!("hello {n}")).await.unwrap();
            assert_eq!(resp.status(), 200);
            if resp.headers()["x-kvroute-worker"] == "a-engine" {
                return id;
            }
        }
        panic!("no session of 100 pinned to a-engine");
    };
    let filling = async {
        for n in 2u64.. {
            assert_eq!(r.internal("/internal/eviction", stored(n)).await.status(), 200);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let session = tokio::select! {
        id = pinned => id,
        () = filling => unreachable!(),
    };
    // Its sidecar silent (dead, say), nothing is known of the engine: the
    // answer is waited for, not given up and charged.
    let resp = send(&session, "its sidecar silent".into()).await.unwrap();
    assert_eq!(resp.headers()["x-kvroute-worker"], "a-engine");
    let heartbeats = || async {
        loop {
            let beat = json!({"worker_id": "a-engine", "evicted_hashes": []});
            assert_eq!(r.internal("/internal/eviction", beat).await.status(), 200);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // An image's blocks carry extra keys the sidecar does not report: an
    // answer about one is not judged by blocks (it was given up as stalled).
    let image = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]}]});
    let about_image = r
        .http
        .post(format!("{}/v1/chat/completions", r.url))
        .header("x-session-id", session.as_str())
        .json(&image)
        .send();
    let resp = tokio::select! {
        resp = about_image => resp.unwrap(),
        () = heartbeats() => unreachable!(),
    };
    assert_eq!(resp.headers()["x-kvroute-worker"], "a-engine");
    // Wedged, filling nothing while its sidecar reports on: given up after a
    // window, answered elsewhere.
    let wedged = tokio::time::timeout(Duration::from_secs(20), send(&session, "wedged".into()));
    let resp = tokio::select! {
        resp = wedged => resp.expect("given up, not held an hour"),
        () = heartbeats() => unreachable!(),
    };
    assert_eq!(resp.unwrap().headers()["x-kvroute-worker"], "b-good");
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kind=\"stalled\"} 1"), "{metrics}");
}

/// An engine whose API server answers bad requests (4xx) while its core is
/// wedged is not making progress: a stream waiting there is still given up
/// at its deadline.
#[tokio::test]
async fn answers_refused_by_a_wedged_engine_are_not_progress() {
    let app = Router::new().route(
        "/v1/completions",
        post(|axum::Json(body): axum::Json<Value>| async move {
            if body["stream"] != true {
                return (StatusCode::BAD_REQUEST, "bad request").into_response();
            }
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>()))
                .unwrap()
        }),
    );
    let wedged = serve_engine(app).await;
    let r = router(&[("wedged", &wedged)], |raw| {
        raw.retries = 0;
        raw.first_token_timeout = Duration::from_millis(300);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    let stream = r.complete(json!({"model": "m", "prompt": "hello", "stream": true}));
    let refused = async {
        loop {
            let _ = r.complete(json!({"model": "m", "prompt": "bad one"})).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let resp = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            resp = stream => resp,
            () = refused => unreachable!(),
        }
    })
    .await
    .expect("given up at its deadline, not held by 4xx answers");
    assert_eq!(resp.status(), 504);
}

/// A non-streamed answer comes whole, after its last token: its prompt
/// counts as pending prefill only until the timing model says its first
/// token came, not for its whole generation (batch traffic made a worker
/// look seconds deep in queued prefill).
#[tokio::test]
async fn a_non_streamed_request_stops_counting_as_pending_prefill() {
    let hang = fake_worker("hang", Behaviour::Hang).await;
    // A model whose first token for 2,000 tokens comes 12 s after they are
    // sent: the first look comes well within that, however loaded the box.
    let r = router(&[("hang", &hang.url)], |raw| raw.predicted_ttft.prefill_us_per_token = 6_000.0).await;
    let body = json!({"model": "m", "prompt": prompt(2_000)});
    let _in_flight = tokio::spawn(r.http.post(format!("{}/v1/completions", r.url)).json(&body).send());
    let load = || async {
        let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
        let load = &workers["workers"][0]["load"];
        (load["inflight"].as_u64().unwrap(), load["pending_prefill_tokens"].as_u64().unwrap())
    };
    // Counted while the model says its prefill is under way...
    let pending = support::eventually("the request in flight", || async {
        let (inflight, pending) = load().await;
        (inflight == 1).then_some(pending)
    })
    .await;
    assert!(pending >= 1_900, "its prompt pending: {pending}");
    // ... and no longer once it says the first token came, the answer not yet
    // (waited for beyond `eventually`'s 20 s: the model's 12 s come first).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while load().await != (1, 0) {
        assert!(tokio::time::Instant::now() < deadline, "its prefill still pending: {:?}", load().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A round-robin router probing every 100 ms that ejects a worker at its
/// first failed probe.
async fn ejecting_at_its_first_failed_probe(workers: &[(&str, &str)]) -> TestRouter {
    router(workers, |raw| {
        raw.policy = "round_robin".into();
        raw.health_check_interval = Duration::from_millis(100);
        raw.eject_after_failures = 1;
    })
    .await
}

/// Sends a completion of `prompt` and waits until it is in flight at the
/// router's first worker; its response, when it comes.
async fn held_at_the_first_worker(
    r: &TestRouter,
    prompt: &str,
) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    let body = json!({"model": "m", "prompt": prompt});
    let sent = tokio::spawn(r.http.post(format!("{}/v1/completions", r.url)).json(&body).send());
    support::eventually("the request at the first worker", || async {
        let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
        (workers["workers"][0]["load"]["inflight"] == 1).then_some(())
    })
    .await;
    sent
}

/// A worker ejected while a request waits for its answer's headers: the
/// request is tried elsewhere at once (nothing reached the client).
#[tokio::test]
async fn a_request_waiting_on_a_worker_that_is_ejected_is_tried_elsewhere() {
    let sick = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = sick.clone();
    let app = Router::new().route("/v1/completions", post(futures::future::pending::<&'static str>)).route(
        "/health",
        get(move || {
            let sick = s.load(Ordering::SeqCst);
            async move { if sick { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK } }
        }),
    );
    let hang = serve_engine(app).await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let r = ejecting_at_its_first_failed_probe(&[("a-hang", &hang), ("b-good", &good.url)]).await;
    let sent = held_at_the_first_worker(&r, "hello").await;
    sick.store(true, Ordering::SeqCst);
    let resp =
        tokio::time::timeout(Duration::from_secs(20), sent).await.expect("retried once ejected").unwrap().unwrap();
    assert_eq!(resp.headers()["x-kvroute-worker"], "b-good");
}

/// ... but not a worker seen producing (another answer began there
/// lately): ejected for its probes (a `/health` that times out on an engine
/// saturated with work), it answers what it holds. Cancelled, each such
/// request ran again from the start on workers as busy.
#[tokio::test]
async fn a_request_on_an_ejected_worker_seen_producing_waits_for_its_answer() {
    let sick = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let release = Arc::new(tokio::sync::Notify::new());
    let (s, rel) = (sick.clone(), release.clone());
    let probes_while_sick = Arc::new(AtomicUsize::new(0));
    let p = probes_while_sick.clone();
    let completions = move |body: axum::Json<Value>| {
        let release = rel.clone();
        async move {
            if body["prompt"] != "quick" {
                release.notified().await;
            }
            axum::Json(json!({"choices": [{"text": "hi"}]}))
        }
    };
    let app = Router::new().route("/v1/completions", post(completions)).route(
        "/health",
        get(move || {
            let sick = s.load(Ordering::SeqCst);
            // Released once the router has probed (and ejected) it ten times.
            if sick && p.fetch_add(1, Ordering::SeqCst) == 10 {
                release.notify_one();
            }
            async move { if sick { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK } }
        }),
    );
    let busy = serve_engine(app).await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let r = ejecting_at_its_first_failed_probe(&[("a-busy", &busy), ("b-good", &good.url)]).await;
    // An answer begins on a-busy (round-robin: then b-good, then a-busy).
    let quick = r.complete(json!({"model": "m", "prompt": "quick"})).await;
    assert_eq!(quick.headers()["x-kvroute-worker"], "a-busy");
    assert_eq!(r.complete(json!({"model": "m", "prompt": "quick"})).await.headers()["x-kvroute-worker"], "b-good");
    let sent = held_at_the_first_worker(&r, "a long answer").await;
    sick.store(true, Ordering::SeqCst);
    let resp = tokio::time::timeout(Duration::from_secs(20), sent).await.expect("answered").unwrap().unwrap();
    assert!(probes_while_sick.load(Ordering::SeqCst) > 10, "released by the probes");
    assert_eq!(resp.headers()["x-kvroute-worker"], "a-busy", "cancelled at the ejection and run again");
    assert_eq!(good.hits.load(Ordering::SeqCst), 1);
}

/// Past `first_byte_timeout` a non-streamed answer is long, not lost: a
/// 504, with the request not run again on the other workers and no worker
/// charged for it.
#[tokio::test]
async fn a_non_streamed_answer_past_the_timeout_is_not_run_again() {
    let (a, b) = (fake_worker("a", Behaviour::Hang).await, fake_worker("b", Behaviour::Hang).await);
    let r = router(&[("a", &a.url), ("b", &b.url)], |raw| {
        raw.first_byte_timeout = Duration::from_millis(200);
        raw.eject_after_failures = 1;
    })
    .await;
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": "a long answer"})).await).await;
    assert_eq!(status, 504);
    assert_eq!(a.hits.load(Ordering::SeqCst) + b.hits.load(Ordering::SeqCst), 1, "run once");
    assert!(healthy(&r, "a").await && healthy(&r, "b").await);
}

#[tokio::test]
async fn all_workers_failing_is_a_502_and_hanging_is_a_504() {
    let bad = fake_worker("bad", Behaviour::Status(503)).await;
    let r = router(&[("bad", &bad.url)], |raw| raw.retries = 0).await;
    let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": "x"})).await).await;
    assert_eq!(status, 502);
    assert_eq!(body["error"]["type"], "upstream_error");

    let hang = fake_worker("hang", Behaviour::Hang).await;
    let r = router(&[("hang", &hang.url)], |raw| {
        raw.retries = 0;
        raw.first_byte_timeout = Duration::from_millis(200);
    })
    .await;
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": "x"})).await).await;
    assert_eq!(status, 504);
}

/// An engine that counts its health probes, and answers them (`answers`) or
/// never does.
async fn probe_counting_engine(answers: bool) -> (String, Arc<AtomicUsize>) {
    let probes = Arc::new(AtomicUsize::new(0));
    let counted = probes.clone();
    let health = get(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            if !answers {
                futures::future::pending::<()>().await;
            }
            "ok"
        }
    });
    (serve_engine(Router::new().route("/health", health)).await, probes)
}

/// Each worker's health check runs on its own: one engine whose `/metrics`
/// stalls (an overloaded vLLM's can) held every round of probes, and with
/// it every other worker's probe period and ejection, up to three timeouts.
#[tokio::test]
async fn an_engine_that_stalls_its_metrics_does_not_slow_the_others_probes() {
    let metrics_asked = Arc::new(AtomicUsize::new(0));
    let asked = metrics_asked.clone();
    let stalls = Router::new().route("/health", get(|| async { "ok" })).route(
        "/metrics",
        get(move || {
            asked.fetch_add(1, Ordering::SeqCst);
            futures::future::pending::<&'static str>()
        }),
    );
    let stalling = serve_engine(stalls).await;
    let (other, probed) = probe_counting_engine(true).await;
    let _r = router(&[("stalls", &stalling), ("other", &other)], |raw| {
        raw.health_check_interval = Duration::from_millis(20);
        raw.health_check_timeout = Duration::from_secs(3600);
    })
    .await;
    eventually("the other worker probed five times", || async { (probed.load(Ordering::SeqCst) >= 5).then_some(()) })
        .await;
    assert!(metrics_asked.load(Ordering::SeqCst) <= 1, "the stalled page is asked once at a time");
}

/// A worker whose probe times out at the probe interval is probed as often
/// as the others: a tick that came while its probe ran was skipped, and it
/// was probed every other interval, so ejected twice as late.
#[tokio::test]
async fn a_probe_that_times_out_is_followed_by_the_next_at_once() {
    let (hanging, hung) = probe_counting_engine(false).await;
    let (other, answered) = probe_counting_engine(true).await;
    let _r = router(&[("hangs", &hanging), ("other", &other)], |raw| {
        raw.health_check_interval = Duration::from_millis(100);
        raw.health_check_timeout = Duration::from_millis(100);
        raw.eject_after_failures = 1_000;
    })
    .await;
    eventually("ten probes of the answering worker", || async {
        (answered.load(Ordering::SeqCst) >= 10).then_some(())
    })
    .await;
    // Every other interval would be about 5.
    let probed = hung.load(Ordering::SeqCst);
    assert!(probed >= 7, "the hung worker probed {probed} times while the other was probed 10");
}

/// A worker whose sidecar moves it to another URL is probed there, though
/// its probes at the old one ran back to back (each timing out at the
/// interval): the repeated check kept the worker as it was, and probed the
/// old URL for ever.
#[tokio::test]
async fn a_moved_worker_is_probed_at_its_new_url() {
    let (old, _) = probe_counting_engine(false).await;
    let (new, probed_there) = probe_counting_engine(true).await;
    let r = router(&[], |raw| {
        raw.health_check_interval = Duration::from_millis(50);
        raw.health_check_timeout = Duration::from_millis(50);
    })
    .await;
    let sync = |url: &str, seq: u64| json!({"worker_id": "w1", "url": url, "models": ["m"], "hashes": [], "seq": seq, "epoch": "e1"});
    assert_eq!(r.internal("/internal/sync", sync(&old, 1)).await.status(), 200);
    // Its checks at the old URL run back to back.
    let ejected = |r: &TestRouter| {
        let http = r.http.clone();
        let url = format!("{}/admin/workers", r.url);
        async move {
            let workers: Value = http.get(url).send().await.unwrap().json().await.unwrap();
            (workers["workers"][0]["healthy"] == false).then_some(())
        }
    };
    eventually("the worker ejected at its old URL", || ejected(&r)).await;
    assert_eq!(r.internal("/internal/sync", sync(&new, 2)).await.status(), 200);
    eventually("a probe at the new URL", || async { (probed_there.load(Ordering::SeqCst) > 0).then_some(()) }).await;
}

/// A worker's redirect is not followed: a 307 re-sent the prompt wherever it
/// pointed (another worker, counted on the first; the router itself; an
/// internal address), and an ingress's 301 turned a completion into a GET.
/// It is the worker's failure, a 502, for completions and passed-through
/// endpoints alike.
#[tokio::test]
async fn redirects_from_a_worker_are_not_followed() {
    let target = fake_worker("target", Behaviour::Ok).await;
    let location = format!("{}/v1/completions", target.url);
    let redirect = move || {
        let location = location.clone();
        async move { (StatusCode::TEMPORARY_REDIRECT, [("location", location)]).into_response() }
    };
    let app = Router::new().route("/v1/completions", post(redirect.clone())).route("/v1/embeddings", post(redirect));
    let engine = serve_engine(app).await;
    let r = router(&[("redirects", &engine)], |raw| raw.retries = 0).await;
    let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": "x"})).await).await;
    assert_eq!(status, 502, "{body}");
    let embeddings = r.http.post(format!("{}/v1/embeddings", r.url)).json(&json!({"model": "m", "input": "x"}));
    assert_eq!(embeddings.send().await.unwrap().status(), 502);
    assert_eq!(target.hits.load(Ordering::SeqCst), 0, "nothing followed the redirect");
}

/// An engine's 4xx reaches the client as it was, with the headers that say
/// when to come back (`retry-after` on a 429) and how to authenticate.
#[tokio::test]
async fn client_errors_pass_through_untouched() {
    let w = fake_worker("w", Behaviour::Status(429)).await;
    let r = router(&[("w", &w.url)], |_| {}).await;
    let resp = r.complete(json!({"model": "m", "prompt": "x"})).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(
        (resp.headers().get("retry-after"), resp.headers().get("www-authenticate")),
        (Some(&"7".parse().unwrap()), Some(&"Bearer".parse().unwrap()))
    );
    assert_eq!(w.hits.load(Ordering::SeqCst), 1, "4xx is not retried");
}

#[tokio::test]
async fn bad_input_statuses() {
    let w = fake_worker("w", Behaviour::Ok).await;
    let r = router(&[("w", &w.url)], |raw| raw.max_body_bytes = 4096).await;
    let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": 42})).await).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "prompt");
    let resp = r
        .http
        .post(format!("{}/v1/chat/completions", r.url))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": {"x": 1}}]}))
        .send()
        .await
        .unwrap();
    let (status, body) = error_of(resp).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("messages[0].content")));
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": prompt(10_000)})).await).await;
    assert_eq!(status, 413);
    assert_eq!(w.hits.load(Ordering::SeqCst), 0, "nothing bad was forwarded");
}

#[tokio::test]
async fn no_healthy_worker_is_a_503_and_not_ready() {
    let r = router(&[], |_| {}).await;
    let resp = r.complete(json!({"model": "m", "prompt": "x"})).await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let ready = r.http.get(format!("{}/ready", r.url)).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let health = r.http.get(format!("{}/health", r.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

/// A worker is healthy from its admission, but the router is ready only
/// once one has answered a probe: an unreachable one is not.
#[tokio::test]
async fn ready_waits_for_a_worker_that_answered_a_probe() {
    let gone = refused_url();
    let r = router(&[("gone", &gone.url)], |_| {}).await;
    let ready = r.http.get(format!("{}/ready", r.url)).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let body: Value = ready.json().await.unwrap();
    assert_eq!((body["healthy_workers"].as_u64(), body["probed_workers"].as_u64()), (Some(1), Some(0)), "{body}");
    let w = fake_worker("w", Behaviour::Ok).await;
    let r = router(&[("w", &w.url)], |_| {}).await;
    eventually("the router is ready", || async {
        let ready = r.http.get(format!("{}/ready", r.url)).send().await.unwrap();
        (ready.status() == 200).then_some(())
    })
    .await;
}

#[tokio::test]
async fn internal_endpoints_require_the_token() {
    let r = router(&[], |_| {}).await;
    let body = json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "hashes": []});
    let resp = r.http.post(format!("{}/internal/sync", r.url)).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 401);
    let resp = r
        .http
        .post(format!("{}/internal/sync", r.url))
        .bearer_auth("wrong-token-wrong-token")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    // Counted on the router too: a sidecar with the wrong token is not only
    // the sidecar's to report.
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvroute_events_applied_total{kind=\"unauthorized_push\"} 2"), "{metrics}");
    let resp = r.internal("/internal/sync", body).await;
    assert_eq!(resp.status(), 200);
    let ack: Value = resp.json().await.unwrap();
    assert_eq!(ack["outcome"], "applied");
    assert!(ack["router_epoch"].as_str().unwrap().len() == 16);
}

/// With per-worker tokens, a sidecar speaks only for its own id: it cannot
/// register another id, move another worker's URL or write its keys.
#[tokio::test]
async fn per_worker_tokens_confine_each_sidecar_to_its_own_worker() {
    let dir = std::env::temp_dir().join(format!("kvroute-worker-tokens-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens");
    std::fs::write(&file, "# id=token\nw1=token-of-worker-one-123\nw2=token-of-worker-two-456\n").unwrap();
    let r = router(&[], |raw| raw.worker_tokens_file = Some(file.clone())).await;
    let push = |path: &'static str, token: &'static str, body: Value| {
        r.http.post(format!("{}{path}", r.url)).bearer_auth(token).json(&body).send()
    };
    let sync = |id: &str, url: &str| json!({"worker_id": id, "url": url, "hashes": []});
    assert_eq!(
        push("/internal/sync", "token-of-worker-one-123", sync("w1", "http://10.0.0.1:8000")).await.unwrap().status(),
        200
    );
    assert_eq!(
        push("/internal/sync", "token-of-worker-two-456", sync("w2", "http://10.0.0.2:8000")).await.unwrap().status(),
        200
    );
    // w2's token cannot move w1, register a new id, or write w1's keys.
    assert_eq!(
        push("/internal/sync", "token-of-worker-two-456", sync("w1", "http://evil:80")).await.unwrap().status(),
        403
    );
    assert_eq!(
        push("/internal/sync", "token-of-worker-two-456", sync("w9", "http://evil:80")).await.unwrap().status(),
        403
    );
    let evict = json!({"worker_id": "w1", "evicted_hashes": [], "stored_hashes": ["00000000000000aa"]});
    assert_eq!(push("/internal/eviction", "token-of-worker-two-456", evict).await.unwrap().status(), 403);
    // The shared token authorizes no push once per-worker tokens are set.
    assert_eq!(r.internal("/internal/sync", sync("w1", "http://evil:80")).await.status(), 401);
    let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
    let url_of =
        |id: &str| workers["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).unwrap()["url"].clone();
    assert_eq!(url_of("w1"), "http://10.0.0.1:8000");
    assert_eq!(workers["workers"].as_array().unwrap().len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn pushes_never_move_a_static_worker_and_bad_urls_are_refused() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let elsewhere = refused_url();
    let ack = r.internal("/internal/sync", json!({"worker_id": "w1", "url": elsewhere.url, "hashes": []})).await;
    assert_eq!(ack.status(), 200);
    assert_eq!(r.complete(json!({"model": "m", "prompt": "x"})).await.status(), 200, "still the operator's URL");
    for bad in ["http://", "http://a b c", "ftp://host:1", "http://user:pw@host:1", "not a url"] {
        let resp = r.internal("/internal/sync", json!({"worker_id": "w2", "url": bad, "hashes": []})).await;
        assert_eq!(resp.status(), 400, "{bad}");
    }
}

#[tokio::test]
async fn stored_hashes_are_bounded_like_syncs() {
    let r = router(&[], |raw| raw.max_sync_keys = 4).await;
    let ok = r.internal("/internal/sync", json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "hashes": []})).await;
    assert_eq!(ok.status(), 200);
    let keys = |from: u64, n: u64| (from..from + n).map(|i| format!("{i:016x}")).collect::<Vec<_>>();
    let push =
        |stored: Vec<String>| r.internal("/internal/eviction", json!({"worker_id": "w1", "stored_hashes": stored}));
    assert_eq!(push(keys(0, 5)).await.status(), 413, "one batch beyond max_sync_keys");
    assert_eq!(push(keys(0, 3)).await.status(), 200);
    assert_eq!(push(keys(10, 3)).await.status(), 413, "the worker would hold 6 > 4 entries");
    // Evicting keys it does not hold makes no room: 3 held + 2 stored > 4.
    let evicting = |stored: Vec<String>, evicted: Vec<String>| {
        r.internal("/internal/eviction", json!({"worker_id": "w1", "stored_hashes": stored, "evicted_hashes": evicted}))
    };
    assert_eq!(evicting(keys(10, 2), keys(100, 2)).await.status(), 413, "made-up evictions");
    assert_eq!(evicting(keys(10, 2), keys(0, 2)).await.status(), 200, "its own evictions make room");
    let cleared = json!({"worker_id": "w1", "cleared": true, "stored_hashes": keys(20, 4)});
    assert_eq!(
        r.internal("/internal/eviction", cleared).await.status(),
        200,
        "a cleared worker holds only what it stores"
    );
    // At the cap, keys it already holds take no room (a repair re-sending
    // them, or confirming its speculative entries): they were counted as new.
    assert_eq!(push(keys(20, 4)).await.status(), 200, "re-stored held keys");
    assert_eq!(push([keys(20, 4), keys(30, 1)].concat()).await.status(), 413, "one new key past the cap");
}

/// `--served-model-name a b`: vLLM caches one model's blocks whichever name
/// a request gives, and the sidecar keys them by its base name. A request
/// for the alias is keyed as the base and finds the holder; it matched
/// nothing under its own name. The ack says the router takes aliases.
#[tokio::test]
async fn a_request_for_an_alias_is_keyed_as_its_base_model() {
    let w1 = fake_worker("w1", Behaviour::Ok).await;
    let w2 = fake_worker("w2", Behaviour::Ok).await;
    let r = router(&[], |_| {}).await;
    let text = prompt(200);
    for (id, url, hashes) in [("w1", &w1.url, vec![]), ("w2", &w2.url, keys_of("a", &text))] {
        let sync = json!({"worker_id": id, "url": url, "models": ["a", "b", "lora1"], "model_aliases": {"b": "a"},
                          "block_size": 16, "hashes": hashes, "seq": 1, "epoch": "e1"});
        let resp = r.internal("/internal/sync", sync).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.json::<Value>().await.unwrap()["model_aliases"], true);
    }
    for model in ["a", "b"] {
        let debug = r.explain(json!({"model": model, "prompt": text})).await;
        assert_eq!(debug["decision"]["worker"], "w2", "{model}: {debug}");
        let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w2").unwrap();
        assert_eq!(row["matched_blocks"], 12, "{model}");
        let resp = r.complete(json!({"model": model, "prompt": text})).await;
        assert_eq!(resp.headers()["x-kvroute-worker"], "w2");
    }
    let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(workers["workers"][0]["model_aliases"], json!({"b": "a"}), "{workers}");
    // An adapter's blocks are its own: not keyed as the base.
    let debug = r.explain(json!({"model": "lora1", "prompt": text})).await;
    let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w2").unwrap();
    assert_eq!(row["matched_blocks"], 0, "{debug}");
    // A worker that does not list `b` has no say.
    let w3 = fake_worker("w3", Behaviour::Ok).await;
    let sync = json!({"worker_id": "w3", "url": w3.url, "models": ["a"], "hashes": []});
    assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    let debug = r.explain(json!({"model": "b", "prompt": text})).await;
    let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w2").unwrap();
    assert_eq!(row["matched_blocks"], 12, "{debug}");
    // Workers that disagree (w1 now serves `b` as an adapter of its own, or
    // a sidecar lies): `b` keeps its own name.
    let sync =
        json!({"worker_id": "w1", "url": w1.url, "models": ["a", "b", "lora1"], "hashes": [], "seq": 2, "epoch": "e1"});
    assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    let debug = r.explain(json!({"model": "b", "prompt": text})).await;
    let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w2").unwrap();
    assert_eq!(row["matched_blocks"], 0, "{debug}");
    // An alias map that names a model the worker does not serve is refused.
    let bad = json!({"worker_id": "w1", "url": w1.url, "models": ["a"], "model_aliases": {"b": "a"}, "hashes": []});
    assert_eq!(r.internal("/internal/sync", bad).await.status(), 400);
}

/// vLLM computes a prompt whose logprobs are asked for from scratch
/// (`skip_reading_prefix_cache`): such a request is placed by load, every
/// token counted as prefill, not sent to the holder of its prefix as a hit.
#[tokio::test]
async fn a_request_for_prompt_logprobs_is_not_routed_as_a_cache_hit() {
    let w1 = fake_worker("w1", Behaviour::Ok).await;
    let w2 = fake_worker("w2", Behaviour::Ok).await;
    let r = router(&[], |_| {}).await;
    let text = prompt(200);
    for (id, url, hashes) in [("w1", &w1.url, vec![]), ("w2", &w2.url, keys_of("m", &text))] {
        let sync = json!({"worker_id": id, "url": url, "models": ["m"], "block_size": 16, "hashes": hashes});
        assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    }
    let matched = |debug: &Value| {
        let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w2").unwrap().clone();
        (row["matched_blocks"].as_u64().unwrap(), row["uncached_tokens"].as_u64().unwrap())
    };
    let plain = r.explain(json!({"model": "m", "prompt": text})).await;
    assert_eq!((matched(&plain), &plain["skips_prefix_cache"]), ((12, 8), &json!(false)));
    for extra in [json!({"prompt_logprobs": 0}), json!({"echo": true, "logprobs": 1})] {
        let mut body = json!({"model": "m", "prompt": text});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let debug = r.explain(body).await;
        assert_eq!((matched(&debug), &debug["skips_prefix_cache"]), ((0, 200), &json!(true)), "{extra}");
    }
    let echoed = r.explain(json!({"model": "m", "prompt": text, "echo": true})).await;
    assert_eq!(echoed["skips_prefix_cache"], false, "a completion's echo without logprobs reads the cache");
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "echo": true});
    assert_eq!(r.explain(chat).await["skips_prefix_cache"], true, "a chat's echo asks for its prompt's logprobs");
}

#[tokio::test]
async fn sync_registers_and_routes_to_the_holder() {
    let w1 = fake_worker("w1", Behaviour::Ok).await;
    let w2 = fake_worker("w2", Behaviour::Ok).await;
    let r = router(&[], |_| {}).await;
    let text = prompt(200);
    let keys = keys_of("m", &text);
    for (id, url, hashes) in [("w1", &w1.url, vec![]), ("w2", &w2.url, keys.clone())] {
        let resp = r
            .internal(
                "/internal/sync",
                json!({"worker_id": id, "url": url, "models": ["m"], "block_size": 16, "hashes": hashes, "seq": 1, "epoch": "e1"}),
            )
            .await;
        assert_eq!(resp.status(), 200);
    }
    let debug = r.explain(json!({"model": "m", "prompt": text})).await;
    assert_eq!(debug["decision"]["worker"], "w2", "{debug}");
    assert_eq!(debug["decision"]["reason"], "best_cost");
    assert_eq!(debug["tokens"], 200);
    let w2_row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == "w2").unwrap();
    assert_eq!(w2_row["matched_blocks"], 12);
    let resp = r.complete(json!({"model": "m", "prompt": text})).await;
    assert_eq!(resp.headers()["x-kvroute-worker"], "w2");

    // Evicting the head of the chain (with a newer seq) takes w2's match away.
    let resp = r
        .internal("/internal/eviction", json!({"worker_id": "w2", "evicted_hashes": keys, "seq": 2, "epoch": "e1"}))
        .await;
    let ack: Value = resp.json().await.unwrap();
    assert_eq!(ack["outcome"], "applied");
    let index: Value = r.http.get(format!("{}/debug/index", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(index["workers"]["w2"]["confirmed"], 0, "{index}");
    // A replayed old batch is ignored.
    let resp = r
        .internal("/internal/eviction", json!({"worker_id": "w2", "evicted_hashes": [], "seq": 2, "epoch": "e1"}))
        .await;
    assert_eq!(resp.json::<Value>().await.unwrap()["outcome"], "stale");
    // Models are the union of healthy workers'.
    let models: Value = r.http.get(format!("{}/v1/models", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "m");
}

/// A sidecar that fell behind pushes a delta of tens of thousands of keys:
/// decoded and applied off the async workers (on the blocking pool), with
/// the same outcome as a small one.
#[tokio::test]
async fn a_large_delta_is_applied_whole() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let keys: Vec<String> =
        (1..=40_000u64).map(|i| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_string()).collect();
    let stored = json!({"worker_id": "w1", "stored_hashes": keys, "seq": 1, "epoch": "e1"});
    assert!(stored.to_string().len() > 64 << 10, "decoded on the blocking pool");
    let ack: Value = r.internal("/internal/eviction", stored).await.json().await.unwrap();
    assert_eq!(ack["outcome"], "applied", "{ack}");
    let index: Value = r.http.get(format!("{}/debug/index", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(index["workers"]["w1"]["confirmed"], 40_000, "{index}");
    let evicted = json!({"worker_id": "w1", "evicted_hashes": keys[..30_000], "seq": 2, "epoch": "e1"});
    let ack: Value = r.internal("/internal/eviction", evicted).await.json().await.unwrap();
    assert_eq!(ack["outcome"], "applied", "{ack}");
    let index: Value = r.http.get(format!("{}/debug/index", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(index["workers"]["w1"]["confirmed"], 10_000, "{index}");
    // A query axum cannot read (a field twice) gets an OpenAI-shaped error.
    let (status, err) =
        error_of(r.http.get(format!("{}/debug/index?worker=a&worker=b", r.url)).send().await.unwrap()).await;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("worker")), "{err}");
}

/// A request its engine refuses (a 4xx) or fails (a 5xx, retried
/// elsewhere) left nothing there: the speculative entries its routing
/// recorded are taken back, where an answered one's stay until its sidecar
/// confirms them. Left after a 5xx, they drew the same prefix's next
/// requests back to the worker that had just failed it.
#[tokio::test]
async fn a_refused_or_failed_request_leaves_no_speculative_entries() {
    for status in [400, 500] {
        let failing = fake_worker("no", Behaviour::Status(status)).await;
        let fine = fake_worker("ok", Behaviour::Ok).await;
        // Not ejected for its 5xx (which would clear its entries anyway).
        let r = router(&[], |raw| raw.eject_after_failures = 1_000).await;
        for (id, url) in [("no", &failing.url), ("ok", &fine.url)] {
            let sync = json!({"worker_id": id, "url": url, "hashes": []});
            assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
        }
        let speculative = |index: &Value, id: &str| index["workers"][id]["speculative"].as_u64().unwrap();
        for n in 0..16 {
            r.complete(json!({"model": "m", "prompt": format!("{n:03} {}", prompt(400))})).await;
        }
        let (failed, answered) = (failing.hits.load(Ordering::SeqCst), fine.hits.load(Ordering::SeqCst));
        assert!(failed > 0 && answered > 0, "{status}: both workers were chosen ({failed} and {answered})");
        let index: Value = r.http.get(format!("{}/debug/index", r.url)).send().await.unwrap().json().await.unwrap();
        assert_eq!(speculative(&index, "no"), 0, "{status}: {index}");
        assert!(speculative(&index, "ok") > 0, "{status}: {index}");
    }
}

#[tokio::test]
async fn a_burst_of_one_new_prefix_lands_on_one_worker() {
    // Workers with sidecars (an exact index, where a send is a speculative
    // entry), whose engines are still prefilling: nothing confirmed yet.
    let mut fakes = Vec::new();
    for id in ["w1", "w2", "w3"] {
        fakes.push((id, fake_worker(id, Behaviour::Hang).await));
    }
    let r = router(&[], |_| {}).await;
    for (id, w) in &fakes {
        let sync = json!({"worker_id": id, "url": w.url, "hashes": []});
        assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    }
    let shared = prompt(400);
    let first = json!({"model": "m", "prompt": format!("{shared} question 0")});
    let _first = tokio::spawn(r.http.post(format!("{}/v1/completions", r.url)).json(&first).send());
    let holder = eventually("the first at its engine", || async {
        fakes.iter().find(|(_, w)| w.hits.load(Ordering::SeqCst) == 1).map(|(id, _)| *id)
    })
    .await;
    // A follower, before any sidecar confirmed a block: sent to the holder
    // for the blocks it is computing, not placed cold.
    let follower = json!({"model": "m", "prompt": format!("{shared} question 1")});
    let debug: Value =
        r.http.post(format!("{}/debug/route", r.url)).json(&follower).send().await.unwrap().json().await.unwrap();
    assert_eq!(debug["decision"]["worker"], holder, "{debug}");
    assert_eq!(debug["decision"]["reason"], "best_cost", "{debug}");
    let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == holder).unwrap();
    assert_eq!(row["matched_blocks"], 400 / 16, "{row}");
    assert_eq!(row["matched_kind"], "sent", "{row}");
}

#[tokio::test]
async fn block_size_mismatch_is_refused_clearly() {
    let r = router(&[], |_| {}).await;
    let resp = r
        .internal(
            "/internal/sync",
            json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "block_size": 32, "hashes": []}),
        )
        .await;
    let (status, body) = error_of(resp).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "block_size");
    assert!(body["error"]["message"].as_str().unwrap().contains("--block-size"));
    let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(workers["workers"].as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn bad_internal_bodies_name_the_field_and_change_nothing() {
    let r = router(&[], |_| {}).await;
    let resp = r.internal("/internal/sync", json!({"worker_id": "w1", "url": "http://x", "hashes": ["nothex"]})).await;
    let (status, body) = error_of(resp).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("hashes[0]")));
    let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(workers["workers"].as_array().unwrap().len(), 0);
    // An eviction for a worker the router does not know asks for a sync.
    let resp = r.internal("/internal/eviction", json!({"worker_id": "ghost", "evicted_hashes": []})).await;
    assert_eq!(resp.json::<Value>().await.unwrap()["outcome"], "unknown_worker");
}

#[tokio::test]
async fn sessions_pin_a_conversation_and_the_context_api_manages_them() {
    let w1 = fake_worker("w1", Behaviour::Ok).await;
    let w2 = fake_worker("w2", Behaviour::Ok).await;
    let r = router(&[("w1", &w1.url), ("w2", &w2.url)], |raw| raw.policy = "round_robin".into()).await;
    let resp = r
        .http
        .post(format!("{}/v1/context", r.url))
        .header("x-session-ttl", "60")
        .json(&json!({"model": "m", "prompt": "start"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-session-id"].to_str().unwrap().to_owned();
    let pinned = resp.headers()["x-kvroute-worker"].to_str().unwrap().to_owned();
    // Round robin would alternate; the session keeps every turn on one worker.
    for _ in 0..4 {
        let resp = r
            .http
            .post(format!("{}/v1/completions", r.url))
            .header("x-session-id", &id)
            .json(&json!({"model": "m", "prompt": "next turn"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-kvroute-worker"].to_str().unwrap(), pinned);
    }
    let del = r.http.delete(format!("{}/v1/context/{id}", r.url)).send().await.unwrap();
    assert_eq!(del.status(), 204);
    let del = r.http.delete(format!("{}/v1/context/{id}", r.url)).send().await.unwrap();
    assert_eq!(del.status(), 404);
    // An id that is not UTF-8 gets an OpenAI-shaped error, as every other.
    let (status, err) = error_of(r.http.delete(format!("{}/v1/context/%FF", r.url)).send().await.unwrap()).await;
    assert_eq!(status, 400, "{err}");
    let bad = r
        .http
        .post(format!("{}/v1/completions", r.url))
        .header("x-session-id", "has space")
        .json(&json!({"model": "m", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // A context refused before its request began (a bad TTL here) is
    // recorded as every refusal is, with no worker.
    let refused = "kvroute_request_duration_seconds_count{policy=\"round_robin\",worker=\"none\",status=\"4xx\"}";
    let before = r.metric(refused).await.unwrap_or(0.0);
    let create = r.http.post(format!("{}/v1/context", r.url)).header("x-session-ttl", "soon");
    let resp = create.json(&json!({"model": "m", "prompt": "start"})).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(r.metric(refused).await, Some(before + 1.0));
}

#[tokio::test]
async fn an_unknown_model_is_a_404_like_vllm() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[], |_| {}).await;
    let ack =
        r.internal("/internal/sync", json!({"worker_id": "w1", "url": w.url, "models": ["m"], "hashes": []})).await;
    assert_eq!(ack.status(), 200);
    let (status, body) = error_of(r.complete(json!({"model": "nope", "prompt": "x"})).await).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["param"], "model");
    assert_eq!(r.complete(json!({"model": "m", "prompt": "x"})).await.status(), 200);
}

/// At the cap a new context takes the place of the least recently used
/// one: no client can shut sessions out by filling the table.
#[tokio::test]
async fn a_full_session_table_makes_room_for_new_contexts() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.max_sessions = 1).await;
    let create = || r.http.post(format!("{}/v1/context", r.url)).json(&json!({"model": "m", "prompt": "hi"})).send();
    let first = create().await.unwrap();
    assert_eq!(first.status(), 200);
    let first_id = first.headers()["x-session-id"].to_str().unwrap().to_owned();
    let second = create().await.unwrap();
    assert_eq!(second.status(), 200);
    assert!(second.headers().contains_key("x-session-id"));
    let end = |id: String| r.http.delete(format!("{}/v1/context/{id}", r.url)).send();
    assert_eq!(end(first_id).await.unwrap().status(), 404, "the first made room");
}

#[tokio::test]
async fn prompts_beyond_max_prompt_tokens_are_refused_before_or_after_tokenizing() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let gpt2 = kvroute_shared::testdata::tokenizer_dir("gpt2").unwrap_or_else(|why| panic!("no gpt2 tokenizer: {why}"));
    let r = router(&[("w1", &w.url)], |raw| {
        raw.max_prompt_tokens = 100;
        raw.tokenizer = Some(gpt2);
    })
    .await;
    // 150 words of GPT-2 tokens: more than 100 (counted, 400).
    let words = vec!["hello"; 150].join(" ");
    let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": words})).await).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("150 tokens"), "{body}");
    // Far more bytes than 100 tokens could ever take: refused unread (413).
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": prompt(5_000)})).await).await;
    assert_eq!(status, 413);
    let explain =
        r.http.post(format!("{}/debug/route", r.url)).json(&json!({"model": "m", "prompt": prompt(5_000)})).send();
    assert_eq!(explain.await.unwrap().status(), 413, "/debug/route has the same limits");
    // Refused as it arrives: a completion's body past `max_body_bytes` that
    // never ends is a 413, not read on until `body_read_timeout` (408).
    {
        let r = router(&[("w1", &w.url)], |raw| raw.max_body_bytes = 1024).await;
        let path = "/v1/completions";
        let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        tx.send(Ok(Bytes::from(format!("{{\"model\": \"m\", \"prompt\": \"{}", prompt(2_000))))).await.unwrap();
        let never_ends = reqwest::Body::wrap_stream(tokio_stream_from(rx));
        let resp = r.http.post(format!("{}{path}", r.url)).body(never_ends).send().await.unwrap();
        assert_eq!(resp.status(), 413, "{path} refused before the body ended");
        drop(tx);
    }
    // A batch's prompts are each held to the prompt's bound, not the whole
    // body: 200 prompts of 60 tokens (past 100 × 16 bytes in all) are
    // vLLM's to serve. It was a 413.
    let sixty = vec!["hello"; 60].join(" ");
    let batch = json!({"model": "m", "prompt": vec![sixty.as_str(); 200]});
    assert!(batch.to_string().len() > 100 * 16 * 30);
    let explain = r.http.post(format!("{}/debug/route", r.url)).json(&batch).send();
    assert_eq!(explain.await.unwrap().status(), 200, "/debug/route has the same limits");
    assert_eq!(r.complete(batch).await.status(), 200);
    let ids = json!({"model": "m", "prompt": vec![vec![1; 60]; 200]});
    assert_eq!(r.complete(ids).await.status(), 200);
    // ... as are prompt embeddings (vLLM's `--enable-prompt-embeds`): a
    // tensor in base64, no prompt to key. It was a 413, or a 400 without
    // a `prompt`.
    let embeds = json!({"model": "m", "prompt_embeds": "A".repeat(100_000)});
    assert_eq!(r.complete(embeds).await.status(), 200);
    let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": null})).await).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("prompt")), "{body}");
    // A batch's prompts each count, not only the first (which is keyed).
    let batch = json!({"model": "m", "prompt": [[1], vec![1; 150]]});
    let (status, body) = error_of(r.complete(batch).await).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("150 tokens"), "{body}");
    // ... as the engine keeps them (`truncate_prompt_tokens`).
    let batch = json!({"model": "m", "prompt": [[1], vec![1; 150]], "truncate_prompt_tokens": 64});
    assert_eq!(r.complete(batch).await.status(), 200);
    assert_eq!(r.complete(json!({"model": "m", "prompt": prompt(50)})).await.status(), 200);
    assert_eq!(w.hits.load(Ordering::SeqCst), 5, "refused prompts never reached the engine");
    // Truncated by the engine (`truncate_prompt_tokens`), it is within the
    // limit: counted as the engine keeps it. It was a 400.
    let truncated = json!({"model": "m", "prompt": words, "truncate_prompt_tokens": 64});
    assert_eq!(r.complete(truncated).await.status(), 200);
    // -1 is the engine's input limit (`max_prompt_tokens`): kept to it, not
    // refused (vLLM checks no length then). It was a 400.
    let to_limit = json!({"model": "m", "prompt": words, "truncate_prompt_tokens": -1});
    assert_eq!(r.complete(to_limit).await.status(), 200);
    // Nor is a truncated prompt held to 16 bytes a token: vLLM truncates
    // any length. It was a 413.
    let long = json!({"model": "m", "prompt": prompt(5_000), "truncate_prompt_tokens": 64});
    let explained = r.explain(long.clone()).await;
    assert_eq!(
        (explained["tokens"].as_u64(), explained["unkeyed_tokens"].as_u64()),
        (Some(0), Some(64)),
        "{explained}"
    );
    assert_eq!(r.complete(long).await.status(), 200);
    // A truncation past the limit is vLLM's 400, not a count of tokens
    // added to the worker's pending prefill (up to 2⁶³).
    for keep in [101, i64::MAX] {
        let over = json!({"model": "m", "prompt": prompt(5_000), "truncate_prompt_tokens": keep});
        let (status, body) = error_of(r.complete(over).await).await;
        assert_eq!((status, body["error"]["param"].as_str()), (400, Some("truncate_prompt_tokens")), "{body}");
    }
}

/// Without the model's tokenizer the router's "tokens" are bytes, about
/// four to a real token: a prompt of more bytes than `max_prompt_tokens`
/// (but far fewer tokens) is the engine's to count, not refused.
#[tokio::test]
async fn without_a_tokenizer_bytes_are_not_counted_as_tokens() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.max_prompt_tokens = 100).await;
    let words = vec!["hello"; 50].join(" "); // 299 bytes, 50 tokens
    assert_eq!(r.complete(json!({"model": "m", "prompt": words})).await.status(), 200);
    // Past 16 bytes a token it is refused still.
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": prompt(5_000)})).await).await;
    assert_eq!(status, 413);
    // Token ids are tokens: counted.
    let ids: Vec<u32> = (0..150).collect();
    let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": ids})).await).await;
    assert_eq!(status, 400, "{body}");
}

/// A chat body may carry media (base64 images) that are no prompt text:
/// only `max_body_bytes` bounds it, not the prompt's 16 bytes a token
/// (a 600 kB image was a 413 "prompt too long" for a 32k-token model).
#[tokio::test]
async fn a_chat_carrying_an_image_is_bounded_by_the_body_limit_not_the_prompts() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.max_prompt_tokens = 32_768).await;
    let image = format!("data:image/jpeg;base64,{}", "A".repeat(600_000));
    let parts = json!([{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": image}}]);
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": parts}]});
    assert!(chat.to_string().len() > 32_768 * 16, "past the prompt's bound");
    let resp = r.chat(chat).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(w.hits.load(Ordering::SeqCst), 1);
    // A completion of that size is text: refused as a prompt too long; so is
    // a chat of that size with no media part, before it is parsed.
    let (status, _) = error_of(r.complete(json!({"model": "m", "prompt": prompt(600_000)})).await).await;
    assert_eq!(status, 413);
    // (Its bulk in a field no template renders, so only the body's bound can
    // refuse it.)
    let text = json!({"model": "m", "messages": [{"role": "user", "content": "hi", "pad": prompt(600_000)}]});
    let (status, _) = error_of(r.chat(text).await).await;
    assert_eq!(status, 413);
    // Nor does naming a media key let through a body of small values
    // (parsed, ~30 × its size): what is outside long strings is held to
    // the prompt's bound too.
    let small =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi", "image_url": 0, "pad": vec![0; 300_000]}]});
    assert!(small.to_string().len() > 32_768 * 16);
    let (status, _) = error_of(r.chat(small).await).await;
    assert_eq!(status, 413);
    assert_eq!(w.hits.load(Ordering::SeqCst), 1);
}

/// A tokenizer directory (removed by the caller) holding GPT-2's tokenizer
/// and the chat `template`.
fn gpt2_with_template(name: &str, template: &str) -> std::path::PathBuf {
    let gpt2 = kvroute_shared::testdata::tokenizer_dir("gpt2").unwrap_or_else(|why| panic!("no gpt2 tokenizer: {why}"));
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(gpt2.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), json!({"chat_template": template}).to_string()).unwrap();
    dir
}

/// A chat the model's template cannot render here (it refuses the
/// conversation, or uses what minijinja lacks) is the engine's to judge:
/// forwarded, placed by its plain text, and counted; before, the router
/// answered it with its own 400.
#[tokio::test]
async fn a_chat_the_template_cannot_render_is_forwarded_for_the_engine_to_judge() {
    let dir = gpt2_with_template(
        "refusing",
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}{{ m.content }}{% endfor %}",
    );
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.tokenizer = Some(dir.clone())).await;
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]});
    assert_eq!(r.chat(chat).await.status(), 200);
    assert_eq!(w.hits.load(Ordering::SeqCst), 1, "the engine judged it");
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kind=\"chat_template_fallback\"} 1"), "{metrics}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The engines' `--default-chat-template-kwargs` and
/// `--exclude-tools-when-tool-choice-none`, given to the router, render its
/// chats as the engines do: the defaults under the request's own kwargs, a
/// `tool_choice: "none"` chat without its tools.
#[tokio::test]
async fn chats_render_under_the_engines_chat_flags() {
    let dir = gpt2_with_template(
        "defaults",
        "{{ flag }}|{% for m in messages %}{{ m.content }}{% endfor %}|{% if tools %}some tools here{% endif %}",
    );
    let w = fake_worker("w1", Behaviour::Ok).await;
    let plain = router(&[("w1", &w.url)], |raw| raw.tokenizer = Some(dir.clone())).await;
    let flagged = router(&[("w1", &w.url)], |raw| {
        raw.tokenizer = Some(dir.clone());
        raw.default_chat_template_kwargs = Some(r#"{"flag": "a default flag of many words"}"#.into());
        raw.exclude_tools_when_tool_choice_none = true;
    })
    .await;
    async fn tokens(r: &TestRouter, extra: Value) -> u64 {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        r.explain(body).await["tokens"].as_u64().unwrap()
    }
    assert!(tokens(&flagged, json!({})).await > tokens(&plain, json!({})).await, "the default is rendered");
    let own = json!({"chat_template_kwargs": {"flag": "x"}});
    assert_eq!(tokens(&flagged, own.clone()).await, tokens(&plain, own).await, "the request's kwarg wins");
    let none = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"});
    assert_eq!(tokens(&flagged, none.clone()).await, tokens(&flagged, json!({})).await, "no tools rendered");
    assert!(tokens(&plain, none).await > tokens(&plain, json!({})).await, "tools rendered without the flag");
    std::fs::remove_dir_all(&dir).ok();
}

/// Bodies being read hold at most `max_body_bytes_in_flight` in all: past
/// it a request is shed (503), so clients that send part of a large body and
/// stall cannot make the router hold gigabytes; once the stalled body goes,
/// requests are read again.
#[tokio::test]
async fn bodies_being_read_share_one_byte_budget() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.max_body_bytes = 8192;
        raw.max_body_bytes_in_flight = 8192;
    })
    .await;
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tx.send(Ok(Bytes::from(format!("{{\"model\": \"m\", \"prompt\": \"{}", "x".repeat(6_000))))).await.unwrap();
    let stalled =
        r.http.post(format!("{}/v1/chat/completions", r.url)).body(reqwest::Body::wrap_stream(tokio_stream_from(rx)));
    let stalled = tokio::spawn(stalled.send());
    let body = json!({"model": "m", "prompt": prompt(3_000)});
    let status = support::eventually("the stalled body to hold its bytes", || async {
        let status = r.complete(body.clone()).await.status();
        (status != 200).then_some(status)
    })
    .await;
    assert_eq!(status, 503);
    drop(tx);
    let _ = stalled.await;
    assert_eq!(r.complete(body).await.status(), 200, "the budget is given back");
}

/// A body keeps its share of the byte budget until its answer begins (a
/// non-streamed answer's headers come with its end): given back once read,
/// the budget bounded only bodies being read.
#[tokio::test]
async fn a_body_holds_its_bytes_until_its_answer_begins() {
    let w = fake_worker("w1", Behaviour::Hang).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.max_body_bytes = 8192;
        raw.max_body_bytes_in_flight = 8192;
    })
    .await;
    let big = r.http.post(format!("{}/v1/completions", r.url)).json(&json!({"model": "m", "prompt": prompt(6_000)}));
    let waiting = tokio::spawn(big.send());
    support::eventually("the request at its engine", || async { (w.hits.load(Ordering::SeqCst) == 1).then_some(()) })
        .await;
    let explain =
        || r.http.post(format!("{}/debug/route", r.url)).json(&json!({"model": "m", "prompt": prompt(3_000)}));
    assert_eq!(explain().send().await.unwrap().status(), 503, "6 kB held and 3 kB more past an 8 kB budget");
    waiting.abort();
    support::eventually("the budget given back by the client gone", || async {
        (explain().send().await.unwrap().status() == 200).then_some(())
    })
    .await;
}

/// A chat template that indents JSON expands a small body of nested
/// arrays hundreds of times; the rendered text is held to the body's bound
/// (16 bytes a token) before it is tokenized: uncapped, a 100 kB request
/// rendered and tokenized megabytes.
#[tokio::test]
async fn a_chat_template_cannot_expand_a_small_request_past_the_prompt_limit() {
    let dir = gpt2_with_template(
        "expanding",
        "{{ tools | tojson(indent=4) }}{% for m in messages %}{{ m.content }}{% endfor %}",
    );
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.tokenizer = Some(dir.clone());
        raw.max_prompt_tokens = 10_000;
    })
    .await;
    let mut nested = json!(0);
    while nested.to_string().len() < 20_000 {
        nested = json!([nested.clone(), nested]);
    }
    let body = |tools: Value| json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools});
    let expanding = body(json!([nested]));
    assert!(expanding.to_string().len() < 160_000, "the body itself is within 10,000 × 16 bytes");
    let (status, err) = error_of(r.chat(expanding).await).await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(r.chat(body(json!([{"name": "f"}]))).await.status(), 200);
    assert_eq!(w.hits.load(Ordering::SeqCst), 1, "the expanded request never reached the engine");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn a_client_sending_its_body_slowly_holds_no_concurrency_slot() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.max_concurrent_requests = 1;
        raw.body_read_timeout = Duration::from_secs(2);
        raw.max_body_bytes = 4096;
        raw.max_body_bytes_in_flight = 4096;
    })
    .await;
    // A body that starts and never finishes.
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tx.send(Ok(Bytes::from_static(b"{\"model\": \"m\", "))).await.unwrap();
    let stream = tokio_stream_from(rx);
    let slow =
        tokio::spawn(r.http.post(format!("{}/v1/completions", r.url)).body(reqwest::Body::wrap_stream(stream)).send());
    // The slow body is being read once its bytes hold the budget: a body
    // that would just fit beside nothing is shed.
    let probe = format!("{{\"model\":\"m\",\"prompt\":\"{}\"}}", "x".repeat(4090 - 25));
    assert_eq!(probe.len(), 4090);
    support::eventually("the slow body being read", || async {
        let explain = r.http.post(format!("{}/debug/route", r.url)).body(probe.clone()).send().await.unwrap();
        (explain.status() == 503).then_some(())
    })
    .await;
    assert_eq!(r.complete(json!({"model": "m", "prompt": "x"})).await.status(), 200, "the only slot was free");
    let slow = slow.await.unwrap().unwrap();
    assert_eq!(slow.status(), 408, "a body that never completes times out");
    drop(tx);
}

/// Bodies are read before their requests take a concurrency slot, so the
/// requests reading theirs are capped on their own (4 per slot): clients
/// opening requests that send no body (HTTP/2 streams cost them a few
/// bytes each) cannot make the router hold a task and a header map for
/// each, uncounted.
#[tokio::test]
async fn requests_reading_their_bodies_are_capped() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.max_concurrent_requests = 1;
        raw.body_read_timeout = Duration::from_secs(60);
    })
    .await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        tx.send(Ok(Bytes::from_static(b"{\"model\": \"m\", "))).await.unwrap();
        let body = reqwest::Body::wrap_stream(tokio_stream_from(rx));
        stalled.push((tx, tokio::spawn(r.http.post(format!("{}/v1/completions", r.url)).body(body).send())));
    }
    let shed = support::eventually("four bodies being read", || async {
        let status = r.complete(json!({"model": "m", "prompt": "x"})).await.status();
        (status == 503).then_some(status)
    })
    .await;
    assert_eq!(shed, 503);
    for (tx, request) in stalled {
        drop(tx);
        request.abort();
    }
    support::eventually("the readers gone", || async {
        (r.complete(json!({"model": "m", "prompt": "x"})).await.status() == 200).then_some(())
    })
    .await;
}

/// A sidecar's push that never finishes arriving is refused (408) at
/// `body_read_timeout`: the connection counts as busy while a body is read,
/// so without a deadline a token holder trickling bytes held it and its
/// task for ever.
#[tokio::test]
async fn a_push_that_never_finishes_arriving_times_out() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.body_read_timeout = Duration::from_millis(300)).await;
    for path in ["/internal/eviction", "/internal/sync"] {
        let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        tx.send(Ok(Bytes::from_static(b"{\"worker_id\": \"w1\", "))).await.unwrap();
        let resp = r
            .http
            .post(format!("{}{path}", r.url))
            .bearer_auth(TOKEN)
            .body(reqwest::Body::wrap_stream(tokio_stream_from(rx)))
            .timeout(Duration::from_secs(20)) // a deadline for a broken build
            .send()
            .await
            .unwrap_or_else(|e| panic!("{path}: no answer while the body was unfinished: {e}"));
        assert_eq!(resp.status(), 408, "{path}");
        drop(tx);
    }
}

/// A request the engine refuses pins no session: invalid requests must not
/// fill the session table (each for up to a day).
#[tokio::test]
async fn a_refused_request_pins_no_session() {
    let w = fake_worker("w1", Behaviour::Status(400)).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let body = json!({"model": "m", "prompt": "x"});
    let resp = r.http.post(format!("{}/v1/context", r.url)).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.headers().get("x-session-id").is_none(), "a refused request got a session");
    let resp = r
        .http
        .post(format!("{}/v1/completions", r.url))
        .header("x-session-id", "client-chosen-1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.headers().get("x-session-id").is_none(), "a refused request pinned its session");
}

/// A large body (parsed on the blocking pool, as every body is): routed.
#[tokio::test]
async fn a_large_body_is_parsed_off_the_runtime_and_routed() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let parts: Vec<Value> = (0..20_000).map(|i| json!({"type": "text", "text": format!("part {i} ")})).collect();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": parts}]});
    assert!(body.to_string().len() > 256 << 10);
    let resp = r.http.post(format!("{}/v1/chat/completions", r.url)).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kvroute-worker"], "w1");
    let explained = r.explain(body).await;
    assert_eq!(explained["decision"]["worker"], "w1", "{explained}");
}

/// `POST /v1/context` reads its body under the same deadline as the
/// completion endpoints.
#[tokio::test]
async fn a_context_body_that_never_completes_times_out() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.body_read_timeout = Duration::from_millis(300)).await;
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tx.send(Ok(Bytes::from_static(b"{\"model\": \"m\", "))).await.unwrap();
    let body = reqwest::Body::wrap_stream(tokio_stream_from(rx));
    let send = r.http.post(format!("{}/v1/context", r.url)).body(body).send();
    let resp = tokio::time::timeout(Duration::from_secs(20), send).await.expect("the body was waited for forever");
    assert_eq!(resp.unwrap().status(), 408);
    drop(tx);
}

fn tokio_stream_from(
    mut rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Waits until the server closes `s` (EOF or a reset), with a bound far
/// beyond any deadline under test: a socket left open fails the test.
async fn closed_by_server(s: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await.is_ok()
}

/// Connections that never start a request are cut at the header deadline,
/// which frees the connection slots they hold: headers sent a byte at a
/// time (slow-loris), and, since hyper's own deadline starts only once it
/// knows the protocol, a socket that sends nothing, half the HTTP/2
/// preface, or the whole preface and then no request (these held their
/// slots forever).
#[tokio::test]
async fn connections_that_never_start_a_request_are_cut_off_and_free_their_slots() {
    use tokio::io::AsyncWriteExt;
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.max_connections = 4;
        raw.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let addr = r.url.trim_start_matches("http://").to_owned();
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
    let settings = [0u8, 0, 0, 4, 0, 0, 0, 0, 0];
    let openings: [&[u8]; 4] =
        [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"", &preface[..16], &[&preface[..], &settings[..]].concat()];
    let mut idle = Vec::new();
    for opening in openings {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(opening).await.unwrap();
        idle.push(s);
    }
    for (i, s) in idle.iter_mut().enumerate() {
        assert!(closed_by_server(s).await, "connection {i} was left open");
    }
    let resp = r.http.get(format!("{}/health", r.url)).send().await.unwrap();
    assert_eq!(resp.status(), 200, "the slots are free again");
}

/// A connection that served a request and starts no other is closed at
/// `keep_alive_timeout`; one with a stream under way is not cut.
#[tokio::test]
async fn an_idle_connection_is_shut_down_but_its_stream_under_way_finishes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, _cancel_rx, slot) = stream_slot();
    let w = fake_worker("w1", Behaviour::Stream(slot)).await;
    let r = router(&[("w1", &w.url)], |raw| {
        raw.header_read_timeout = Duration::from_millis(200);
        raw.keep_alive_timeout = Duration::from_millis(200);
    })
    .await;
    let addr = r.url.trim_start_matches("http://").to_owned();
    // A keep-alive connection that served one request, then nothing.
    let mut kept = tokio::net::TcpStream::connect(&addr).await.unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut first = [0u8; 12];
    kept.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    // A stream that starts now and outlives the deadline of its connection.
    tx.send(Some("data: {\"n\":1}\n\n")).await.unwrap();
    let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    assert_eq!(body.next().await.unwrap().unwrap(), "data: {\"n\":1}\n\n");
    assert!(closed_by_server(&mut kept).await, "an idle keep-alive connection was left open");
    // Three silent sockets opened one after another, each closed at the
    // first-request deadline: the stream's connection, idle since its one
    // request began, has passed its own deadline by the time the last closes.
    for _ in 0..3 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        assert!(closed_by_server(&mut s).await, "a silent socket was left open");
    }
    tx.send(Some("data: [DONE]\n\n")).await.unwrap();
    drop(tx);
    assert_eq!(body.next().await.unwrap().unwrap(), "data: [DONE]\n\n", "the stream was cut");
    assert!(body.next().await.is_none());
}

/// A client that asks for a stream and never reads it: once the socket's
/// buffers are full the answer waits on it, holding its concurrency slot
/// and its engine request, until the write deadline (`idle_timeout`)
/// closes the connection and the engine request is cancelled.
#[tokio::test]
async fn a_client_that_never_reads_is_cut_off_and_its_engine_request_cancelled() {
    use tokio::io::AsyncWriteExt;
    let (cancel_tx, cancelled) = oneshot::channel();
    let w = fake_worker("w1", Behaviour::Endless(Arc::new(std::sync::Mutex::new(Some(cancel_tx))))).await;
    let r = router(&[("w1", &w.url)], |raw| raw.idle_timeout = Duration::from_millis(300)).await;
    let addr = r.url.trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = r#"{"model": "m", "prompt": "hello", "stream": true}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
    // Never read. The router must let go of the engine's stream.
    let let_go = tokio::time::timeout(Duration::from_secs(20), cancelled).await;
    assert!(let_go.is_ok(), "the answer to a client that never reads was held open");
    drop(s);
}

#[tokio::test]
async fn load_shedding_answers_503_with_retry_after() {
    let hang = fake_worker("hang", Behaviour::Hang).await;
    let r = router(&[("hang", &hang.url)], |raw| raw.max_concurrent_requests = 1).await;
    let http = r.http.clone();
    let url = format!("{}/v1/completions", r.url);
    let stuck = tokio::spawn(async move { http.post(url).json(&json!({"model": "m", "prompt": "x"})).send().await });
    // Wait until the first request holds the only permit (it reached the upstream).
    while hang.hits.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let resp = r.complete(json!({"model": "m", "prompt": "y"})).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    stuck.abort();
}

/// The router times streamed first tokens against its timing model, per
/// worker (`pace` in `/debug/route`), and a worker measured far slower than
/// the others gets new prompts no longer.
#[tokio::test]
async fn a_worker_whose_first_tokens_come_slower_is_measured_and_avoided() {
    let fast = fake_worker("fast", Behaviour::FirstTokenAfter(Duration::ZERO)).await;
    // The model predicts ~10 ms for these prompts on an idle worker.
    let slow = fake_worker("slow", Behaviour::FirstTokenAfter(Duration::from_millis(300))).await;
    let r = router(&[("fast", &fast.url), ("slow", &slow.url)], |_| {}).await;
    let route = |text: String| r.explain(json!({"model": "m", "prompt": text}));
    let text = |i: usize| format!("question {i}: {}", prompt(48));
    // Before any measurement, new prompts spread over both (rendezvous).
    let mut before = std::collections::BTreeSet::new();
    for i in 1_000..1_020 {
        before.insert(route(text(i)).await["decision"]["worker"].as_str().unwrap().to_owned());
    }
    assert_eq!(before.len(), 2, "{before:?}");
    // One streamed answer at a time (nothing queued ahead: every one is a
    // sample) until both workers have a pace.
    for i in 0..64 {
        let resp = r.complete(json!({"model": "m", "prompt": text(i), "stream": true})).await;
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
        if fast.hits.load(Ordering::SeqCst) >= 8 && slow.hits.load(Ordering::SeqCst) >= 8 {
            break;
        }
    }
    let debug = route(text(2_000)).await;
    let pace = |id: &str| {
        let row = debug["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).unwrap();
        row["load"]["pace"].as_f64().unwrap_or_else(|| panic!("no pace for {id}: {debug}"))
    };
    // 300 ms against ~10 ms predicted: the delay alone is a pace of 30.
    assert!(pace("slow") > 4.0 * pace("fast"), "{debug}");
    for i in 1_000..1_020 {
        assert_eq!(route(text(i)).await["decision"]["worker"], "fast", "prompt {i}");
    }
}

#[tokio::test]
async fn metrics_are_exported() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    r.complete(json!({"model": "m", "prompt": prompt(64)})).await.text().await.unwrap();
    let metrics = || async { r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap() };
    // A non-streamed answer's first byte comes with its last: not a TTFT.
    let ttft = "kvroute_upstream_ttft_seconds_count{policy=\"predicted_ttft\",worker=\"w1\",status=\"2xx\"}";
    assert!(metrics().await.contains(&format!("{ttft} 0")), "{}", metrics().await);
    r.complete(json!({"model": "m", "prompt": prompt(64), "stream": true})).await.text().await.unwrap();
    let text = metrics().await;
    for name in [
        "kvroute_requests_total{worker=\"w1\",outcome=\"ok\"} 2",
        "kvroute_decisions_total{policy=\"predicted_ttft\",reason=\"cold_placement\"} 1",
        "kvroute_matched_prefix_ratio_bucket",
        "kvroute_index_entries",
        "kvroute_routing_duration_seconds_count 2",
        "kvroute_tokenize_duration_seconds_count 2",
        // Token-weighted, as vLLM's hit ratio: the second prompt's 64 bytes
        // (no tokenizer: a byte a token) are the first's, recorded there.
        "kvroute_prompt_tokens_total 128",
        "kvroute_matched_prompt_tokens_total 64",
        // Buckets past the first-token deadline (60 s) and `first_byte_timeout` (1 h).
        "kvroute_upstream_ttft_seconds_bucket{policy=\"predicted_ttft\",le=\"327.68\",worker=\"w1\",status=\"2xx\"} 1",
        "kvroute_request_duration_seconds_bucket{policy=\"predicted_ttft\",le=\"5242.88\",worker=\"w1\",status=\"2xx\"} 2",
        "kvroute_dispatch_delay_seconds_count 2",
        "kvroute_upstream_ttft_seconds_count{policy=\"predicted_ttft\",worker=\"w1\",status=\"2xx\"} 1",
        "kvroute_worker_inflight{worker=\"w1\"} 0",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    assert!(!text.contains(TOKEN));
}

/// An engine that drops the connection on any request whose body contains
/// `poison` (as vLLM's server does with some requests it cannot handle), and
/// answers everything else.
async fn picky_door(name: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                loop {
                    // One request: headers, then content-length bytes.
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let body_end = loop {
                        let Ok(n) = sock.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(head) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                        let headers = String::from_utf8_lossy(&buf[..head]).to_ascii_lowercase();
                        let len = headers
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse::<usize>().unwrap_or(0));
                        if buf.len() >= head + 4 + len {
                            break head + 4 + len;
                        }
                    };
                    if buf[..body_end].windows(6).any(|w| w == b"poison") {
                        return; // dropped without an answer
                    }
                    let body = format!(r#"{{"worker":"{name}","choices":[{{"text":"hi"}}]}}"#);
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if sock.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

async fn healthy(r: &TestRouter, id: &str) -> bool {
    let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
    let list = workers["workers"].as_array().cloned().unwrap_or_default();
    list.iter().find(|w| w["id"] == id).unwrap_or_else(|| panic!("no {id} in {workers}"))["healthy"] == true
}

/// A stream whose first token is late on every worker tried (a JSON schema
/// the engine takes minutes to compile, say) is the request's doing: a
/// 504, and no worker charged. Charged at once, two such requests ejected
/// a whole cluster.
#[tokio::test]
async fn a_stream_late_on_every_worker_ejects_none_of_them() {
    let mut workers = Vec::new();
    for id in ["a", "b", "c"] {
        workers.push((id, fake_worker(id, Behaviour::Wedged).await));
    }
    let pairs: Vec<(&str, &str)> = workers.iter().map(|(id, w)| (*id, w.url.as_str())).collect();
    let r = router(&pairs, |raw| {
        raw.eject_after_failures = 2;
        raw.retries = 2;
        raw.first_token_timeout = Duration::from_millis(200);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    for _ in 0..2 {
        let resp = r.complete(json!({"model": "m", "prompt": "slow to start", "stream": true})).await;
        assert_eq!(resp.status(), 504);
    }
    for (id, w) in &workers {
        assert!(healthy(&r, id).await, "{id} was charged for the request's own slowness");
        assert!(w.hits.load(Ordering::SeqCst) >= 1, "{id} was tried");
    }
    // Late crashes nothing: each request was tried on all three.
    let hits: usize = workers.iter().map(|(_, w)| w.hits.load(Ordering::SeqCst)).sum();
    assert_eq!(hits, 6);
}

/// ... and a wedged engine is charged once another worker answers what it
/// did not.
#[tokio::test]
async fn a_stream_late_on_one_worker_and_answered_by_another_charges_the_first() {
    let wedged = fake_worker("a", Behaviour::Wedged).await;
    let good = fake_worker("b", Behaviour::Ok).await;
    let r = router(&[("a", &wedged.url), ("b", &good.url)], |raw| {
        raw.policy = "round_robin".into();
        raw.eject_after_failures = 1;
        raw.first_token_timeout = Duration::from_millis(200);
        raw.first_token_timeout_per_1k_tokens = Duration::ZERO;
    })
    .await;
    while wedged.hits.load(Ordering::SeqCst) == 0 {
        let resp = r.complete(json!({"model": "m", "prompt": "hello", "stream": true})).await;
        assert_eq!(resp.headers()["x-kvroute-worker"], "b");
    }
    assert!(!healthy(&r, "a").await, "answered elsewhere: the wedged worker is charged");
    assert!(healthy(&r, "b").await);
}

/// A request that every worker refuses (connection dropped) is the request's
/// fault: retried, then a 502, but no worker is charged for it, so a client
/// repeating it cannot eject the whole cluster.
#[tokio::test]
async fn a_request_every_worker_refuses_ejects_none_of_them() {
    let (a, b) = (picky_door("a").await, picky_door("b").await);
    let r = router(&[("a", &a), ("b", &b)], |raw| {
        raw.eject_after_failures = 2;
        raw.retries = 1;
    })
    .await;
    for _ in 0..4 {
        let resp = r.complete(json!({"model": "m", "prompt": "poison pill"})).await;
        assert_eq!(resp.status(), 502);
    }
    assert!(healthy(&r, "a").await && healthy(&r, "b").await);
    let resp = r.complete(json!({"model": "m", "prompt": "a fine request"})).await;
    assert_eq!(resp.status(), 200);
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    for id in ["a", "b"] {
        let line = format!("kvroute_requests_total{{worker=\"{id}\",outcome=\"closed\"}} 4");
        assert!(metrics.contains(&line), "no {line} in\n{metrics}");
    }
}

/// A failed worker's address stays in the router's log: reqwest's error
/// text names the URL, and it went into the client's 502 body.
#[tokio::test]
async fn a_502_names_no_workers_address() {
    let door = picky_door("a").await;
    let closed = refused_url();
    for url in [&door, &closed.url] {
        let r = router(&[("a", url)], |raw| raw.retries = 0).await;
        let (status, body) = error_of(r.complete(json!({"model": "m", "prompt": "poison pill"})).await).await;
        assert_eq!(status, 502, "{body}");
        let port = url.rsplit(':').next().unwrap();
        let message = body["error"]["message"].as_str().unwrap();
        assert!(!message.contains("127.0.0.1") && !message.contains(port), "{message}");
        assert!(message.contains("upstream worker a"), "{message}");
    }
}

/// A worker that drops what another worker answers is at fault: charged, and
/// ejected after `eject_after_failures`.
#[tokio::test]
async fn a_worker_that_drops_what_others_answer_is_ejected() {
    let door = slamming_door().await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let r = router(&[("a-door", &door), ("b-good", &good.url)], |raw| {
        raw.policy = "round_robin".into();
        raw.eject_after_failures = 2;
    })
    .await;
    for _ in 0..4 {
        assert_eq!(r.complete(json!({"model": "m", "prompt": "hello"})).await.status(), 200);
    }
    assert!(!healthy(&r, "a-door").await, "the door failed requests another worker answered");
    assert!(healthy(&r, "b-good").await);
}

/// At a stop, with a `drain_delay`, the router serves on (new connections
/// too) while `/ready` answers 503, so that load balancers stop sending to
/// it before its listener closes: it closed at once, and the requests that
/// Kubernetes' endpoints still sent it for a few seconds were refused.
#[tokio::test]
async fn a_stopping_router_serves_on_through_its_drain_delay_not_ready() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let mut r = router(&[("w1", &w.url)], |raw| raw.drain_delay = Duration::from_secs(3600)).await;
    let ready = |http: reqwest::Client, url: String| async move {
        let resp = http.get(format!("{url}/ready")).send().await.unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    };
    support::eventually("ready", || async { (ready(r.http.clone(), r.url.clone()).await.0 == 200).then_some(()) })
        .await;
    r.stop();
    let (status, body) = support::eventually("draining", || async {
        let got = ready(r.http.clone(), r.url.clone()).await;
        (got.0 == 503).then_some(got)
    })
    .await;
    assert_eq!((status, &body["draining"]), (503, &json!(true)), "{body}");
    // A new connection is still served.
    let fresh = reqwest::Client::new();
    let resp = fresh.post(format!("{}/v1/completions", r.url)).json(&json!({"model": "m", "prompt": "x"})).send();
    assert_eq!(resp.await.unwrap().status(), 200);
}

/// `/debug/route` reads `x-session-id` as a request does: a pinned
/// session's worker is the decision it explains.
#[tokio::test]
async fn debug_route_explains_a_pinned_session() {
    let (a, b) = (fake_worker("a", Behaviour::Ok).await, fake_worker("b", Behaviour::Ok).await);
    let r = router(&[("a", &a.url), ("b", &b.url)], |_| {}).await;
    let mut pinned = std::collections::HashMap::new();
    for n in 0..200 {
        let id = format!("s{n}");
        let resp = r
            .http
            .post(format!("{}/v1/completions", r.url))
            .header("x-session-id", &id)
            .json(&json!({"model": "m", "prompt": format!("conversation {n} {}", prompt(40))}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        pinned.entry(resp.headers()["x-kvroute-worker"].to_str().unwrap().to_owned()).or_insert(id);
        if pinned.len() == 2 {
            break;
        }
    }
    assert_eq!(pinned.len(), 2, "no session pinned to each worker in 200: {pinned:?}");
    let body = json!({"model": "m", "prompt": "a question nobody asked"});
    let free = r.explain(body.clone()).await["decision"]["worker"].as_str().unwrap().to_owned();
    let other = if free == "a" { "b" } else { "a" };
    let explain = r.http.post(format!("{}/debug/route", r.url)).header("x-session-id", &pinned[other]).json(&body);
    let explained: Value = explain.send().await.unwrap().json().await.unwrap();
    assert_eq!(explained["decision"]["worker"], other, "{explained}");
    assert_eq!(explained["pinned_session_worker"], other, "{explained}");
}

/// A completion's body may carry a `messages` key the engine ignores:
/// `/debug/route` takes it as a chat unless `?endpoint=completions` says
/// which it is (it explained a chat of the messages, where the request
/// path tokenizes the prompt).
#[tokio::test]
async fn debug_route_is_told_the_endpoint() {
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |_| {}).await;
    let body = json!({"model": "m", "prompt": prompt(64), "messages": [{"role": "user", "content": "x"}]});
    let explain = |query: &'static str| {
        let req = r.http.post(format!("{}/debug/route{query}", r.url)).json(&body).send();
        async move { req.await.unwrap() }
    };
    let as_completion: Value = explain("?endpoint=completions").await.json().await.unwrap();
    assert_eq!(as_completion["tokens"], 64, "{as_completion}");
    let as_chat: Value = explain("?endpoint=chat").await.json().await.unwrap();
    assert_ne!(as_chat["tokens"], 64, "{as_chat}");
    assert_eq!(r.explain(body.clone()).await["tokens"], as_chat["tokens"], "the body's messages key says chat");
    let (status, err) = error_of(explain("?endpoint=embeddings").await).await;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("endpoint")), "{err}");
}

/// The data-parallel ranks behind one URL are one server: when it fails a
/// request (here it drops every connection), the retries go to another
/// engine, not to its other ranks (three attempts at one dead server: a 502
/// while another engine was healthy).
#[tokio::test]
async fn retries_skip_the_other_ranks_of_a_failed_server() {
    let door = slamming_door().await;
    let good = fake_worker("good", Behaviour::Ok).await;
    let ranks: Vec<(String, String)> = (0..3).map(|r| (format!("a-dp{r}"), format!("{door}#dp-rank={r}"))).collect();
    let mut workers: Vec<(&str, &str)> = ranks.iter().map(|(id, url)| (id.as_str(), url.as_str())).collect();
    workers.push(("b-good", &good.url));
    let r = router(&workers, |raw| {
        raw.policy = "round_robin".into();
        raw.retries = 2;
        raw.eject_after_failures = 1_000;
    })
    .await;
    for i in 0..4 {
        let resp = r.complete(json!({"model": "m", "prompt": format!("hello {i}")})).await;
        assert_eq!(resp.status(), 200, "request {i}");
        assert_eq!(resp.headers()["x-kvroute-worker"], "b-good", "request {i}");
    }
}

/// Pushes name their wire protocol version in a header. A router refuses a
/// major it does not speak (400 naming the versions, counted) and accepts
/// pushes without the header (sidecars from before versioning), version 1
/// (one release of overlap) and its own; every ack says which version the
/// router speaks.
#[tokio::test]
async fn pushes_of_an_unknown_protocol_version_are_refused_and_unversioned_ones_accepted() {
    let r = router(&[], |_| {}).await;
    let sync = json!({"worker_id": "w1", "url": "http://127.0.0.1:9", "hashes": []});
    let push = |version: Option<&'static str>| {
        let mut req = r.http.post(format!("{}/internal/sync", r.url)).bearer_auth(TOKEN).json(&sync);
        if let Some(v) = version {
            req = req.header("x-kvroute-protocol", v);
        }
        req.send()
    };
    for accepted in [None, Some("1"), Some("2")] {
        let resp = push(accepted).await.unwrap();
        assert_eq!(resp.status(), 200, "{accepted:?}");
        let ack: Value = resp.json().await.unwrap();
        assert_eq!((ack["outcome"].as_str(), ack["protocol"].as_u64()), (Some("applied"), Some(2)), "{ack}");
    }
    for refused in ["3", "v1"] {
        let resp = push(Some(refused)).await.unwrap();
        assert_eq!(resp.status(), 400, "{refused}");
        let err: Value = resp.json().await.unwrap();
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("this router speaks versions 1 to 2"), "{err}");
        assert_eq!(err["error"]["param"], "x-kvroute-protocol", "sidecars fall back on this: {err}");
    }
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kind=\"rejected_protocol\"} 2"), "{metrics}");
}

/// With `admin_token`, `/debug/*` and `/admin/*` need it; the API and
/// `/metrics` stay open. Without it they are open (loopback defaults).
#[tokio::test]
async fn an_admin_token_guards_debug_and_admin_endpoints() {
    const ADMIN: &str = "admin-token-0123456789";
    let w = fake_worker("w1", Behaviour::Ok).await;
    let r = router(&[("w1", &w.url)], |raw| raw.admin_token = Some(Secret::new(ADMIN))).await;
    let body = json!({"model": "m", "prompt": prompt(64)});
    let get = |path: &str, token: Option<&str>| {
        let mut req = r.http.get(format!("{}{path}", r.url));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    for path in ["/admin/workers", "/debug/index"] {
        assert_eq!(get(path, None).await.unwrap().status(), 401, "{path}");
        assert_eq!(get(path, Some("wrong-token-0123456789")).await.unwrap().status(), 401, "{path}");
        assert_eq!(get(path, Some(ADMIN)).await.unwrap().status(), 200, "{path}");
    }
    let route = |token: Option<&str>| {
        let mut req = r.http.post(format!("{}/debug/route", r.url)).json(&body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    assert_eq!(route(None).await.unwrap().status(), 401);
    assert_eq!(route(Some(ADMIN)).await.unwrap().status(), 200);
    assert_eq!(r.complete(body.clone()).await.status(), 200);
    assert_eq!(get("/metrics", None).await.unwrap().status(), 200);
    let open = router(&[("w1", &w.url)], |_| {}).await;
    assert_eq!(open.http.get(format!("{}/admin/workers", open.url)).send().await.unwrap().status(), 200);
}

/// An engine serving several data-parallel ranks on one URL (vLLM's internal
/// load balancing): it answers with the rank the request named in
/// `X-data-parallel-rank`, or "balanced" when none.
async fn ranked_engine() -> String {
    let complete = |headers: axum::http::HeaderMap| async move {
        let rank = headers.get("x-data-parallel-rank").and_then(|v| v.to_str().ok()).unwrap_or("balanced").to_owned();
        axum::Json(json!({"rank": rank, "choices": [{"text": "hi"}]}))
    };
    let app = Router::new()
        .route("/v1/completions", post(complete))
        .route("/v1/embeddings", post(complete))
        .route("/health", get(|| async { "ok" }));
    serve_engine(app).await
}

/// The engine's other endpoints (passed through by load) name the rank the
/// router charged, and their retries skip the other ranks of a server that
/// refused the connection, as completions' do.
#[tokio::test]
async fn passed_through_requests_name_their_rank_and_skip_a_failed_servers_other_ranks() {
    let engine = ranked_engine().await;
    let refused = refused_url();
    let ranks: Vec<(String, String)> =
        (0..3).map(|r| (format!("a-dp{r}"), format!("{}#dp-rank={r}", refused.url))).collect();
    let mut workers: Vec<(&str, &str)> = ranks.iter().map(|(id, url)| (id.as_str(), url.as_str())).collect();
    let ranked = format!("{engine}#dp-rank=1");
    workers.push(("b-dp1", &ranked));
    let r = router(&workers, |raw| {
        raw.retries = 1;
        raw.eject_after_failures = 1_000;
    })
    .await;
    let resp = r.http.post(format!("{}/v1/embeddings", r.url)).json(&json!({"model": "m", "input": "x"})).send();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kvroute-worker"], "b-dp1");
    assert_eq!(resp.json::<Value>().await.unwrap()["rank"], "1", "the engine was told the rank charged");
}

#[tokio::test]
async fn data_parallel_ranks_are_targets_pinned_by_header() {
    let engine = ranked_engine().await;
    // A static rank from the command line's `ID=URL#dp-rank=R`.
    let r = router(&[("static-dp2", &format!("{engine}#dp-rank=2"))], |_| {}).await;
    let text = prompt(200);
    let keys = keys_of("m", &text);
    // Two ranks registered by their sidecar with the same URL; rank 1 holds the prompt.
    for (rank, hashes) in [(0, vec![]), (1, keys.clone())] {
        let body = json!({"worker_id": format!("e-dp{rank}"), "url": engine, "dp_rank": rank, "models": ["m"],
                          "block_size": 16, "hashes": hashes, "seq": 1, "epoch": "e1"});
        assert_eq!(r.internal("/internal/sync", body).await.status(), 200);
    }
    let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
    let ranks: Vec<_> =
        workers["workers"].as_array().unwrap().iter().map(|w| (w["id"].clone(), w["dp_rank"].clone())).collect();
    assert_eq!(ranks, [(json!("e-dp0"), json!(0)), (json!("e-dp1"), json!(1)), (json!("static-dp2"), json!(2))]);

    // A client naming a rank itself is not obeyed: the router pinned the holder.
    let resp = r
        .http
        .post(format!("{}/v1/completions", r.url))
        .header("x-data-parallel-rank", "0")
        .json(&json!({"model": "m", "prompt": text}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-kvroute-worker"], "e-dp1");
    assert_eq!(resp.json::<Value>().await.unwrap()["rank"], "1");

    // Whichever rank a new prompt lands on, the engine is told that rank.
    for i in 0..6 {
        let resp = r.complete(json!({"model": "m", "prompt": format!("{i} {}", prompt(100))})).await;
        let worker = resp.headers()["x-kvroute-worker"].to_str().unwrap().to_owned();
        let rank = resp.json::<Value>().await.unwrap()["rank"].as_str().unwrap().to_owned();
        assert_eq!(worker.chars().last().unwrap().to_string(), rank, "{worker} was sent as rank {rank}");
    }
    // A sync naming a rank out of bounds is refused, naming the field.
    let body = json!({"worker_id": "e-dpx", "url": engine, "dp_rank": 5000, "hashes": []});
    let (status, err) = error_of(r.internal("/internal/sync", body).await).await;
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("dp_rank")), "{err}");
}

/// An engine that publishes its KV cache size as vLLM does
/// (`vllm:cache_config_info{num_gpu_blocks}`) and answers every completion.
async fn engine_with_blocks(blocks: u64) -> String {
    let metrics = format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
    );
    let app = Router::new()
        .route("/v1/completions", post(|| async { axum::Json(json!({"choices": [{"text": "hi"}]})) }))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(move || async move { metrics }));
    serve_engine(app).await
}

/// The router reads each engine's KV size from its `/metrics`, counts the
/// blocks its index holds there (`/admin/workers`, `/debug/route`,
/// `kvroute_worker_free_blocks`), and a new branch of a prefix whose only
/// holder's cache is full goes to a worker with room (`cache_room`).
#[tokio::test]
async fn a_full_holder_gives_a_new_branch_to_a_worker_with_room() {
    let (full, roomy) = (engine_with_blocks(8).await, engine_with_blocks(100).await);
    let r = router(&[("w1", &full), ("w2", &roomy)], |_| {}).await;
    // 200 bytes, 12 full blocks; w1 holds the first 8, all its cache has.
    let text = prompt(200);
    let keys = keys_of("m", &text);
    for (id, held) in [("w1", &keys[..8]), ("w2", &keys[..0])] {
        let sync = json!({"worker_id": id, "hashes": held});
        assert_eq!(r.internal("/internal/sync", sync).await.status(), 200);
    }
    let capacity = |workers: &Value, id: &str| {
        let w = workers["workers"].as_array().unwrap().iter().find(|w| w["id"] == id).unwrap();
        (w["load"]["held_blocks"].as_u64().unwrap(), w["load"]["capacity_blocks"].as_u64())
    };
    let workers = support::eventually("both engines' KV size read", || async {
        let workers: Value = r.http.get(format!("{}/admin/workers", r.url)).send().await.unwrap().json().await.unwrap();
        (capacity(&workers, "w1").1.is_some() && capacity(&workers, "w2").1.is_some()).then_some(workers)
    })
    .await;
    assert_eq!(capacity(&workers, "w1"), (8, Some(8)));
    assert_eq!(capacity(&workers, "w2"), (0, Some(100)));
    let debug = r.explain(json!({"model": "m", "prompt": text})).await;
    assert_eq!(debug["decision"]["worker"], "w2", "{debug}");
    assert_eq!(debug["decision"]["reason"], "cache_room", "{debug}");
    let metrics = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvroute_worker_free_blocks{worker=\"w1\"} 0"), "{metrics}");
    assert!(metrics.contains("kvroute_worker_free_blocks{worker=\"w2\"} 100"), "{metrics}");
    // A prompt w1 holds nearly all of stays there, full or not.
    let debug = r.explain(json!({"model": "m", "prompt": prompt(130)})).await;
    assert_eq!(debug["decision"]["worker"], "w1", "{debug}");
}

/// An engine at `/tokenize` answering with `tokens(body)`, serving model `m`.
async fn tokenizing_engine(tokens: impl Fn(&Value) -> Vec<u32> + Clone + Send + Sync + 'static) -> String {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "m"}]})) }))
        .route(
            "/tokenize",
            post(move |axum::Json(body): axum::Json<Value>| {
                let tokens = tokens.clone();
                async move { axum::Json(json!({"count": 0, "max_model_len": 4096, "tokens": tokens(&body)})) }
            }),
        );
    serve_engine(app).await
}

/// Waits until the router has compared worker `w`'s tokenization with its
/// engine's and exports `want` (0 agree, 1 differ).
async fn compared_as(r: &TestRouter, want: u8) {
    let line = format!("kvroute_worker_tokenizer_mismatch{{worker=\"w\"}} {want}");
    eventually("the tokenizers compared", || async {
        let text = r.http.get(format!("{}/metrics", r.url)).send().await.unwrap().text().await.unwrap();
        text.contains(&line).then_some(())
    })
    .await;
}

/// A router given no tokenizer keys bytes: in front of an engine that
/// tokenizes, that is reported (the most common misconfiguration, silent
/// before: every prefix missed); in front of one keying bytes too (kvroute-sim
/// without a tokenizer) it is not.
#[tokio::test]
async fn a_router_without_a_tokenizer_in_front_of_one_that_tokenizes_is_reported() {
    let bytes = |body: &Value| body["prompt"].as_str().map_or_else(Vec::new, |p| p.bytes().map(u32::from).collect());
    let tokens = move |body: &Value| bytes(body).chunks(4).map(|c| c.iter().sum::<u32>()).collect::<Vec<u32>>();
    for (engine, want) in [(tokenizing_engine(bytes).await, 0), (tokenizing_engine(tokens).await, 1)] {
        let r = router(&[("w", &engine)], |raw| raw.health_check_interval = Duration::from_millis(50)).await;
        compared_as(&r, want).await;
    }
}

/// A router with the tokenizer but no chat template keys chats by their
/// plain text: an engine that renders chats is reported (a template file
/// not copied); one that does not (a base model) is not.
#[tokio::test]
async fn an_engine_rendering_chats_the_router_cannot_is_reported() {
    let gpt2 = kvroute_shared::testdata::tokenizer_dir("gpt2").unwrap_or_else(|why| panic!("no gpt2 tokenizer: {why}"));
    let ours = std::sync::Arc::new(kvroute_shared::tokenize::PromptTokenizer::load(&gpt2).unwrap());
    assert!(!ours.has_chat_template(), "the fixture has no chat template");
    let text = move |body: &Value| {
        let req = PromptRequest::parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        ours.prompt_tokens(&req).unwrap()
    };
    let renders = {
        let text = text.clone();
        move |body: &Value| if body.get("messages").is_some() { vec![1, 2, 3] } else { text(body) }
    };
    let base_model = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "m"}]})) }))
        .route(
            "/tokenize",
            post(move |axum::Json(body): axum::Json<Value>| {
                let tokens = body.get("messages").is_none().then(|| text(&body));
                async move {
                    match tokens {
                        Some(t) => axum::Json(json!({"count": 0, "max_model_len": 4096, "tokens": t})).into_response(),
                        None => (StatusCode::BAD_REQUEST, "this model has no chat template").into_response(),
                    }
                }
            }),
        );
    for (engine, want) in [(serve_engine(base_model).await, 0), (tokenizing_engine(renders).await, 1)] {
        let r = router(&[("w", &engine)], |raw| {
            raw.tokenizer = Some(gpt2.clone());
            raw.health_check_interval = Duration::from_millis(50);
        })
        .await;
        compared_as(&r, want).await;
    }
}

/// The router compares its tokenizer and chat template with each engine's
/// (`POST /tokenize`) once: a difference is exported (and logged as an
/// error), agreement too; before, a router given the wrong tokenizer keyed
/// blocks no engine held, silently.
#[tokio::test]
async fn an_engine_that_tokenizes_otherwise_is_reported() {
    let dir = gpt2_with_template("check", "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}");
    let ours = kvroute_shared::tokenize::PromptTokenizer::load(&dir).unwrap();
    let same = {
        let ours = std::sync::Arc::new(ours);
        move |body: &Value| {
            let endpoint =
                if body.get("messages").is_some() { Endpoint::ChatCompletions } else { Endpoint::Completions };
            let req = kvroute_shared::openai::PromptRequest::parse(endpoint, body.to_string().as_bytes()).unwrap();
            ours.prompt_tokens(&req).unwrap()
        }
    };
    // The chat's tokens differ (another template), the text's agree.
    let other_template = {
        let same = same.clone();
        move |body: &Value| {
            let mut t = same(body);
            if body.get("messages").is_some() {
                t.insert(0, 50256);
            }
            t
        }
    };
    // The chat's agree, the text's differ (a BOS the router does not add).
    let other_bos = {
        let same = same.clone();
        move |body: &Value| {
            let mut t = same(body);
            if body.get("messages").is_none() {
                t.insert(0, 50256);
            }
            t
        }
    };
    for (engine, want) in [
        (tokenizing_engine(same).await, 0),
        (tokenizing_engine(other_template).await, 1),
        (tokenizing_engine(other_bos).await, 1),
    ] {
        let r = router(&[("w", &engine)], |raw| {
            raw.tokenizer = Some(dir.clone());
            raw.health_check_interval = Duration::from_millis(50);
        })
        .await;
        compared_as(&r, want).await;
    }
    std::fs::remove_dir_all(&dir).ok();
}
