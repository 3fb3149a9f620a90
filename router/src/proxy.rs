//! The OpenAI proxy: plan, dispatch, retry before the first byte, stream back.
//!
//! The client's body is forwarded byte for byte. An attempt that fails before
//! any byte reached the client (connect error, timeout, 5xx) is retried on the
//! next worker of the plan, up to `retries` and at most until a second server
//! failure ([`MAX_SUSPECT_ATTEMPTS`]); once bytes flowed, a failure ends a streaming
//! answer with an SSE error event (a non-streaming one is cut). Dropping the
//! response (client gone) drops the upstream request, which vLLM aborts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures::StreamExt;
use http_body_util::BodyExt;
use kvroute_shared::openai::{Endpoint, PromptRequest};
use kvroute_shared::wire::{DP_RANK_HEADER, ErrorBody};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::RouterError;
use crate::metrics::{NO_WORKER, WorkerStatus};
use crate::policy::Candidate;
use crate::replicas::SentEntry;
use crate::request_id::RequestId;
use crate::routing::{self, Plan};
use crate::sessions::valid_session_id;
use crate::state::{AppState, now_ms};
use crate::workers::Worker;

pub const WORKER_HEADER: &str = "x-kvroute-worker";
pub const SESSION_HEADER: &str = "x-session-id";
pub const SESSION_TTL_HEADER: &str = "x-session-ttl";

/// Request headers passed on to the engine, each up to a length: longer
/// ones are not passed on. vLLM takes `x-request-id` as the request's id and
/// repeats it in every streamed chunk, so a 390 kB id made gigabytes of JSON
/// of one long answer in the engine's API server.
const FORWARDED: [(&str, usize); 5] =
    [("authorization", 8192), ("x-request-id", 256), ("traceparent", 128), ("tracestate", 512), ("accept", 1024)];

/// The client's headers an engine gets (see [`FORWARDED`]).
pub fn forwarded(headers: &HeaderMap) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
    FORWARDED.into_iter().filter_map(|(name, max)| headers.get(name).filter(|v| v.len() <= max).map(|v| (name, v)))
}

/// Reads a body up to `limit` bytes (413 beyond it) within
/// `body_read_timeout` (408 beyond it): a client's, a sidecar's push or a
/// replica's report. The connection counts as busy while a body is read, so
/// one trickled in forever would hold it and its task.
pub async fn read_in_time(state: &AppState, body: Body, limit: usize) -> Result<Bytes, RouterError> {
    let timeout = state.config.raw.body_read_timeout;
    let read = tokio::time::timeout(timeout, read_within(body, limit, None)).await;
    read.map_err(|_| RouterError::BodyTimeout { after: timeout })?.map(|(body, _)| body)
}

/// A client's body's share of `max_body_bytes_in_flight`: held while the
/// body is, until its answer begins. Given back when a body was read, the
/// budget bounded only bodies being read, and those waiting for a
/// tokenizer slot or for a non-streamed answer (whose headers come with its
/// end) were bounded by the concurrency limit alone: 4,096 × 16 MiB.
pub type BodyBudget = Option<OwnedSemaphorePermit>;

/// A client's body: as [`read_in_time`], its bytes counted against
/// `max_body_bytes_in_flight` as they arrive, shed (503) past it, and shed
/// at once when [`READING_PER_SLOT`](crate::state::READING_PER_SLOT) ×
/// `max_concurrent_requests` bodies are being read already.
pub async fn read_client_in_time(
    state: &AppState,
    body: Body,
    limit: usize,
) -> Result<(Bytes, BodyBudget), RouterError> {
    let timeout = state.config.raw.body_read_timeout;
    // Held while the body is read (`state::READING_PER_SLOT`).
    let _reading = state.reading.clone().try_acquire_owned().map_err(|_| {
        state.metrics.shed.inc();
        RouterError::Overloaded
    })?;
    let read = read_within(body, limit, Some(&state.body_bytes));
    let out = tokio::time::timeout(timeout, read).await.map_err(|_| RouterError::BodyTimeout { after: timeout })?;
    if matches!(out, Err(RouterError::Overloaded)) {
        state.metrics.shed.inc();
    }
    out
}

/// Reads a body up to `limit` bytes (413 beyond it); with a `budget`, each
/// chunk's bytes are taken from it as they arrive (503 when it is spent),
/// and returned held.
async fn read_within(
    mut body: Body,
    limit: usize,
    budget: Option<&Arc<Semaphore>>,
) -> Result<(Bytes, BodyBudget), RouterError> {
    let mut buf = bytes::BytesMut::new();
    let mut held: Option<OwnedSemaphorePermit> = None;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| RouterError::bad_request("body", format!("could not read the request body: {e}")))?;
        let Ok(chunk) = frame.into_data() else { continue };
        if buf.len() + chunk.len() > limit {
            return Err(RouterError::PayloadTooLarge { limit });
        }
        if let Some(budget) = budget {
            let n = u32::try_from(chunk.len()).map_err(|_| RouterError::PayloadTooLarge { limit })?;
            let taken = budget.clone().try_acquire_many_owned(n).map_err(|_| RouterError::Overloaded)?;
            match &mut held {
                Some(h) => h.merge(taken),
                None => held = Some(taken),
            }
        }
        buf.extend_from_slice(&chunk);
    }
    Ok((buf.freeze(), held))
}

/// Parses and checks a body sent to `endpoint`.
pub fn parse(state: &AppState, endpoint: Endpoint, body: &[u8]) -> Result<PromptRequest, RouterError> {
    let mut req = PromptRequest::parse(endpoint, body)?;
    // `truncate_prompt_tokens: -1` is the engine's input limit, which
    // `max_prompt_tokens` is set to (one less for a request that generates):
    // vLLM keeps that many (as its tokenizer truncates, a Llama's BOS kept),
    // and checks no length.
    req.resolve_truncation(state.config.raw.max_prompt_tokens);
    if let PromptRequest::Chat(c) = &mut req {
        c.defaults = state.config.chat_defaults.clone();
    }
    if let PromptRequest::Chat(c) = &req
        && c.messages.len() > state.config.raw.max_messages
    {
        return Err(RouterError::bad_request(
            "messages",
            format!("at most {} messages per request", state.config.raw.max_messages),
        ));
    }
    Ok(req)
}

/// A request admitted: its body, the endpoint it is for, the body's budget
/// and a concurrency slot.
#[derive(Debug)]
pub struct Admitted {
    pub body: Bytes,
    pub endpoint: Endpoint,
    pub budget: BodyBudget,
    pub slot: OwnedSemaphorePermit,
}

