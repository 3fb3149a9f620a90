//! The ZMQ PUB side: numbers each engine step's batch, encodes it, keeps it for
//! replay and sends `[topic, seq (8 bytes BE), payload]`, like vLLM's
//! `ZmqEventPublisher`. Sequence numbers start at 0 with each process.
//!
//! Fault knobs act here: a dropped batch still takes its seq and stays in the
//! replay buffer (a subscriber sees a gap it can repair), a paused publisher
//! holds batches in order until resumed.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, SocketSend, ZmqMessage};

use super::encode::encode_batch;
use super::replay::ReplayBuffer;
use super::{EventBatch, EventFormat, KvEvent};
use crate::faults::Faults;

#[derive(Debug)]
pub struct PublisherParts {
    pub topic: Bytes,
    pub format: EventFormat,
    pub buffer: Arc<ReplayBuffer>,
    pub faults: watch::Receiver<Faults>,
    /// The data-parallel rank the batches name.
    pub rank: u32,
}

/// Publishes batches from the engine until the engine stops or `cancel` fires.
pub async fn run(
    mut socket: PubSocket,
    mut parts: PublisherParts,
    mut batches: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    cancel: CancellationToken,
) {
    let mut seq: u64 = 0;
    loop {
        let events = tokio::select! {
            () = cancel.cancelled() => return,
            b = batches.recv() => match b {
                Some(b) => b,
                None => return,
            },
        };
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let batch = EventBatch { ts, events, data_parallel_rank: parts.rank };
        let payload = match encode_batch(&batch, parts.format) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode an event batch; skipped");
                continue;
            }
        };
        let this_seq = seq;
        seq += 1;
        // Decided before the batch becomes replayable, so whoever sees it in
        // the replay buffer knows its fate is sealed (tests rely on this).
        let drop_fraction = parts.faults.borrow().drop_events;
        let dropped = drop_fraction > 0.0 && rand::thread_rng().r#gen::<f64>() < drop_fraction;
        parts.buffer.push(this_seq, payload.clone());
        while parts.faults.borrow().pause_events {
            tokio::select! {
                () = cancel.cancelled() => return,
                changed = parts.faults.changed() => if changed.is_err() { return },
            }
        }
        if dropped {
            tracing::debug!(seq = this_seq, "fault: event batch dropped");
            continue;
        }
        let mut msg = ZmqMessage::from(parts.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&this_seq.to_be_bytes()));
        msg.push_back(payload);
        if let Err(e) = socket.send(msg).await {
            tracing::warn!(error = %e, seq = this_seq, "event batch not sent");
        }
    }
}
