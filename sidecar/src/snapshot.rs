//! Client of the `kvroute_hooks` vLLM plugin (python-hooks/): asks the engine
//! which blocks its prefix cache holds right now, for anti-entropy from the
//! source of truth (vLLM itself has no such API).
//!
//! Protocol (ZMQ REQ → REP, msgpack): request `{"op": "snapshot"}`; reply
//! `{"ok": true, "hashes": [hash, …]}` where each hash is converted exactly as
//! vLLM converts hashes for KV events (u64, or bytes), or
//! `{"ok": false, "error": "…"}`.

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use rmpv::ValueRef;

use crate::decode::EngineHash;
use crate::zmtp::{Connection, SocketType, ZmtpError};

/// Bound on one snapshot exchange.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a snapshot could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot endpoint {endpoint} failed")]
    Zmq {
        endpoint: String,
        #[source]
        source: ZmtpError,
    },
    #[error("snapshot from {endpoint} timed out")]
    Timeout { endpoint: String },
    #[error("snapshot reply is malformed: {0}")]
    Malformed(&'static str),
    #[error("the engine hook reported an error")]
    Hook,
}

/// The request body: msgpack `{"op": "snapshot"}`.
pub fn request_body() -> Bytes {
    let mut buf = Vec::new();
    let value = rmpv::Value::Map(vec![(rmpv::Value::from("op"), rmpv::Value::from("snapshot"))]);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, &value);
    Bytes::from(buf)
}

/// Decodes a reply into the set of engine hash ids held.
pub fn parse_reply(mut body: &[u8]) -> Result<HashSet<u64>, SnapshotError> {
    let root = rmpv::decode::read_value_ref(&mut body).map_err(|_| SnapshotError::Malformed("not msgpack"))?;
    let ValueRef::Map(fields) = root else {
        return Err(SnapshotError::Malformed("not a map"));
    };
    let field = |name: &str| {
        fields.iter().find_map(|(k, v)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)).then_some(v))
    };
    if !matches!(field("ok"), Some(ValueRef::Boolean(true))) {
        return Err(SnapshotError::Hook);
    }
    let Some(ValueRef::Array(hashes)) = field("hashes") else {
        return Err(SnapshotError::Malformed("no hashes array"));
    };
    hashes
        .iter()
        .map(|h| match h {
            ValueRef::Integer(n) => {
                n.as_u64().or_else(|| n.as_i64().map(|i| i as u64)).ok_or(SnapshotError::Malformed("hash out of range"))
            }
            ValueRef::Binary(b) => Ok(EngineHash::Bytes((*b).into()).id()),
            _ => Err(SnapshotError::Malformed("a hash is neither an integer nor bytes")),
        })
        .collect()
}

/// Asks the hook at `endpoint` for the engine's current block hashes.
pub async fn fetch(endpoint: &str) -> Result<HashSet<u64>, SnapshotError> {
    let zmq = |source| SnapshotError::Zmq { endpoint: endpoint.to_owned(), source };
    let exchange = async {
        // A fresh connection per exchange: a REQ whose reply never came is stuck.
        let mut conn = Connection::open(endpoint, SocketType::Req).await.map_err(zmq)?;
        // REQ's envelope: an empty delimiter frame before the body, both ways.
        conn.send(&[b"", &request_body()]).await.map_err(zmq)?;
        let reply = conn.recv().await.map_err(zmq)?;
        match reply.as_slice() {
            [delimiter, body] if delimiter.is_empty() => parse_reply(body),
            _ => Err(SnapshotError::Malformed("not an empty delimiter and one body frame")),
        }
    };
    tokio::time::timeout(SNAPSHOT_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(SnapshotError::Timeout { endpoint: endpoint.to_owned() }))
}