/// Admits a request that will be planned (proxied or explained): its body is
/// read under a deadline *before* a concurrency slot is taken (clients that
/// send slowly must not hold the slots real requests need) and refused as
/// soon as it is too long ([`read_client_body`]); then a slot.
pub async fn admit(state: &AppState, body: Body, endpoint: Option<Endpoint>) -> Result<Admitted, RouterError> {
    let (body, endpoint, budget) = read_client_body(state, body, endpoint).await?;
    Ok(Admitted { body, endpoint, budget, slot: take_slot(state)? })
}

/// One of `max_concurrent_requests`, or the request is shed (503).
pub fn take_slot(state: &AppState) -> Result<OwnedSemaphorePermit, RouterError> {
    state.concurrency.clone().try_acquire_owned().map_err(|_| {
        state.metrics.shed.inc();
        RouterError::Overloaded
    })
}

/// A client's prompt-carrying body, read within `body_read_timeout` (408)
/// and refused (413) as soon as it is longer than `max_body_bytes`. A chat
/// body may carry images, audio or video (base64) that are no prompt text,
/// and a completion a batch of prompts, each held to the prompt's bound
/// (16 bytes a token) on its own, or prompt embeddings: at 16 bytes a token
/// for the whole body, a 600 kB image was refused as a prompt too long for
/// a 32k-token model, and so were a batch of 1,024 short prompts and a
/// tensor of embeddings, all of which vLLM serves. Read whole, a chat body
/// past the prompt's bound that carries no media part is refused before it
/// is parsed (parsed, a body of small objects takes ~30 × its size); where
/// the endpoint is not yet known (`/v1/context`, `/debug/route`), the
/// body's `messages` key says which it is. A completion's body parses to a
/// few times its size at most (`Prompt` is read without buffering, token
/// ids as `u32`, at most `MAX_BATCH` prompts; its other fields skipped),
/// and each prompt's text is held to the bound before it is tokenized.
/// Returns the endpoint too: `endpoint`, or the one the body names.
pub async fn read_client_body(
    state: &AppState,
    body: Body,
    endpoint: Option<Endpoint>,
) -> Result<(Bytes, Endpoint, BodyBudget), RouterError> {
    let prompt_limit = routing::prompt_body_limit(state);
    let too_long = || RouterError::PromptTooLong { tokens: None, max: state.config.raw.max_prompt_tokens };
    let (body, budget) = read_client_in_time(state, body, state.config.raw.max_body_bytes).await?;
    // `/debug/route` and `/v1/context` take either body: told apart as
    // the proxy tells them (a `messages` key), without building anything.
    let endpoint = endpoint.unwrap_or_else(|| crate::admin::endpoint_of(&body));
    // Media is a few long strings (base64, URLs), which parse at about their
    // size: past the prompt's bound, what is not in them is held to it too.
    // A media key alone let a body of 16 MiB of small values (parsed, ~30 ×
    // its size) through.
    if endpoint == Endpoint::ChatCompletions
        && body.len() > prompt_limit
        && (!carries_media(&body) || outside_long_strings(&body) > prompt_limit)
    {
        return Err(too_long());
    }
    Ok((body, endpoint, budget))
}

/// Strings at least this long count as media payloads in
/// [`outside_long_strings`].
const LONG_STRING: usize = 4096;

/// The bytes of a JSON body outside strings of [`LONG_STRING`] bytes or
/// more: what would parse into many small values. A linear scan; a body
/// that is not JSON is left to the parser to refuse.
fn outside_long_strings(body: &[u8]) -> usize {
    let (mut outside, mut in_string, mut escaped, mut start) = (0usize, false, false, 0usize);
    for (i, &b) in body.iter().enumerate() {
        if !in_string {
            if b == b'"' {
                (in_string, start) = (true, i);
            } else {
                outside += 1;
            }
        } else if escaped {
            escaped = false;
        } else if b == b'\\' {
            escaped = true;
        } else if b == b'"' {
            in_string = false;
            let len = i + 1 - start;
            if len < LONG_STRING {
                outside += len;
            }
        }
    }
    outside
}

/// Does a body name a media content part (vLLM's part types and keys)?
fn carries_media(body: &[u8]) -> bool {
    static MEDIA: std::sync::LazyLock<aho_corasick::AhoCorasick> = std::sync::LazyLock::new(|| {
        aho_corasick::AhoCorasick::new([
            "\"image_url\"",
            "\"input_image\"",
            "\"image_embeds\"",
            "\"image_pil\"",
            "\"audio_url\"",
            "\"input_audio\"",
            "\"audio_embeds\"",
            "\"video_url\"",
            "\"video_embeds\"",
            "\"prompt_embeds\"",
        ])
        .expect("fixed patterns")
    });
    MEDIA.is_match(body)
}

/// Session id and TTL from the request headers, when valid.
pub fn session_of(state: &AppState, headers: &HeaderMap) -> Result<Option<(String, Duration)>, RouterError> {
    let Some(id) = headers.get(SESSION_HEADER) else { return Ok(None) };
    let id = id
        .to_str()
        .ok()
        .filter(|s| valid_session_id(s))
        .ok_or_else(|| RouterError::bad_request(SESSION_HEADER, "must be 1 to 128 printable ASCII characters"))?;
    let ttl = session_ttl(state, headers)?;
    Ok(Some((id.to_owned(), ttl)))
}

/// The session TTL a request asks for (`x-session-ttl`, whole seconds,
/// capped), else the configured default.
pub fn session_ttl(state: &AppState, headers: &HeaderMap) -> Result<Duration, RouterError> {
    let Some(v) = headers.get(SESSION_TTL_HEADER) else { return Ok(state.config.raw.session_ttl) };
    let secs: u64 = v
        .to_str()
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| RouterError::bad_request(SESSION_TTL_HEADER, "must be whole seconds"))?;
    Ok(Duration::from_secs(secs).min(state.config.raw.max_session_ttl))
}

