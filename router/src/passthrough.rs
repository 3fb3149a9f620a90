//! The engine's other endpoints (`/v1/embeddings`, `/tokenize`,
//! `/v1/responses`, `/pooling`, `/version`, …): forwarded as they are to a
//! healthy worker serving the body's `model` (a JSON body's, or a multipart
//! form's field; the served model's workers when it names none), the one
//! with the fewest requests in flight. No prefix routing: only completions
//! and chats are keyed. A client pointed at the router instead of an engine
//! keeps the whole OpenAI surface vLLM serves; before, every such path was a
//! bare 404.
//!
//! Only the client API is forwarded, by an explicit list ([`is_client_api`]):
//! `/v1/embeddings`, `/v1/responses…`, `/v1/audio/…`, `/v1/score`,
//! `/v1/rerank`, `/v2/rerank`, `/v1/messages` (and its `/count_tokens`,
//! `/render`), and vLLM's `/tokenize`,
//! `/detokenize`, `/tokenizer_info`, `/pooling`, `/classify`, `/score`,
//! `/rerank`, `/version`, its batch of chats
//! (`/v1/chat/completions/batch`, placed by load, not keyed) and its
//! `…/render` and `…/derender` endpoints. Not `/invocations`, SageMaker's dispatcher, whose sessions
//! and adapters are driven by headers not passed on. A stored response
//! (`GET /v1/responses/{id}`, `previous_response_id`) lives on the engine
//! that made it, which the router does not track: it may be a 404. Engine
//! control (loading LoRA adapters, resetting the prefix cache, sleeping,
//! profiling) is the operator's, per engine, and the router's own paths are
//! its own: those get a 404.
//!
//! A request is retried on the next worker only when it could not connect
//! (nothing was sent); it is answered within `first_byte_timeout`, and its
//! body and answer are held to the API's limits (`max_body_bytes`,
//! `body_read_timeout`, `idle_timeout`, the concurrency limit).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kvroute_shared::wire::DP_RANK_HEADER;

use crate::error::RouterError;
use crate::proxy::{Failure, answer_headers, attempt_failed, forwarded, read_client_in_time, take_slot};
use crate::request_id::RequestId;
use crate::state::{AppState, now_ms};
use crate::workers::Worker;

/// Is `path` part of the engine's client API? An explicit list, checked on
/// a path of plain segments only (letters, digits, `_`, `-`, `.` inside a
/// name): the path is forwarded as it came, and the engine's server resolves
/// `..` and decodes `%`, so `/v1/../sleep` or `/v1/load_lora%5Fadapter`
/// would have passed a check of the raw text and reached engine control.
fn is_client_api(path: &str) -> bool {
    const EXACT: [&str; 20] = [
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/version",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/render",
        // vLLM's batch of conversations, and its render endpoints (the
        // prompt's token ids, nothing generated).
        "/v1/chat/completions/batch",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/completions/render",
        "/v1/completions/derender",
    ];
    // Followed by more segments (a response's id, an audio task).
    const PREFIXES: [&str; 2] = ["/v1/responses/", "/v1/audio/"];
    let plain = path.strip_prefix('/').is_some_and(|rest| {
        rest.split('/').all(|seg| {
            !seg.is_empty()
                && !seg.starts_with('.')
                && seg.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        })
    });
    plain && (EXACT.contains(&path) || path == "/v1/responses" || PREFIXES.iter().any(|p| path.starts_with(p)))
}

