//! Fetching missed batches from vLLM's replay endpoint (a ZMQ ROUTER).
//!
//! A DEALER sends `["", start_seq as 8 bytes BE]` and receives every buffered
//! batch with seq ≥ start, then an end marker with seq = -1. After the empty
//! delimiter, replies are `[topic, seq, payload]` (current vLLM) or
//! `[seq, payload]` (older vLLM); both are accepted.

use std::time::Duration;

use bytes::Bytes;

use crate::decode::{DecodeError, EventBatch, Seq, decode_payload, parse_seq};
use crate::zmtp::{Connection, SocketType, ZmtpError};

/// The end-of-replay marker's seq (-1 as 8 bytes BE).
const END: Seq = Seq(u64::MAX);

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay endpoint {endpoint} failed")]
    Zmq {
        endpoint: String,
        #[source]
        source: ZmtpError,
    },
    #[error("replay from {endpoint} timed out")]
    Timeout { endpoint: String },
    #[error("replay reply has {0} frames after the delimiter, expected 2 or 3")]
    Frames(usize),
    #[error("undecodable replayed batch")]
    Decode(#[from] DecodeError),
    #[error("the replay from {endpoint} exceeds {MAX_REPLAY_BYTES} bytes")]
    TooLarge { endpoint: String },
}

/// The most one replay may bring, in bytes on the wire (vLLM's buffer holds
/// its last 10,000 steps, mostly small): past it the replay fails, and the
/// rank is cleared and resynced as for any failed replay.
pub const MAX_REPLAY_BYTES: usize = 256 << 20;

/// One reply message, delimiter already stripped: `Some((seq, payload))`, or
/// `None` for the end marker.
pub fn parse_reply(frames: &[Bytes]) -> Result<Option<(Seq, &[u8])>, ReplayError> {
    let frames = match frames.first() {
        Some(f) if f.is_empty() => &frames[1..],
        _ => frames,
    };
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (parse_seq(seq)?, payload),
        other => return Err(ReplayError::Frames(other.len())),
    };
    Ok((seq != END).then_some((seq, payload.as_ref())))
}

/// The request frames for a replay from `start`.
pub fn request(start: Seq) -> Vec<Bytes> {
    vec![Bytes::new(), Bytes::copy_from_slice(&start.0.to_be_bytes())]
}

/// Replays from `start`, with the whole exchange bounded by `timeout`.
pub async fn fetch(endpoint: &str, start: Seq, timeout: Duration) -> Result<Vec<(Seq, EventBatch)>, ReplayError> {
    let zmq = |source| ReplayError::Zmq { endpoint: endpoint.to_owned(), source };
    let exchange = async {
        let mut conn = Connection::open(endpoint, SocketType::Dealer).await.map_err(zmq)?;
        let frames = request(start);
        conn.send(&[&frames[0], &frames[1]]).await.map_err(zmq)?;
        let mut out = Vec::new();
        let mut bytes = 0;
        loop {
            let frames = conn.recv().await.map_err(zmq)?;
            bytes += frames.iter().map(Bytes::len).sum::<usize>();
            if bytes > MAX_REPLAY_BYTES {
                return Err(ReplayError::TooLarge { endpoint: endpoint.to_owned() });
            }
            match parse_reply(&frames)? {
                None => return Ok(out),
                Some((seq, payload)) => out.push((seq, decode_payload(payload)?)),
            }
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(ReplayError::Timeout { endpoint: endpoint.to_owned() }))
}