/// `POST /v1/completions` and `/v1/chat/completions`.
pub async fn handle(
    State(state): State<Arc<AppState>>,
    endpoint: Endpoint,
    id: Option<Extension<RequestId>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let id = id.map(|Extension(id)| id);
    match proxy(&state, endpoint, id.as_ref(), &headers, body, None, Instant::now()).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

/// Proxies one request that `arrived` then; `new_session` names a session
/// to create for it (`POST /v1/context`).
pub async fn proxy(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    id: Option<&RequestId>,
    headers: &HeaderMap,
    body: Body,
    new_session: Option<(String, Duration)>,
    arrived: Instant,
) -> Result<Response, RouterError> {
    let unrecorded = Unrecorded { state, arrived, dispatched: AtomicBool::new(false) };
    let result = proxy_from(state, endpoint, id, headers, body, new_session, &unrecorded).await;
    // An answer's duration is observed by its guard when the answer ends,
    // every attempt failing by `dispatch`; a refusal ends here.
    unrecorded.dispatched.store(true, Ordering::Relaxed);
    if let Err(e) = &result
        && !matches!(e, RouterError::UpstreamFailed { .. } | RouterError::UpstreamTimeout { .. })
    {
        refused(state, e, arrived);
    }
    result
}

/// A request refused before a worker was chosen, as `request_duration`
/// records it.
pub fn refused(state: &AppState, e: &RouterError, arrived: Instant) {
    let status = if e.status().is_client_error() { "4xx" } else { "5xx" };
    state.metrics.request_finished(NO_WORKER, status, arrived.elapsed().as_secs_f64());
}

/// A request not yet given to a worker: if its client leaves now (while it
/// waits for a tokenizer, a slot, its body), it is recorded as ended by
/// `error` with no worker. Such requests were in no request metric: under a
/// saturated tokenizer pool the slowest (the clients that gave up) were
/// missing from `request_duration` (`dispatch_delay` still has only the
/// requests dispatched).
struct Unrecorded<'a> {
    state: &'a AppState,
    arrived: Instant,
    /// Given to a worker (whose guard records it) or ended here.
    dispatched: AtomicBool,
}

impl Drop for Unrecorded<'_> {
    fn drop(&mut self) {
        if !self.dispatched.load(Ordering::Relaxed) {
            self.state.metrics.request_finished(NO_WORKER, "error", self.arrived.elapsed().as_secs_f64());
        }
    }
}

async fn proxy_from(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    id: Option<&RequestId>,
    headers: &HeaderMap,
    body: Body,
    new_session: Option<(String, Duration)>,
    unrecorded: &Unrecorded<'_>,
) -> Result<Response, RouterError> {
    let Admitted { body, budget, slot: _permit, .. } = admit(state, body, Some(endpoint)).await?;
    let session = match new_session {
        Some(s) => Some(s),
        None => session_of(state, headers)?,
    };
    let (stream, prepared) = routing::parse_and_prepare(state, endpoint, &body).await?;
    let adopted;
    let headers = match (id, prepared.request_id.as_deref()) {
        (Some(id), Some(body_id)) => {
            let mut h = headers.clone();
            id.adopt(body_id, &mut h);
            adopted = h;
            &adopted
        }
        _ => headers,
    };
    if prepared.template_fallback {
        state.metrics.event("chat_template_fallback", 1);
    }
    let pinned = session.as_ref().and_then(|(id, _)| state.sessions.get(id, Instant::now()));
    let plan = routing::plan(state, prepared, pinned.as_ref(), true)?;
    let mut resp = dispatch(state, endpoint, headers, body, &plan, stream, unrecorded).await?;
    // The body is gone with the attempts: its answer has begun.
    drop(budget);
    if let Some((id, ttl)) = session {
        let worker =
            resp.headers().get(WORKER_HEADER).and_then(|v| v.to_str().ok()).map(kvroute_shared::WorkerId::from);
        // The id is returned only when it was stored: a client must never
        // hold a session id the router does not know. Only an answer pins:
        // requests the engine refused (4xx) would churn the table cheaply.
        if let Some(w) = worker.filter(|_| resp.status().is_success()) {
            state.sessions.pin(&id, &w, ttl, Instant::now());
            if let Ok(v) = HeaderValue::from_str(&id) {
                resp.headers_mut().insert(SESSION_HEADER, v);
            }
        }
    }
    // The permit is held by the response body until the answer is complete.
    Ok(resp.map(|b| Body::new(PermitBody { inner: b, _permit })))
}

