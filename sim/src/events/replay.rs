//! vLLM's event replay: a buffer of the last N published batches and a ZMQ
//! ROUTER socket that resends them on request.
//!
//! Protocol (checked against `testdata/vllm-events/*.replay-from-5.json`): a
//! DEALER sends `["", start_seq as 8 bytes BE]`; the ROUTER answers with one
//! message per buffered batch with `seq ≥ start`, `["", topic, seq, payload]`
//! (current vLLM) or `["", seq, payload]` (0.11), then the end marker with
//! `seq = -1`: `["", "", ff×8, ""]` (current) or `["", ff×8, ""]` (0.11).

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use super::EventFormat;

/// The last `capacity` published batches, shared by publisher and replayer.
#[derive(Debug)]
pub struct ReplayBuffer {
    capacity: usize,
    batches: Mutex<VecDeque<(u64, Bytes)>>,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> Self {
        ReplayBuffer { capacity, batches: Mutex::new(VecDeque::with_capacity(capacity.min(1024))) }
    }

    pub fn push(&self, seq: u64, payload: Bytes) {
        let mut b = self.batches.lock();
        if b.len() == self.capacity {
            b.pop_front();
        }
        b.push_back((seq, payload));
    }

    /// Batches with `seq ≥ start`, oldest first.
    pub fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        self.batches.lock().iter().filter(|(s, _)| *s >= start).cloned().collect()
    }
}

/// The frames (after the peer identity) answering a replay request.
pub fn reply_messages(buffer: &ReplayBuffer, start: u64, topic: &Bytes, format: EventFormat) -> Vec<Vec<Bytes>> {
    let empty = Bytes::new();
    let mut out: Vec<Vec<Bytes>> = buffer
        .since(start)
        .into_iter()
        .map(|(seq, payload)| {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            match format {
                EventFormat::Current => vec![empty.clone(), topic.clone(), seq, payload],
                EventFormat::Legacy => vec![empty.clone(), seq, payload],
            }
        })
        .collect();
    let end = Bytes::copy_from_slice(&(-1i64).to_be_bytes());
    out.push(match format {
        EventFormat::Current => vec![empty.clone(), empty.clone(), end, empty],
        EventFormat::Legacy => vec![empty.clone(), end, empty],
    });
    out
}

/// The start seq of a request `[identity, "", start]` (the delimiter is
/// optional, as a bare `[identity, start]` from a non-DEALER peer is harmless).
fn start_seq(msg: &ZmqMessage) -> Option<u64> {
    let last = msg.get(msg.len().checked_sub(1)?)?;
    let bytes: [u8; 8] = last.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// Serves replay requests until cancelled.
pub async fn serve(
    mut socket: RouterSocket,
    buffer: Arc<ReplayBuffer>,
    topic: Bytes,
    format: EventFormat,
    cancel: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => return,
            msg = socket.recv() => msg,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "replay socket receive failed");
                continue;
            }
        };
        let (Some(identity), Some(start)) = (msg.get(0).cloned(), start_seq(&msg)) else {
            tracing::warn!(frames = msg.len(), "malformed replay request ignored");
            continue;
        };
        for frames in reply_messages(&buffer, start, &topic, format) {
            let mut reply = ZmqMessage::from(identity.clone());
            for f in frames {
                reply.push_back(f);
            }
            if let Err(e) = socket.send(reply).await {
                tracing::warn!(error = %e, "replay send failed; peer gone");
                break;
            }
        }
    }
}
