//! Sending one message to one router: the HTTP implementation, behind a trait
//! so the push loop's timing can be tested without sockets.

use std::fmt;
use std::time::Duration;

use futures::future::BoxFuture;
use kvroute_shared::body::read_within;
use kvroute_shared::wire::{
    EVICTION_PATH, ErrorBody, EvictionBatch, InternalAck, PROTOCOL_HEADER, SYNC_PATH, SyncSnapshot,
};
use serde::Serialize;

use crate::config::Secret;
use crate::state::RouterTarget;

/// Timeout of one eviction batch (a heartbeat at worst: it must not wait
/// behind a slow sync's budget).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// A full sync's timeout: this plus [`SYNC_TIMEOUT_PER_100K`] per 100 k keys.
/// A large sync to a busy router takes longer than a batch, and timing it out
/// only makes the sidecar send it again from the start.
const SYNC_TIMEOUT_BASE: Duration = Duration::from_secs(10);
const SYNC_TIMEOUT_PER_100K: Duration = Duration::from_secs(2);

/// The most of a router's answer that is read: an ack is a few hundred
/// bytes, an error message not much more.
pub const MAX_ANSWER_BYTES: usize = 64 << 10;

/// How long a sync of `keys` keys may take.
pub fn sync_timeout(keys: usize) -> Duration {
    SYNC_TIMEOUT_BASE + SYNC_TIMEOUT_PER_100K.mul_f64(keys as f64 / 100_000.0)
}

/// A push that the router did not accept.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// No connection to the router: nothing was sent.
    #[error("cannot connect to {url}")]
    Unreachable {
        url: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("request to {url} failed")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The router's answer was not an ack: larger than [`MAX_ANSWER_BYTES`]
    /// or not the ack's JSON.
    #[error("{url} answered with no valid ack: {detail}")]
    BadAnswer { url: String, detail: String },
    #[error("{url} answered {status}: {detail}")]
    Status {
        url: String,
        status: u16,
        detail: String,
        /// The field the router named as at fault (its error's `param`).
        param: Option<String>,
    },
}

impl PushError {
    /// The router never saw the request (retrying costs it nothing).
    pub fn nothing_sent(&self) -> bool {
        matches!(self, PushError::Unreachable { .. })
    }

    /// The router refused the message as larger than it takes (413: more
    /// keys than its `max_sync_keys`, or a body past its limit).
    pub fn too_large(&self) -> bool {
        matches!(self, PushError::Status { status: 413, .. })
    }

    /// The router refuses the push for what it is or who sent it (a 4xx:
    /// a block size other than its own, a token it does not take, a field an
    /// older router does not know), which it will until an operator fixes
    /// it; not a timeout (408), rate limit (429) or size (413).
    pub fn refused(&self) -> bool {
        matches!(self, PushError::Status { status, .. } if (400..500).contains(status) && !matches!(status, 408 | 413 | 429))
    }

    /// The router refused a field the sync named (`unknown field
    /// `model_aliases``: a release before it).
    pub fn field_refused(&self, field: &str) -> bool {
        matches!(self, PushError::Status { status: 400, detail, param, .. }
            if detail.contains(field) || param.as_deref().is_some_and(|p| p.contains(field)))
    }

    /// The router refused the protocol version the push named (an older
    /// router: the link falls back to version 1).
    pub fn protocol_refused(&self) -> bool {
        matches!(self, PushError::Status { status: 400, param: Some(p), .. } if p == PROTOCOL_HEADER)
    }
}

/// Delivers the two internal messages to a router, naming `protocol` in the
/// version header, and returns its ack.
pub trait RouterClient: Send + Sync + fmt::Debug {
    fn eviction<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a EvictionBatch,
        protocol: u32,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>>;
    fn sync<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a SyncSnapshot,
        protocol: u32,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>>;
}

/// `POST {router}/internal/{eviction,sync}` with the bearer token.
#[derive(Debug)]
pub struct HttpRouterClient {
    http: reqwest::Client,
    token: Option<Secret>,
}

impl HttpRouterClient {
    pub fn new(http: reqwest::Client, token: Option<Secret>) -> Self {
        HttpRouterClient { http, token }
    }