/// Tries the plan's workers in order until one answers.
async fn dispatch(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
    plan: &Plan,
    streaming: bool,
    unrecorded: &Unrecorded<'_>,
) -> Result<Response, RouterError> {
    let arrived = unrecorded.arrived;
    let max_attempts = 1 + state.config.raw.retries as usize;
    let mut last_err = None;
    // Workers that failed this request in a way the request itself can cause
    // (a 5xx, a connection closed after the request was sent, a stream broken
    // before its first chunk, a first token late or no block filled in time:
    // a JSON schema that takes the engine minutes to compile, media whose
    // tokens the deadline does not count): charged to their health only once
    // another worker has answered it. A request every worker refuses or is
    // slow on is the request's doing and must not eject them all one by one.
    let mut suspects: Vec<&Arc<Worker>> = Vec::new();
    // Of them, failures by the server (a 5xx, a connection closed, a stream
    // broken): what a request that crashes its engine looks like.
    let mut crashes = 0;
    // Blocks after an image (audio, video, prompt embeddings) carry extra
    // keys the sidecar does not translate: filling them reports nothing.
    // Read only for non-streamed answers: a stream's body is not scanned.
    let keyed = streaming || !carries_media(&body);
    // Engines (URLs) whose server failed this request: not connected to,
    // the connection closed, a 5xx. The other data-parallel ranks behind
    // the same URL are the same server: trying them spent every retry on
    // it while other engines were healthy. A rank's late first token is
    // that rank's, and leaves its siblings to be tried.
    let mut failed_servers: Vec<&str> = Vec::new();
    // A worker ejected since the plan was made is not tried: its attempt
    // would be given up at once, and count against the retries. The plan's
    // first worker got the plan's speculative entries; any other is a
    // retry's, and records its own.
    let mut attempts = plan.attempts().enumerate();
    let mut tried = 0;
    while tried < max_attempts {
        let Some((attempt, (worker, cand))) = attempts.next() else { break };
        if !worker.live.is_healthy() || failed_servers.contains(&worker.url.as_str()) {
            continue;
        }
        tried += 1;
        // From here its attempts' guards record it.
        unrecorded.dispatched.store(true, Ordering::Relaxed);
        let recorded = if attempt > 0 {
            state.metrics.retries.inc();
            routing::record_dispatch(state, worker, &plan.keys)
        } else {
            // The router's own queueing: body, tokenize, route, admission.
            state.metrics.dispatch_delay.observe(arrived.elapsed().as_secs_f64());
            plan.recorded
        };
        // A streamed answer's first chunk is its first token: its time
        // measures the worker's pace against the timing model.
        let modelled = streaming
            .then(|| {
                let model = &state.config.raw.predicted_ttft;
                model.pace_model_us(&cand.load, plan.uncached_tokens(cand), state.mean_uncached_tokens())
            })
            .flatten();
        let mut guard = InflightGuard::new(state.clone(), worker.clone(), plan, cand, modelled, streaming, arrived);
        let mut wait = Deadline::new(state, worker, streaming, keyed, plan.uncached_tokens(cand));
        // A non-streamed answer's headers come with its last token: nothing
        // marks its first, and its prompt would count as queued prefill for
        // its whole generation. It is taken as prefilled when the timing
        // model (at the worker's measured pace) says its first token comes.
        let prefilled_at = (!streaming).then(|| {
            let model = &state.config.raw.predicted_ttft;
            let us = model.model_us(&cand.load, plan.uncached_tokens(cand), state.mean_uncached_tokens());
            let after = Duration::try_from_secs_f64(us * cand.load.pace.unwrap_or(1.0).max(1.0) / 1e6);
            wait.started + after.unwrap_or(Duration::MAX).min(state.config.raw.first_byte_timeout)
        });
        let sent = send(worker, state, endpoint, headers, body.clone());
        let began = match watch(worker, sent, &mut wait, Some((&mut guard, prefilled_at))).await {
            Wait::Done(Ok(upstream)) if streaming && upstream.status().is_success() => {
                // vLLM sends a stream's headers at once: only the first chunk
                // says the engine is producing. Until it arrives nothing has
                // reached the client, so a wedged, slow or ejected worker's
                // request is cancelled (dropped) and tried elsewhere.
                let status = upstream.status();
                let head = upstream.headers().clone();
                let mut chunks: ChunkStream = Box::pin(upstream.bytes_stream());
                let first = loop {
                    match watch(worker, chunks.next(), &mut wait, None).await {
                        Wait::Done(Some(Ok(b))) if b.is_empty() => continue,
                        other => break other,
                    }
                };
                first.map(|first| match first {
                    Some(Err(_)) => Began::Broken,
                    first => {
                        let first = first.and_then(Result::ok);
                        let chunks: ChunkStream = Box::pin(futures::stream::iter(first.map(Ok)).chain(chunks));
                        Began::Stream(status, head, chunks)
                    }
                })
            }
            other => other.map(Began::Headers),
        };
        let request_may_be_at_fault;
        let mut server_failed = true;
        let mut failure_detail = String::new();
        match began {
            Wait::Ejected => {
                guard.failed("ejected");
                let e = RouterError::UpstreamFailed {
                    worker: worker.id.clone(),
                    message: "ejected before its answer began".into(),
                };
                attempt_failed(headers, worker, tried, &e, "");
                last_err = Some(e);
                continue; // already ejected: not another failure
            }
            Wait::TimedOut if !streaming => {
                // Past `first_byte_timeout` the answer is long, not lost: the
                // worker is not charged, and the request is not run again.
                guard.failed("timeout");
                let e = RouterError::UpstreamTimeout { worker: worker.id.clone() };
                attempt_failed(headers, worker, tried, &e, "");
                last_err = Some(e);
                break;
            }
            Wait::Stalled if !streaming => {
                // Its engine filled no block for a whole window: wedged, or
                // busy with this request's own slow start.
                server_failed = false;
                request_may_be_at_fault = true;
                guard.failed("stalled");
                state.metrics.event("stalled", 1);
                last_err = Some(RouterError::UpstreamTimeout { worker: worker.id.clone() });
            }
            Wait::TimedOut | Wait::Stalled => {
                server_failed = false;
                request_may_be_at_fault = true;
                guard.failed("first_token_timeout");
                state.metrics.event("first_token_timeout", 1);
                last_err = Some(RouterError::UpstreamTimeout { worker: worker.id.clone() });
            }
            Wait::Done(Began::Stream(status, head, chunks)) => {
                note_success(worker);
                suspects.iter().for_each(|w| note_failure(state, w));
                return Ok(relay(state, status, &head, chunks, guard, true));
            }
            Wait::Done(Began::Broken) => {
                // As for a 5xx and a closed connection, the request's
                // speculative entries are taken back (`routing::withdraw`).
                routing::withdraw(state, worker, &plan.keys, recorded);
                guard.failed("broken_stream");
                request_may_be_at_fault = true;
                last_err = Some(RouterError::UpstreamFailed {
                    worker: worker.id.clone(),
                    message: "the stream broke before its first chunk".into(),
                });
            }
            // A redirect is not followed: an engine does not send one, so the
            // server answering is not the engine (an ingress, a login page).
            Wait::Done(Began::Headers(Ok(upstream)))
                if upstream.status().is_server_error() || upstream.status().is_redirection() =>
            {
                routing::withdraw(state, worker, &plan.keys, recorded);
                guard.failed("upstream_5xx");
                request_may_be_at_fault = true;
                last_err = Some(RouterError::UpstreamFailed {
                    worker: worker.id.clone(),
                    message: format!("answered {}", upstream.status()),
                });
            }
            Wait::Done(Began::Headers(Ok(upstream))) => {
                // A 4xx is the request's: the engine's API server answered,
                // which says nothing of its engine core producing tokens,
                // and computed nothing.
                if upstream.status().is_success() {
                    note_success(worker);
                } else if upstream.status().is_client_error() {
                    routing::withdraw(state, worker, &plan.keys, recorded);
                    guard.abandon_sent();
                }
                suspects.iter().for_each(|w| note_failure(state, w));
                return Ok(respond(state, upstream, guard, streaming));
            }
            Wait::Done(Began::Headers(Err(Failure { error, request_sent, detail }))) => {
                routing::withdraw(state, worker, &plan.keys, recorded);
                guard.failed(if request_sent { "closed" } else { "connect_error" });
                request_may_be_at_fault = request_sent;
                last_err = Some(error);
                failure_detail = detail;
            }
        }
        if let Some(e) = &last_err {
            attempt_failed(headers, worker, tried, e, &failure_detail);
        }
        if server_failed {
            failed_servers.push(&worker.url);
        }
        if request_may_be_at_fault {
            suspects.push(worker);
            // A request that can crash an engine (vLLM's `EngineDeadError`
            // takes down everything in flight there) was sent to 1 + retries
            // of them: after two such failures it goes to no third. A late
            // first token crashes nothing, and is tried on (two wedged
            // holders of a prefix would keep its requests from the rest).
            if server_failed {
                crashes += 1;
                if crashes >= MAX_SUSPECT_ATTEMPTS {
                    // Counted where another attempt would have been made.
                    let another = attempts
                        .clone()
                        .any(|(_, (w, _))| w.live.is_healthy() && !failed_servers.contains(&w.url.as_str()));
                    if tried < max_attempts && another {
                        state.metrics.event("retries_stopped", 1);
                    }
                    break;
                }
            }
        } else {
            note_failure(state, worker);
        }
    }
    // No worker answered: the failures the request may have caused are
    // counted per worker (`requests_total{outcome}`), not charged to health.
    let err = last_err.unwrap_or_else(|| RouterError::NoHealthyWorker { model: plan.model.clone() });
    if let RouterError::UpstreamFailed { worker, .. } | RouterError::UpstreamTimeout { worker } = &err {
        // Observed while the plan still holds the worker: a removed worker's
        // series are swept until nothing holds it, so none is left behind.
        state.metrics.request_finished(worker.as_str(), "5xx", arrived.elapsed().as_secs_f64());
    }
    Err(err)
}