pub async fn forward(
    State(state): State<Arc<AppState>>,
    id: Option<Extension<RequestId>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let id = id.map(|Extension(id)| id);
    run(&state, id.as_ref(), method, uri, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn run(
    state: &Arc<AppState>,
    id: Option<&RequestId>,
    method: Method,
    uri: Uri,
    mut headers: HeaderMap,
    body: Body,
) -> Result<Response, RouterError> {
    if !is_client_api(uri.path()) {
        return Err(RouterError::NotFound(format!("no route for {} {}", method, uri.path())));
    }
    // Its budget held while the body is, until the answer begins.
    let (body, _budget) = read_client_in_time(state, body, state.config.raw.max_body_bytes).await?;
    let permit = take_slot(state)?;
    let named = named_in(&headers, &body);
    if let (Some(id), Some(body_id)) = (id, named.request_id.as_deref()) {
        id.adopt(body_id, &mut headers);
    }
    let headers = &headers;
    // Naming none, it is for the served model, as a completion is.
    let model = named.model.unwrap_or_else(|| crate::routing::served_model(state));
    let mut workers = crate::routing::serving(&state.workers.snapshot(), &model)?;
    // Replicas' summed figures saturate at u32::MAX: a plain sum overflowed.
    workers.sort_by_key(|w| {
        w.live.inflight.load(Ordering::Relaxed).saturating_add(w.live.replica_inflight.load(Ordering::Relaxed))
    });
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let mut last = None;
    // Servers (URLs) that could not be connected to: their other
    // data-parallel ranks are the same server, and trying them spent the
    // retries while another engine was healthy.
    let mut failed_servers: Vec<&str> = Vec::new();
    let mut attempts = 0;
    for worker in &workers {
        if attempts > state.config.raw.retries as usize {
            break;
        }
        if failed_servers.contains(&worker.url.as_str()) {
            continue;
        }
        attempts += 1;
        let mut rb = state.client.request(method.clone(), format!("{}{path}", worker.url)).body(body.clone());
        for (name, v) in forwarded(headers) {
            rb = rb.header(name, v);
        }
        // The rank charged is the rank sent to (vLLM balanced the request
        // over its ranks, while this router counted it on one).
        if let Some(rank) = worker.dp_rank {
            rb = rb.header(DP_RANK_HEADER, rank);
        }
        if let Some(v) = headers.get(header::CONTENT_TYPE).filter(|v| v.len() <= 256) {
            rb = rb.header(header::CONTENT_TYPE, v);
        }
        let inflight = Inflight::new(worker);
        // Counted by how the engine answered (a 5xx, a timeout and a failed
        // connection were all counted as `passthrough`, or not at all).
        let outcome = |o: &'static str| state.metrics.request(worker.id.as_str(), o);
        match tokio::time::timeout(state.config.raw.first_byte_timeout, rb.send()).await {
            Err(_) => {
                outcome("passthrough_timeout");
                let e = RouterError::UpstreamTimeout { worker: worker.id.clone() };
                attempt_failed(headers, worker, attempts, &e, "");
                return Err(e);
            }
            Ok(Err(e)) => {
                // Tried on the next worker only when nothing was sent.
                let Failure { error, request_sent, detail } = Failure::of(worker, &e);
                attempt_failed(headers, worker, attempts, &error, &detail);
                if request_sent {
                    outcome("passthrough_closed");
                    return Err(error);
                }
                outcome("passthrough_connect_error");
                failed_servers.push(&worker.url);
                last = Some(error);
            }
            // A redirect is not followed (see `upstream_client`), nor passed
            // on without the `location` it names: the server is not the engine.
            Ok(Ok(upstream)) if upstream.status().is_redirection() => {
                outcome("passthrough_5xx");
                let message = format!("answered {}: redirects are not followed", upstream.status());
                let e = RouterError::UpstreamFailed { worker: worker.id.clone(), message };
                attempt_failed(headers, worker, attempts, &e, "");
                return Err(e);
            }
            Ok(Ok(upstream)) => {
                outcome(match upstream.status().as_u16() {
                    500.. => "passthrough_5xx",
                    400..=499 => "passthrough_4xx",
                    _ => "passthrough",
                });
                return Ok(relay(state, worker, upstream, (inflight, permit)));
            }
        }
    }
    Err(last.unwrap_or(RouterError::NoHealthyWorker { model }))
}

/// What a passed-through body names: its model and its `request_id`.
#[derive(Debug, Default, PartialEq)]
struct Named {
    model: Option<String>,
    request_id: Option<String>,
}

/// What a body names: a JSON body's `model` and `request_id` (strings), or
/// a multipart form's fields of those names (`/v1/audio/transcriptions` and
/// `/translations` send the audio as a form). Nothing for a body of another
/// kind (an urlencoded form is not read).
fn named_in(headers: &HeaderMap, body: &Bytes) -> Named {
    #[derive(serde::Deserialize)]
    struct Json {
        #[serde(default)]
        model: Option<serde_json::Value>,
        #[serde(default)]
        request_id: Option<serde_json::Value>,
    }
    let text = |v: Option<serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s),
        _ => None,
    };
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    match form_boundary(content_type) {
        Some(boundary) => Named {
            model: form_field(body, boundary, "model").filter(|m| !m.is_empty()),
            request_id: form_field(body, boundary, "request_id").filter(|m| !m.is_empty()),
        },
        None => match serde_json::from_slice::<Json>(body) {
            Ok(j) => Named { model: text(j.model), request_id: text(j.request_id) },
            Err(_) => Named::default(),
        },
    }
}