    async fn post<T: Serialize + Sync>(
        &self,
        target: &RouterTarget,
        path: &str,
        body: &T,
        protocol: u32,
        timeout: Duration,
    ) -> Result<InternalAck, PushError> {
        let url = format!("{}{path}", target.0);
        let mut req = self.http.post(&url).json(body).timeout(timeout).header(PROTOCOL_HEADER, protocol.to_string());
        if let Some(token) = &self.token {
            req = req.bearer_auth(&token.0);
        }
        let http = |source| PushError::Http { url: url.clone(), source };
        let resp = req.send().await.map_err(|e| {
            if e.is_connect() { PushError::Unreachable { url: url.clone(), source: Box::new(e) } } else { http(e) }
        })?;
        let status = resp.status();
        let answer =
            read_within(reqwest::Body::from(resp), MAX_ANSWER_BYTES).await.map_err(http)?.ok_or_else(|| {
                PushError::BadAnswer { url: url.clone(), detail: format!("more than {MAX_ANSWER_BYTES} bytes") }
            })?;
        if !status.is_success() {
            // The router's error names the field and why (an unsupported
            // protocol version, a block-size mismatch, …): keep it for the log.
            let detail = String::from_utf8_lossy(&answer).into_owned();
            let (detail, param) = match serde_json::from_str::<ErrorBody>(&detail) {
                Ok(e) => (e.error.message, e.error.param),
                Err(_) => (detail, None),
            };
            return Err(PushError::Status { url, status: status.as_u16(), detail, param });
        }
        serde_json::from_slice::<InternalAck>(&answer)
            .map_err(|e| PushError::BadAnswer { url, detail: format!("not an ack: {e}") })
    }
}

impl RouterClient for HttpRouterClient {
    fn eviction<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a EvictionBatch,
        protocol: u32,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>> {
        Box::pin(self.post(target, EVICTION_PATH, body, protocol, CALL_TIMEOUT))
    }

    fn sync<'a>(
        &'a self,
        target: &'a RouterTarget,
        body: &'a SyncSnapshot,
        protocol: u32,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>> {
        Box::pin(self.post(target, SYNC_PATH, body, protocol, sync_timeout(body.hashes.len())))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::Router;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;
    use kvroute_shared::WorkerId;
    use kvroute_shared::wire::PROTOCOL_VERSION;

    use super::*;
    use crate::state::RouterTarget;

    /// A router of a newer protocol: it records the version pushes name and
    /// refuses them, as the real router refuses a major it does not speak.
    #[tokio::test]
    async fn pushes_name_their_protocol_and_a_refusal_keeps_the_routers_reason() {
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let s = seen.clone();
        let handler = move |h: HeaderMap| async move {
            let v = h.get(PROTOCOL_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("none").to_owned();
            s.lock().unwrap().push(v);
            let msg = "wire protocol version 2 is not supported: this router speaks version 3";
            (
                StatusCode::BAD_REQUEST,
                axum::Json(
                    serde_json::json!({"error": {"message": msg, "type": "x", "code": 400, "param": PROTOCOL_HEADER}}),
                ),
            )
        };
        let url = serve(Router::new().route(SYNC_PATH, post(handler))).await;
        let client = HttpRouterClient::new(reqwest::Client::new(), None);
        let err = client.sync(&RouterTarget(url), &empty_sync(), PROTOCOL_VERSION).await.unwrap_err();
        assert_eq!(*seen.lock().unwrap(), [PROTOCOL_VERSION.to_string()]);
        assert!(err.to_string().contains("this router speaks version 3"), "{err}");
        assert!(err.protocol_refused(), "the version header was named as the fault: {err:?}");
    }

    /// Whatever answers at a router's address cannot make the sidecar
    /// buffer more than [`MAX_ANSWER_BYTES`], success or error.
    #[tokio::test]
    async fn an_answer_larger_than_an_ack_is_refused_unread() {
        let huge = "x".repeat(4 << 20);
        let (ok, err) = (huge.clone(), huge);
        let app = Router::new()
            .route(SYNC_PATH, post(move || async move { ok }))
            .route(EVICTION_PATH, post(move || async move { (StatusCode::BAD_REQUEST, err) }));
        let url = RouterTarget(serve(app).await);
        let client = HttpRouterClient::new(reqwest::Client::new(), None);
        let e = client.sync(&url, &empty_sync(), PROTOCOL_VERSION).await.unwrap_err();
        assert!(matches!(e, PushError::BadAnswer { .. }), "{e:?}");
        let batch: EvictionBatch = kvroute_shared::wire::decode_valid(br#"{"worker_id":"w1"}"#).unwrap();
        let e = client.eviction(&url, &batch, PROTOCOL_VERSION).await.unwrap_err();
        assert!(matches!(e, PushError::BadAnswer { .. }), "{e:?}");
    }

    async fn serve(app: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn empty_sync() -> SyncSnapshot {
        SyncSnapshot {
            worker_id: WorkerId::new("w1"),
            epoch: None,
            seq: None,
            as_of_ms: None,
            covers: None,
            digest: None,
            url: None,
            dp_rank: None,
            models: Vec::new(),
            model_aliases: Default::default(),
            block_size: None,
            hashes: Vec::new(),
            load: None,
        }
    }
}
