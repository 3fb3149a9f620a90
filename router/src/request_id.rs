//! Every client request gets an `x-request-id`: the client's header when
//! it sent a usable one, else the body's `request_id` (vLLM's extension,
//! which the engine takes when no header names one), else one the router
//! makes. The engine gets it (vLLM takes the header as its request id, so
//! its log lines name it), the router's log of a failed attempt names it,
//! and the client gets it back on the answer, errors included. A request
//! that came without one could not be found in the engine's log, nor tied
//! to the router's. (A body `request_id` no header can carry is left to the
//! engine: no header is sent or answered.)
//!
//! The sidecars' pushes, the replicas' reports, the probes and `/metrics`
//! get none: nothing is forwarded or logged per request there.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use parking_lot::Mutex;

pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client id kept, as forwarded (see `proxy::FORWARDED`): vLLM
/// repeats the id in every streamed chunk, so a long one multiplies.
pub const MAX_LEN: usize = 256;

/// Paths that get no id: what is not a client's request.
fn exempt(path: &str) -> bool {
    path.starts_with("/internal/") || matches!(path, "/health" | "/ready" | "/metrics")
}

/// A client's id is kept when it is at most [`MAX_LEN`] bytes of visible
/// ASCII (the characters a log line and vLLM's id can hold as they are);
/// anything else is replaced, and the client learns the new one from the
/// answer.
fn usable(v: &HeaderValue) -> bool {
    !v.is_empty() && v.len() <= MAX_LEN && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
}

/// A new id: 32 hexadecimal digits of randomness, the shape of vLLM's own.
pub fn generate() -> HeaderValue {
    let id = format!("{:032x}", rand::random::<u128>());
    HeaderValue::from_str(&id).expect("hex digits are a valid header value")
}

/// A request's id, as the middleware chose it (a request extension): one it
/// made gives way to the body's `request_id` once the body is read.
#[derive(Clone, Debug)]
pub struct RequestId {
    /// `None`: the body's id, which no header can carry.
    id: Arc<Mutex<Option<HeaderValue>>>,
    made: bool,
}

impl RequestId {
    /// The client named no usable id in a header and the body names a
    /// `request_id`: the body's becomes the request's id, in `headers`
    /// (what the engine and the log get) and on the answer. One no header
    /// can carry (a space, non-ASCII, over [`MAX_LEN`] bytes) is left to
    /// the engine, which takes the body's when no header names one: the
    /// router sends and answers none.
    pub fn adopt(&self, body_id: &str, headers: &mut HeaderMap) {
        if !self.made || body_id.is_empty() {
            return;
        }
        match HeaderValue::from_str(body_id).ok().filter(usable) {
            Some(v) => {
                *self.id.lock() = Some(v.clone());
                headers.insert(HEADER, v);
            }
            None => {
                *self.id.lock() = None;
                headers.remove(HEADER);
            }
        }
    }
}

/// The middleware: ensures the request's id, and puts it on the answer
/// unless the engine's answer already carries one (vLLM's
/// `--enable-request-id-headers` echoes the same id).
pub async fn ensure(mut req: Request, next: Next) -> Response {
    if exempt(req.uri().path()) {
        return next.run(req).await;
    }
    let (id, made) = match req.headers().get(&HEADER) {
        Some(v) if usable(v) => (v.clone(), false),
        _ => (generate(), true),
    };
    req.headers_mut().insert(HEADER, id.clone());
    let chosen = RequestId { id: Arc::new(Mutex::new(Some(id))), made };
    req.extensions_mut().insert(chosen.clone());
    let mut res = next.run(req).await;
    if let Some(id) = chosen.id.lock().clone() {
        res.headers_mut().entry(HEADER).or_insert(id);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_id_is_kept_when_short_and_printable() {
        assert!(usable(&HeaderValue::from_static("req-42_abc.DEF:1")));
        assert!(!usable(&HeaderValue::from_static("")));
        assert!(!usable(&HeaderValue::from_static("has space")));
        assert!(!usable(&HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()));
        assert!(usable(&HeaderValue::from_str(&"a".repeat(MAX_LEN)).unwrap()));
        assert!(!usable(&HeaderValue::from_str(&"a".repeat(MAX_LEN + 1)).unwrap()));
    }

    #[test]
    fn generated_ids_are_32_hex_digits_and_differ() {
        let (a, b) = (generate(), generate());
        assert_eq!(a.len(), 32);
        assert!(a.to_str().unwrap().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn probes_and_internal_pushes_get_none() {
        for path in ["/internal/eviction", "/internal/sync", "/internal/replica", "/health", "/ready", "/metrics"] {
            assert!(exempt(path), "{path}");
        }
        for path in ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/debug/route"] {
            assert!(!exempt(path), "{path}");
        }
    }
}
