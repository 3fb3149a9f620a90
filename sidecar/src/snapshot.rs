//! Client of the `kvroute_hooks` vLLM plugin (python-hooks/): asks the engine
//! which blocks its prefix cache holds right now, for anti-entropy from the
//! source of truth (vLLM itself has no such API).
//!
//! Protocol (ZMQ REQ → REP, msgpack): request `{"op": "snapshot"}`; reply
//! `{"ok": true, "hashes": [hash, …], "events_port": p}` where each hash is
//! converted exactly as vLLM converts hashes for KV events (u64, or bytes)
//! and `events_port` (when the plugin knows it) is the port that engine rank
//! publishes its events on, or `{"ok": false, "error": "…"}`.

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
    #[error("the engine hook reported an error: {0}")]
    Hook(String),
    #[error(
        "the snapshot endpoint answers for the engine publishing events on port {theirs}, not this rank's \
         {ours}: another engine's plugin (engines sharing a host each need their own KVROUTE_SNAPSHOT_ENDPOINT, \
         and the sidecar its --engine-snapshot), or the events port is remapped between engine and sidecar \
         (the check needs the engine's own port numbers in --events); no block is dropped"
    )]
    OtherEngine { theirs: u64, ours: u32 },
}

/// The request body: msgpack `{"op": "snapshot"}`.
pub fn request_body() -> Bytes {
    let mut buf = Vec::new();
    let value = rmpv::Value::Map(vec![(rmpv::Value::from("op"), rmpv::Value::from("snapshot"))]);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, &value);
    Bytes::from(buf)
}

/// Decodes a reply into the set of engine hash ids held. `events_port`: the
/// port this rank's events come from; a reply naming another is refused
/// (dropping another engine's missing blocks here emptied this one's).
pub fn parse_reply(mut body: &[u8], events_port: Option<u32>) -> Result<HashSet<u64>, SnapshotError> {
    let root = rmpv::decode::read_value_ref(&mut body).map_err(|_| SnapshotError::Malformed("not msgpack"))?;
    let ValueRef::Map(fields) = root else {
        return Err(SnapshotError::Malformed("not a map"));
    };
    let field = |name: &str| {
        fields.iter().find_map(|(k, v)| matches!(k, ValueRef::String(s) if s.as_str() == Some(name)).then_some(v))
    };
    if !matches!(field("ok"), Some(ValueRef::Boolean(true))) {
        // The hook's reason (bounded: it goes into a log line).
        let reason = match field("error") {
            Some(ValueRef::String(s)) => s.as_str().unwrap_or("not UTF-8").chars().take(200).collect(),
            _ => "no reason given".to_owned(),
        };
        return Err(SnapshotError::Hook(reason));
    }
    if let (Some(ValueRef::Integer(theirs)), Some(ours)) = (field("events_port"), events_port)
        && theirs.as_u64() != Some(u64::from(ours))
    {
        return Err(SnapshotError::OtherEngine { theirs: theirs.as_u64().unwrap_or(0), ours });
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

/// Asks the hook at `endpoint` for the engine's current block hashes (of
/// the engine rank whose events come from `events_port`).
pub async fn fetch(endpoint: &str, events_port: Option<u32>) -> Result<HashSet<u64>, SnapshotError> {
    let zmq = |source| SnapshotError::Zmq { endpoint: endpoint.to_owned(), source };
    let exchange = async {
        // A fresh connection per exchange: a REQ whose reply never came is stuck.
        let mut conn = Connection::open(endpoint, SocketType::Req).await.map_err(zmq)?;
        // REQ's envelope: an empty delimiter frame before the body, both ways.
        conn.send(&[b"", &request_body()]).await.map_err(zmq)?;
        let reply = conn.recv().await.map_err(zmq)?;
        match reply.as_slice() {
            [delimiter, body] if delimiter.is_empty() => parse_reply(body, events_port),
            _ => Err(SnapshotError::Malformed("not an empty delimiter and one body frame")),
        }
    };
    tokio::time::timeout(SNAPSHOT_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(SnapshotError::Timeout { endpoint: endpoint.to_owned() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(value: rmpv::Value) -> Vec<u8> {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &value).unwrap();
        buf
    }

    #[test]
    fn a_hook_error_carries_its_reason_into_the_log() {
        let reply = rmpv::Value::Map(vec![
            (rmpv::Value::from("ok"), rmpv::Value::Boolean(false)),
            (rmpv::Value::from("error"), rmpv::Value::from("CacheUnavailable: no GPU block pool is tracked")),
        ]);
        let e = parse_reply(&encode(reply), None).unwrap_err();
        assert_eq!(e.to_string(), "the engine hook reported an error: CacheUnavailable: no GPU block pool is tracked");
        let bare = rmpv::Value::Map(vec![(rmpv::Value::from("ok"), rmpv::Value::Boolean(false))]);
        assert!(parse_reply(&encode(bare), None).unwrap_err().to_string().ends_with("no reason given"));
    }

    /// Engines sharing a host and the plugin's default endpoint: the one
    /// that bound it answers every sidecar. A reply naming another events
    /// port is refused (its blocks are not this engine's); one naming none
    /// (an older plugin) is taken.
    #[test]
    fn a_snapshot_of_another_engine_is_refused() {
        let reply = |port: Option<u64>| {
            let mut fields = vec![
                (rmpv::Value::from("ok"), rmpv::Value::Boolean(true)),
                (rmpv::Value::from("hashes"), rmpv::Value::Array(vec![rmpv::Value::from(7u64)])),
            ];
            if let Some(p) = port {
                fields.push((rmpv::Value::from("events_port"), rmpv::Value::from(p)));
            }
            encode(rmpv::Value::Map(fields))
        };
        assert_eq!(parse_reply(&reply(Some(5557)), Some(5557)).unwrap(), HashSet::from([7]));
        let e = parse_reply(&reply(Some(5567)), Some(5557)).unwrap_err();
        assert!(matches!(e, SnapshotError::OtherEngine { theirs: 5567, ours: 5557 }), "{e}");
        assert_eq!(parse_reply(&reply(None), Some(5557)).unwrap(), HashSet::from([7]));
        assert_eq!(parse_reply(&reply(Some(5567)), None).unwrap(), HashSet::from([7]));
    }
}