/// One line per failed attempt, with what ties it to the engine's log (the
/// client's `x-request-id`, which vLLM takes as its own): a 502 (a poison
/// request's `EngineDeadError`) said nothing anywhere but a counter.
/// Bounded: a failing worker is ejected.
pub fn attempt_failed(headers: &HeaderMap, worker: &Worker, attempt: usize, e: &RouterError, detail: &str) {
    let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
    tracing::warn!(
        worker = %worker.id, url = %worker.url, attempt, request_id, error = %e, detail, "attempt failed"
    );
}

/// Attempts a request may fail by the server in a way it can itself cause (a
/// 5xx, a connection closed after sending, a stream broken before its first
/// chunk) before it is given up, whatever `retries` allows: one more worker
/// gets the chance another failed, and a poison request (one that crashes
/// its engine) costs two engines their work in flight, not 1 + `retries`.
/// A late first token is not counted: it crashes nothing.
pub const MAX_SUSPECT_ATTEMPTS: usize = 2;

/// An attempt that got no response. `request_sent`: the connection was made
/// and then closed or reset without an answer, which the request itself can
/// cause (an engine that refuses it by dropping the connection).
#[derive(Debug)]
pub struct Failure {
    pub error: RouterError,
    pub request_sent: bool,
    /// What the connection got (reqwest's error chain, naming the URL):
    /// for the log, never returned (error.rs).
    pub detail: String,
}