/// `multipart/form-data; boundary=B`'s `B`.
fn form_boundary(content_type: &str) -> Option<&str> {
    let mut params = content_type.split(';');
    if !params.next()?.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"')).filter(|b| !b.is_empty())
    })
}

/// The text of the multipart form field `name` (RFC 7578), if the body has
/// one: the part after a `--boundary` line whose `Content-Disposition` names
/// it, up to the next delimiter. Only a short field is read: the model's
/// name, not a file.
fn form_field(body: &[u8], boundary: &str, name: &str) -> Option<String> {
    const MAX_FIELD_BYTES: usize = 1_024;
    let dashes = format!("--{boundary}");
    let finder = aho_corasick::AhoCorasick::new([dashes.as_bytes()]).ok()?;
    // Delimiters: `--boundary` opening the body or a line.
    let delimiters: Vec<(usize, usize)> = finder
        .find_iter(body)
        .filter(|m| m.start() == 0 || body[..m.start()].ends_with(b"\r\n"))
        .map(|m| (m.start(), m.end()))
        .collect();
    let wanted = format!("name=\"{name}\"");
    delimiters.windows(2).find_map(|w| {
        let part = body[w[0].1..w[1].0].strip_prefix(b"\r\n")?.strip_suffix(b"\r\n")?;
        let split = part.windows(4).position(|x| x == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&part[..split]).ok()?;
        let disposition = head.lines().find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))?;
        let value = &part[split + 4..];
        (disposition.split(';').any(|p| p.trim() == wanted) && value.len() <= MAX_FIELD_BYTES)
            .then(|| String::from_utf8_lossy(value).trim().to_owned())
    })
}

/// Counts a forwarded request as in flight on its worker until its answer
/// ends.
struct Inflight(Arc<Worker>);

impl Inflight {
    fn new(worker: &Arc<Worker>) -> Self {
        worker.live.inflight.fetch_add(1, Ordering::Relaxed);
        Inflight(worker.clone())
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.live.record_end(now_ms());
    }
}

/// The engine's status, the headers a client needs, and its body, chunk by
/// chunk under `idle_timeout`; `held` (the in-flight count and the
/// concurrency permit) until the body ends.
fn relay(
    state: &AppState,
    worker: &Worker,
    upstream: reqwest::Response,
    held: (Inflight, tokio::sync::OwnedSemaphorePermit),
) -> Response {
    let status = StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = answer_headers(upstream.headers(), worker);
    let idle = state.config.raw.idle_timeout;
    let chunks = upstream.bytes_stream();
    // The end of the router's shutdown grace ends it too (as a broken one).
    let cut = state.cut.clone();
    let stream = futures::stream::unfold((Box::pin(chunks), Some(held)), move |(mut chunks, held)| {
        let cut = cut.clone();
        async move {
            held.as_ref()?;
            let next = tokio::select! {
                next = tokio::time::timeout(idle, chunks.next()) => next,
                () = cut.cancelled() => {
                    return Some((Err(std::io::Error::other("the router is stopping")), (chunks, None)));
                }
            };
            match next {
                Ok(Some(Ok(chunk))) => Some((Ok(chunk), (chunks, held))),
                Ok(None) => None,
                Ok(Some(Err(_))) | Err(_) => {
                    Some((Err(std::io::Error::other("upstream stream broke")), (chunks, None)))
                }
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(content_type: &str, body: &'static str) -> Option<String> {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, content_type.parse().unwrap());
        named_in(&headers, &Bytes::from_static(body.as_bytes())).model
    }

    #[test]
    fn a_forms_model_field_names_its_model() {
        let ct = "multipart/form-data; boundary=\"b-1\"";
        let body = "--b-1\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\
                    Content-Type: audio/wav\r\n\r\nname=\"model\"\r\n\r\nRIFF\r\n--b-1\r\n\
                    Content-Disposition: form-data; name=\"model\"\r\n\r\n whisper \r\n--b-1--\r\n";
        assert_eq!(form(ct, body).as_deref(), Some("whisper"), "a file's bytes are not fields");
        let unnamed = "--b-1\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nen\r\n--b-1--\r\n";
        assert_eq!(form(ct, unnamed), None);
        assert_eq!(form("multipart/form-data", body), None, "no boundary");
        assert_eq!(form("application/json", r#"{"model": "m"}"#).as_deref(), Some("m"));
        assert_eq!(form("application/json", r#"{"model": ""}"#), None);
        assert_eq!(form("application/x-www-form-urlencoded", "model=m"), None);
    }
}
