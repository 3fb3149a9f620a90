//! Fetching missed batches from vLLM's replay endpoint (a ZMQ ROUTER).
//!
//! A DEALER sends `["", start_seq as 8 bytes BE]` and receives every buffered
//! batch with seq ≥ start, then an end marker with seq = -1. After the empty
//! delimiter, replies are `[topic, seq, payload]` (current vLLM) or
//! `[seq, payload]` (older vLLM); both are accepted.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tracing::warn;

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
    #[error("undecodable replay frame")]
    Decode(#[from] DecodeError),
}

/// The most of a replay kept, in bytes on the wire: its newest batches.
/// vLLM's buffer holds its last 10,000 steps, and with long prompts (8k
/// tokens, ~30 kB a batch) that is past 256 MiB: the whole replay failed,
/// and a sidecar started beside a busy engine kept nothing of it. Older
/// batches are dropped as newer ones come: what is kept no longer reaches
/// back to where the replay began, and is applied as a buffer that does
/// not (`subscribe::Stream::recover`).
pub const MAX_REPLAY_BYTES: usize = 128 << 20;

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
///
/// What can be used of it: its newest [`MAX_REPLAY_BYTES`], and, past a
/// batch that does not decode (a field a newer vLLM sends otherwise), only
/// what follows it (nothing before a hole chains through it). Both were
/// the whole replay's failure, and the rank kept nothing.
pub async fn fetch(endpoint: &str, start: Seq, timeout: Duration) -> Result<Vec<(Seq, EventBatch)>, ReplayError> {
    fetch_within(endpoint, start, timeout, MAX_REPLAY_BYTES).await
}

/// [`fetch`], keeping at most `max_bytes` of it.
pub async fn fetch_within(
    endpoint: &str,
    start: Seq,
    timeout: Duration,
    max_bytes: usize,
) -> Result<Vec<(Seq, EventBatch)>, ReplayError> {
    let zmq = |source| ReplayError::Zmq { endpoint: endpoint.to_owned(), source };
    let exchange = async {
        let mut conn = Connection::open(endpoint, SocketType::Dealer).await.map_err(zmq)?;
        let frames = request(start);
        conn.send(&[&frames[0], &frames[1]]).await.map_err(zmq)?;
        let mut kept: VecDeque<(Seq, EventBatch, usize)> = VecDeque::new();
        let (mut bytes, mut dropped, mut undecodable) = (0usize, 0usize, 0usize);
        loop {
            let frames = conn.recv().await.map_err(zmq)?;
            let size = frames.iter().map(Bytes::len).sum::<usize>();
            let Some((seq, payload)) = parse_reply(&frames)? else { break };
            match decode_payload(payload) {
                Ok(batch) => {
                    kept.push_back((seq, batch, size));
                    bytes += size;
                }
                Err(_) => {
                    undecodable += 1;
                    dropped += kept.len();
                    (kept, bytes) = (VecDeque::new(), 0);
                }
            }
            while bytes > max_bytes {
                let Some((_, _, n)) = kept.pop_front() else { break };
                bytes -= n;
                dropped += 1;
            }
        }
        if dropped > 0 || undecodable > 0 {
            warn!(
                endpoint,
                kept = kept.len(),
                dropped,
                undecodable,
                max_bytes,
                "kept the replay's newest batches only (past max_bytes, or after a batch that does not decode)"
            );
        }
        Ok(kept.into_iter().map(|(s, b, _)| (s, b)).collect())
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(ReplayError::Timeout { endpoint: endpoint.to_owned() }))
}