async fn send(
    worker: &Worker,
    state: &AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<reqwest::Response, Failure> {
    let mut rb = state
        .client
        .post(format!("{}{}", worker.url, endpoint.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body);
    for (name, v) in forwarded(headers) {
        rb = rb.header(name, v);
    }
    // The router picked the rank; a client's own header is never forwarded
    // (it is not in FORWARDED), so it cannot send a request past the index.
    if let Some(rank) = worker.dp_rank {
        rb = rb.header(DP_RANK_HEADER, rank);
    }
    rb.send().await.map_err(|e| Failure::of(worker, &e))
}

impl Failure {
    /// A request to `worker` that got no response.
    pub fn of(worker: &Worker, e: &reqwest::Error) -> Self {
        let message = if e.is_connect() { "could not connect" } else { "the connection closed without an answer" };
        Failure {
            request_sent: !e.is_connect(),
            error: RouterError::UpstreamFailed { worker: worker.id.clone(), message: message.into() },
            detail: kvroute_shared::logging::error_chain(e),
        }
    }
}

type ChunkStream = std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// How an attempt's answer began.
enum Began {
    /// Its headers (or the failure to get them): a non-streamed answer
    /// whole, or any answer but a stream's 2xx.
    Headers(Result<reqwest::Response, Failure>),
    /// A stream's first chunk came (or it ended without one): its status,
    /// headers and chunks, the first included.
    Stream(reqwest::StatusCode, reqwest::header::HeaderMap, ChunkStream),
    /// A stream broke before its first chunk.
    Broken,
}

/// How waiting for an attempt's answer (its headers, a stream's first
/// chunk) ended.
enum Wait<T> {
    Done(T),
    /// Past its deadline with the worker not seen producing: wedged.
    Stalled,
    /// Past `first_byte_timeout`.
    TimedOut,
    /// The worker was ejected meanwhile and is not seen producing: nothing
    /// reached the client, so the request is tried elsewhere.
    Ejected,
}

/// How long an attempt may wait for its answer to begin.
///
/// A stream's first chunk is its first token: it must come within
/// `first_token_timeout` (plus the per-1k-token share for the prompt's
/// uncached tokens) of dispatch, headers included, unless the worker is seen
/// producing (another of this router's answers there began, or its sidecar
/// reported blocks filled, within the last window): then it is queued
/// behind real work, not wedged, and keeps its place for another
/// `first_token_timeout`, up to `first_byte_timeout` in all. Cancelled, it
/// would start again at the back of another worker's queue, and the worker,
/// charged with a failure, be ejected for being busy.
///
/// A non-streamed answer comes whole, after its last token: it may take up
/// to `first_byte_timeout`. On a worker whose sidecar reports the blocks its
/// engine fills, it is watched as a stream is: a generation fills a block
/// every few dozen tokens, so a window without any is a wedged engine (its
/// `/health` may answer), whose requests would otherwise wait an hour each
/// and never charge it. Without such reports nothing tells a long answer
/// from a wedged engine.
struct Deadline {
    started: tokio::time::Instant,
    until: tokio::time::Instant,
    hard: tokio::time::Instant,
    /// The window in which progress extends the wait (streams, and answers
    /// watched by the blocks their engine fills).
    window: Option<Duration>,
    /// A non-streamed answer, watched by the blocks its engine fills: judged
    /// only on windows in which the sidecar reported at all.
    by_blocks: bool,
    /// When progress was last looked for (unix ms).
    checked_ms: u64,
}

impl<T> Wait<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Wait<U> {
        match self {
            Wait::Done(t) => Wait::Done(f(t)),
            Wait::Stalled => Wait::Stalled,
            Wait::TimedOut => Wait::TimedOut,
            Wait::Ejected => Wait::Ejected,
        }
    }
}

impl Deadline {
    /// `keyed`: the blocks the request fills are ones its worker's sidecar
    /// reports (no media part), so a non-streamed answer can be watched by
    /// them. An engine serving only image requests fills none it reports:
    /// such answers were judged stalled a window in, cancelled and charged.
    fn new(state: &AppState, worker: &Worker, streaming: bool, keyed: bool, uncached_tokens: u64) -> Self {
        let raw = &state.config.raw;
        let started = tokio::time::Instant::now();
        let hard = started + raw.first_byte_timeout;
        let reports_blocks = keyed
            && worker.live.has_sidecar.load(Ordering::Relaxed)
            && worker.live.last_blocks_ms.load(Ordering::Relaxed) > 0;
        let (until, window) = if streaming || reports_blocks {
            let first_token = raw.first_token_timeout
                + raw.first_token_timeout_per_1k_tokens.mul_f64(uncached_tokens as f64 / 1000.0);
            ((started + first_token).min(hard), Some(raw.first_token_timeout))
        } else {
            (hard, None)
        };
        Deadline { started, until, hard, window, by_blocks: !streaming && reports_blocks, checked_ms: now_ms() }
    }

    /// At `until`: the wait goes on (`None`: the worker was seen producing
    /// since the last look, and `first_byte_timeout` is not reached), or
    /// why it ends.
    fn extend<T>(&mut self, worker: &Worker) -> Option<Wait<T>> {
        let now = tokio::time::Instant::now();
        if now >= self.hard {
            return Some(Wait::TimedOut);
        }
        let window = self.window?;
        let since = |at: &std::sync::atomic::AtomicU64| at.load(Ordering::Relaxed) >= self.checked_ms;
        // A sidecar that fell silent too (it died) says nothing of its
        // engine: its blocks are missing only from reports that arrive.
        if !since(&worker.live.last_progress_ms) && (!self.by_blocks || since(&worker.live.last_report_ms)) {
            return Some(Wait::Stalled);
        }
        self.until = (now + window).min(self.hard);
        self.checked_ms = now_ms();
        None
    }
}

/// How lately a worker must have been seen producing for the requests it
/// holds to outlive its ejection.
const PRODUCING_WITHIN_MS: u64 = 5_000;

/// Seen producing lately: another of this router's answers began there, or
/// its sidecar reported blocks filled. Such a worker, ejected, was ejected
/// for its probes (a `/health` that times out on an engine saturated with
/// work) or for others' connections, not for the requests it is answering:
/// those were all cancelled and run again from the start on workers as
/// busy, for up to `first_byte_timeout` of generation each. An engine gone
/// resets its connections; one unreachable shows no progress either.
fn producing(worker: &Worker) -> bool {
    now_ms().saturating_sub(worker.live.last_progress_ms.load(Ordering::Relaxed)) < PRODUCING_WITHIN_MS
}

/// Waits for `answer` within `deadline`, giving up early if the worker is
/// ejected meanwhile and not [`producing`]. `prefill`: the attempt's guard and when its prompt is
/// taken as prefilled (a non-streamed answer's), released then.
async fn watch<T>(
    worker: &Worker,
    answer: impl Future<Output = T>,
    deadline: &mut Deadline,
    mut prefill: Option<(&mut InflightGuard, Option<tokio::time::Instant>)>,
) -> Wait<T> {
    let mut answer = std::pin::pin!(answer);
    let mut check = tokio::time::interval(Duration::from_millis(250));
    loop {
        let release_at = prefill.as_ref().and_then(|(g, at)| at.filter(|_| !g.prefill_released()));
        tokio::select! {
            out = &mut answer => return Wait::Done(out),
            () = tokio::time::sleep_until(deadline.until) => if let Some(end) = deadline.extend(worker) {
                return end;
            },
            () = tokio::time::sleep_until(release_at.unwrap_or(deadline.hard)), if release_at.is_some() => {
                if let Some((guard, _)) = prefill.as_mut() {
                    guard.release_prefill();
                }
            }
            _ = check.tick() => if !worker.live.is_healthy() && !producing(worker) { return Wait::Ejected },
        }
    }
}

/// Builds the client's response around the upstream's body stream.
fn respond(state: &AppState, upstream: reqwest::Response, guard: InflightGuard, streaming: bool) -> Response {
    let status = upstream.status();
    let head = upstream.headers().clone();
    relay(state, status, &head, Box::pin(upstream.bytes_stream()), guard, streaming)
}

/// The engine's answer headers a client gets (content type, caching, its
/// request id, when to retry a 429 or 503 it passes on, how to
/// authenticate after a 401), and `x-kvroute-worker`.
pub fn answer_headers(head: &reqwest::header::HeaderMap, worker: &Worker) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let passed = [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        HeaderName::from_static("x-request-id"),
        header::RETRY_AFTER,
        header::WWW_AUTHENTICATE,
    ];
    for name in passed {
        if let Some(v) = head.get(name.as_str()).and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
            headers.insert(name, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(worker.id.as_str()) {
        headers.insert(WORKER_HEADER, v);
    }
    headers
}

/// The client's response: the upstream's status and headers we pass on, and
/// its chunks relayed one by one under the idle timeout.
fn relay(
    state: &AppState,
    status: reqwest::StatusCode,
    head: &reqwest::header::HeaderMap,
    chunks: ChunkStream,
    guard: InflightGuard,
    streaming: bool,
) -> Response {
    let status = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = answer_headers(head, &guard.worker);
    let sse = streaming
        && head
            .get(header::CONTENT_TYPE.as_str())
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
    let idle = state.config.raw.idle_timeout;
    let outcome = if status.is_success() { "ok" } else { "upstream_4xx" };
    let stream = futures::stream::unfold(
        Relay { chunks, guard, sse, held: EventHold::default(), done: false, outcome },
        move |mut st| async move {
            loop {
                if st.done {
                    return None;
                }
                let next = tokio::select! {
                    next = tokio::time::timeout(idle, st.chunks.next()) => next,
                    () = st.guard.state.cut.cancelled() => {
                        // The router stops: the answer ends as a broken one
                        // does, with an error event, not charged to the worker.
                        st.done = true;
                        st.guard.finish("router_stopped");
                        if !st.sse {
                            return Some((Err(std::io::Error::other("the router is stopping")), st));
                        }
                        let event = st.held.last_event(stopping_event());
                        return Some((Ok(event), st));
                    }
                };
                match next {
                    Ok(Some(Ok(chunk))) => {
                        st.guard.first_byte(status_class(st.outcome));
                        if !st.sse {
                            return Some((Ok(chunk), st));
                        }
                        if let Some(whole) = st.held.whole_events(&chunk) {
                            return Some((Ok(whole), st));
                        }
                    }
                    Ok(None) => {
                        st.done = true;
                        st.guard.finish(st.outcome);
                        // What the engine ended with, as it sent it.
                        let rest = st.held.partial.split().freeze();
                        return (!rest.is_empty()).then_some((Ok(rest), st));
                    }
                    Ok(Some(Err(_))) | Err(_) => {
                        st.done = true;
                        st.guard.finish("broken_stream");
                        note_failure(&st.guard.state, &st.guard.worker);
                        if st.sse {
                            // An event cut short is dropped: ended by a blank
                            // line it reached the client as an event whose
                            // data is cut JSON, and the client's parser failed
                            // on it before it read the error event.
                            let event = st.held.last_event(sse_error(&st.guard.worker.id));
                            return Some((Ok(event), st));
                        }
                        return Some((Err(std::io::Error::other("upstream stream broke")), st));
                    }
                }
            }
        },
    );
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

struct Relay {
    chunks: ChunkStream,
    guard: InflightGuard,
    sse: bool,
    held: EventHold,
    done: bool,
    outcome: &'static str,
}

/// An event stream's bytes past its last whole event, held until the event
/// ends (vLLM writes whole events, so this is normally empty).
#[derive(Default)]
struct EventHold {
    partial: BytesMut,
    /// What was sent ends inside an event (one past the hold's bound).
    sent_mid_event: bool,
}

/// An event longer than this is passed on before it ends, not held: a
/// stream's first chunk with `prompt_logprobs` can be megabytes, and each
/// stream holds its own.
const MAX_HELD_EVENT_BYTES: usize = 1 << 20;

impl EventHold {
    /// `event` as the stream's last: the held bytes of an unfinished event
    /// dropped, and, past the hold's bound (a cut event already sent), a
    /// blank line first, so that `event` is an event of its own.
    fn last_event(&mut self, event: Bytes) -> Bytes {
        self.partial.clear();
        if self.sent_mid_event { [&b"\n\n"[..], &event].concat().into() } else { event }
    }

    /// `chunk` added to the held bytes: the whole events among them, if any,
    /// taken out to be sent (all of them past [`MAX_HELD_EVENT_BYTES`]).
    fn whole_events(&mut self, chunk: &Bytes) -> Option<Bytes> {
        // vLLM's chunks are whole events: passed on as they are, uncopied.
        if self.partial.is_empty() && (chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n")) {
            self.sent_mid_event = false;
            return Some(chunk.clone());
        }
        // A blank line that ends in `chunk` starts at most 3 bytes before it.
        let from = self.partial.len().saturating_sub(3);
        self.partial.extend_from_slice(chunk);
        let (end, mid_event) = match last_event_end(&self.partial[from..]) {
            Some(end) => (from + end, false),
            None if self.partial.len() > MAX_HELD_EVENT_BYTES => (self.partial.len(), true),
            None => return None,
        };
        self.sent_mid_event = mid_event;
        if end == self.partial.len() {
            // Not `split_to`: what is left would keep the grown buffer for
            // the rest of the stream.
            return Some(std::mem::take(&mut self.partial).freeze());
        }
        Some(self.partial.split_to(end).freeze())
    }
}

/// Where the last event in `buf` ends: just past its last blank line
/// (`\n\n` or `\r\n\r\n`, the endings vLLM's server writes).
fn last_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).rposition(|w| w == b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

/// The SSE event that ends a stream the router cut at the end of its
/// shutdown grace.
fn stopping_event() -> Bytes {
    let body = ErrorBody::new(503, "service_unavailable", "the router stopped before the answer ended");
    let json = serde_json::to_string(&body).unwrap_or_default();
    Bytes::from(format!("data: {json}\n\ndata: [DONE]\n\n"))
}

/// The SSE event that ends a stream whose upstream failed mid-answer.
fn sse_error(worker: &kvroute_shared::WorkerId) -> Bytes {
    let body = ErrorBody::new(502, "upstream_error", format!("worker {worker} failed mid-stream"));
    let json = serde_json::to_string(&body).unwrap_or_default();
    Bytes::from(format!("data: {json}\n\ndata: [DONE]\n\n"))
}

pub fn note_success(worker: &Worker) {
    worker.live.last_progress_ms.store(now_ms(), Ordering::Relaxed);
    // An answer begun on an ejected worker (one kept while it was seen
    // producing) says its older work goes on, not that it is well again:
    // its hold would be reset, and never double.
    if worker.live.is_healthy() {
        worker.live.consecutive_failures.store(0, Ordering::Relaxed);
        worker.live.request_ejections.store(0, Ordering::Relaxed);
    }
}

/// Passive health: a request failed there. After `eject_after_failures` in a
/// row (health probes that answer meanwhile do not reset the count) the
/// worker is ejected and held out ([`crate::health::request_hold`]).
pub fn note_failure(state: &AppState, worker: &Worker) {
    let n = worker.live.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
    if n < state.config.raw.eject_after_failures || !worker.live.is_healthy() {
        return;
    }
    // The hold is in place before the worker is unhealthy: a probe between
    // the two would see it ejected and not held, and re-admit it.
    let k = worker.live.request_ejections.load(Ordering::Relaxed) + 1;
    let hold = crate::health::request_hold(k);
    // The later of two holds: two requests failing together both set one,
    // and the one that lost the ejection put the old value back, erasing the
    // winner's (the next probe re-admitted the worker).
    worker.live.held_until_ms.fetch_max(now_ms() + hold.as_millis() as u64, Ordering::Relaxed);
    if !worker.live.healthy.swap(false, Ordering::Relaxed) {
        // Ejected meanwhile. By its probes: judged gone, it is not held
        // (answering again, it is re-admitted at once).
        if worker.live.probe_failures.load(Ordering::Relaxed) >= state.config.raw.eject_after_failures {
            worker.live.held_until_ms.store(0, Ordering::Relaxed);
        }
        return;
    }
    worker.live.request_ejections.store(k, Ordering::Relaxed);
    let why = format!("{n} requests failed in a row; held out for {hold:?} while /health answers");
    crate::health::eject(state, worker, &why);
}

/// Counts a request against its worker from dispatch to end of answer; its
/// prompt's uncached tokens count as pending prefill until the first byte.
/// The attempt that is not `failed` (the one whose answer the client gets, or
/// the one the client left during) observes the request's whole duration.
struct InflightGuard {
    state: Arc<AppState>,
    worker: Arc<Worker>,
    pending: u64,
    /// The timing model's time to first token there, µs (streamed answers).
    modelled_us: Option<f64>,
    /// The client asked for a stream: its first byte is its first token.
    streamed: bool,
    /// When the client's request arrived (before any attempt).
    arrived: Instant,
    started: Instant,
    first_seen: bool,
    /// Its prompt no longer counts as pending prefill there.
    prefilled: bool,
    outcome: Option<&'static str>,
    /// This request as the router's reports to its replicas name it, until
    /// a while after its first token (`crate::replicas::SentEntry`).
    sent: Option<Arc<SentEntry>>,
    /// Failed before any byte reached the client: retried elsewhere, or
    /// reported as the request's error by [`proxy`].
    failed: bool,
}

impl InflightGuard {
    fn new(
        state: Arc<AppState>,
        worker: Arc<Worker>,
        plan: &Plan,
        cand: &Candidate,
        modelled_us: Option<f64>,
        streamed: bool,
        arrived: Instant,
    ) -> Self {
        let pending = plan.uncached_tokens(cand);
        worker.live.inflight.fetch_add(1, Ordering::Relaxed);
        worker.live.pending_prefill_tokens.fetch_add(pending, Ordering::Relaxed);
        worker.live.record_arrival(now_ms());
        let sent = state.replicas.record_sent(&worker.id, &plan.keys);
        InflightGuard {
            sent,
            state,
            worker,
            pending,
            modelled_us,
            streamed,
            arrived,
            started: Instant::now(),
            first_seen: false,
            prefilled: false,
            outcome: None,
            failed: false,
        }
    }

    /// The answer's first byte reached the client; `status` is its class.
    /// Only a stream's first byte is its first token: a non-streamed
    /// answer's comes with its last, and is not a TTFT.
    fn first_byte(&mut self, status: &'static str) {
        if self.first_seen {
            return;
        }
        self.first_seen = true;
        self.release_prefill();
        if let Some(sent) = &self.sent {
            sent.done(now_ms());
        }
        let took = self.started.elapsed();
        if let Some(modelled) = self.modelled_us
            && status == "2xx"
        {
            self.worker.live.record_first_token(took.as_secs_f64() * 1e6, modelled);
        }
        if self.streamed {
            let label = WorkerStatus { worker: self.worker.id.to_string(), status };
            self.state.metrics.ttft.get_or_create(&label).observe(took.as_secs_f64());
        }
    }

    /// Its prompt is prefilled (its first byte came, or the model says so).
    fn release_prefill(&mut self) {
        if !std::mem::replace(&mut self.prefilled, true) {
            self.worker.live.pending_prefill_tokens.fetch_sub(self.pending, Ordering::Relaxed);
        }
    }

    fn prefill_released(&self) -> bool {
        self.prefilled
    }

    fn finish(&mut self, outcome: &'static str) {
        self.outcome.get_or_insert(outcome);
    }

    fn failed(mut self, outcome: &'static str) {
        self.failed = true;
        self.abandon_sent();
        self.finish(outcome);
    }

    /// The engine computes nothing of this request (it failed, or was
    /// refused): the replicas stop counting its prefix as sent there.
    fn abandon_sent(&self) {
        if let Some(sent) = &self.sent {
            sent.abandon();
        }
    }
}

/// The `status` label of a request's duration, from its outcome: the
/// upstream's status class, or `error` when the answer did not complete.
fn status_class(outcome: &str) -> &'static str {
    match outcome {
        "ok" => "2xx",
        "upstream_4xx" => "4xx",
        _ => "error",
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.release_prefill();
        if let Some(sent) = &self.sent {
            sent.done(now_ms());
        }
        self.worker.live.record_end(now_ms());
        // Dropped before the stream ended: the client went away.
        let outcome = self.outcome.unwrap_or("client_cancelled");
        self.state.metrics.request(self.worker.id.as_str(), outcome);
        if !self.failed {
            let took = self.arrived.elapsed().as_secs_f64();
            self.state.metrics.request_finished(self.worker.id.as_str(), status_class(outcome), took);
        }
    }
}

/// Holds the concurrency permit until the response body is done.
struct PermitBody {
    inner: Body,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl http_body::Body for PermitBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that leaves while its request waits for a tokenizer (before
    /// a worker is chosen) is recorded: such requests were in no request
    /// metric, and under a saturated pool they are the slowest.
    #[tokio::test]
    async fn a_request_whose_client_leaves_before_dispatch_is_recorded() {
        let raw = crate::config::RawConfig::default().validate().unwrap();
        let state = crate::build_state(raw, tokio_util::sync::CancellationToken::new()).unwrap();
        let busy = state.tokenize_slots.clone().acquire_many_owned(state.tokenize_slots.available_permits() as u32);
        let busy = busy.await.unwrap();
        let waiting = tokio::spawn({
            let state = state.clone();
            async move {
                let body = Body::from(r#"{"model": "m", "prompt": "hello"}"#);
                proxy(&state, Endpoint::Completions, None, &HeaderMap::new(), body, None, Instant::now()).await.is_ok()
            }
        });
        // Read, admitted, and waiting for a tokenizer slot (this runtime
        // runs one task at a time).
        while state.concurrency.available_permits() == state.config.raw.max_concurrent_requests {
            tokio::task::yield_now().await;
        }
        waiting.abort();
        assert!(waiting.await.is_err(), "it was cancelled while it waited");
        drop(busy);
        let gone =
            "kvroute_request_duration_seconds_count{policy=\"predicted_ttft\",worker=\"none\",status=\"error\"} 1";
        assert!(state.metrics.encode().contains(gone), "{}", state.metrics.encode());
    }

    #[test]
    fn events_are_passed_on_whole_and_a_long_one_before_it_ends() {
        let mut held = EventHold::default();
        assert_eq!(held.whole_events(&Bytes::from_static(b"data: 1\r\n")), None);
        assert_eq!(held.whole_events(&Bytes::from_static(b"\r\ndata: 2\n")).as_deref(), Some(&b"data: 1\r\n\r\n"[..]));
        assert_eq!(
            held.whole_events(&Bytes::from_static(b"\ndata: 3\n\ndata")).as_deref(),
            Some(&b"data: 2\n\ndata: 3\n\n"[..])
        );
        assert!(!held.sent_mid_event);
        let long = Bytes::from(vec![b'x'; MAX_HELD_EVENT_BYTES]);
        assert_eq!(held.whole_events(&long).map(|b| b.len()), Some(MAX_HELD_EVENT_BYTES + 4));
        assert!(held.sent_mid_event && held.partial.is_empty());
        assert_eq!(held.whole_events(&Bytes::from_static(b"\n\n")).as_deref(), Some(&b"\n\n"[..]));
        assert!(!held.sent_mid_event);
    }

    #[test]
    fn bytes_outside_long_strings_are_counted_escapes_and_all() {
        let long = "A".repeat(LONG_STRING);
        let body = format!(r#"{{"a": "{long}", "b": [1, 2], "c": "x\"y"}}"#);
        // Everything but the long string and its quotes.
        assert_eq!(outside_long_strings(body.as_bytes()), body.len() - (LONG_STRING + 2));
        // An escaped quote does not end a long string early.
        let escaped = format!(r#"["{}\"{long}"]"#, "B".repeat(10));
        assert_eq!(outside_long_strings(escaped.as_bytes()), 2);
        assert_eq!(outside_long_strings(b"[0,0,0]"), 7);
    }
}
