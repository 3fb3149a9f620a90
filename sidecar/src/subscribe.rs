//! One data-parallel rank's event stream: ZMQ SUB, decoding, sequence checks,
//! and recovery of gaps through replay.
//!
//! - seq == expected: apply.
//! - seq > expected (a gap, or the first batch after the sidecar started late):
//!   replay from `expected` while buffering live batches, then apply the replay
//!   and the buffered batches in order. If the engine's replay buffer no longer
//!   holds the gap, or replay fails, the rank is cleared and every router gets a
//!   full sync under a new epoch: missed evictions would otherwise leave keys the
//!   engine no longer has.
//! - seq < expected: the engine restarted (its seq starts again from 0): clear
//!   and resync the same way, then apply.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::decode::{EventBatch, Seq, decode_message};
use crate::metrics::{ReplayLabels, ReplayOutcome};
use crate::replay;
use crate::state::WorkerState;
use crate::translate::Rank;

/// Live batches held while a replay runs; past this the gap is given up.
const MAX_BUFFERED: usize = 100_000;
/// Bound on a whole replay exchange.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Where one rank's events come from.
#[derive(Clone, Debug)]
pub struct RankSource {
    pub rank: Rank,
    pub events: String,
    pub replay: Option<String>,
    pub topic: String,
}

/// Subscribes and applies until cancelled. Connection failures are retried by
/// the ZMQ socket itself.
pub async fn run(source: RankSource, state: Arc<WorkerState>, cancel: CancellationToken) {
    let mut socket = SubSocket::new();
    let connect = async {
        let mut backoff = Duration::from_millis(100);
        loop {
            match socket.connect(&source.events).await {
                Ok(()) => return,
                Err(e) => {
                    warn!(endpoint = %source.events, error = %e, "cannot connect to the engine's event publisher");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    };
    tokio::select! {
        _ = cancel.cancelled() => return,
        () = connect => {}
    }
    if let Err(e) = socket.subscribe(&source.topic).await {
        warn!(error = %e, "cannot subscribe");
        return;
    }
    info!(endpoint = %source.events, rank = source.rank.0, "subscribed to KV events");
    let mut stream = Stream { source, state, socket, expected: None };
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            next = stream.recv() => next,
        };
        match next {
            Some((seq, batch)) => stream.on_batch(seq, batch).await,
            None => return,
        }
    }
}

struct Stream {
    source: RankSource,
    state: Arc<WorkerState>,
    socket: SubSocket,
    expected: Option<Seq>,
}

impl Stream {
    /// The next decodable batch (`None` when the socket is closed).
    async fn recv(&mut self) -> Option<(Seq, EventBatch)> {
        loop {
            let msg = match self.socket.recv().await {
                Ok(m) => m,
                Err(e) => {
                    warn!(error = %e, "event socket closed");
                    return None;
                }
            };
            match decode_message(&msg.into_vec()) {
                Ok(b) => return Some(b),
                Err(e) => {
                    self.state.metrics().decode_errors.inc();
                    warn!(error = %e, "undecodable KV-event message");
                }
            }
        }
    }

    fn apply(&mut self, seq: Seq, batch: &EventBatch) {
        self.state.apply(self.source.rank, batch);
        self.expected = Some(Seq(seq.0 + 1));
    }

    async fn on_batch(&mut self, seq: Seq, batch: EventBatch) {
        let metrics = self.state.metrics();
        match self.expected {
            Some(expected) if seq == expected => self.apply(seq, &batch),
            Some(expected) if seq < expected => {
                metrics.engine_restarts.inc();
                warn!(rank = self.source.rank.0, seq = seq.0, expected = expected.0, "engine restarted: resync");
                self.state.reset(self.source.rank);
                self.apply(seq, &batch);
            }
            // The engine started before us with nothing cached yet.
            None if seq.0 == 0 => self.apply(seq, &batch),
            expected => {
                metrics.gaps.inc();
                self.recover(expected.unwrap_or(Seq(0)), seq, batch).await;
            }
        }
    }

    /// Replays `[from, seq)` while buffering live batches, then applies in order.
    async fn recover(&mut self, from: Seq, seq: Seq, batch: EventBatch) {
        let rank = self.source.rank;
        let mut buffered = vec![(seq, batch)];
        let replayed = match self.source.replay.clone() {
            None => None,
            Some(endpoint) => {
                let fetch = replay::fetch(&endpoint, from, REPLAY_TIMEOUT);
                tokio::pin!(fetch);
                loop {
                    tokio::select! {
                        r = &mut fetch => break Some(r),
                        live = self.recv() => match live {
                            Some(b) if buffered.len() < MAX_BUFFERED => buffered.push(b),
                            _ => break None,
                        },
                    }
                }
            }
        };
        let outcome = match replayed {
            Some(Ok(replayed)) if replayed.first().is_some_and(|(s, _)| *s == from) => {
                let mut merged: Vec<&(Seq, EventBatch)> = replayed.iter().chain(buffered.iter()).collect();
                merged.sort_by_key(|(s, _)| *s);
                // Batches both replayed and received live appear twice.
                merged.dedup_by_key(|(s, _)| *s);
                if merged.windows(2).all(|w| w[1].0.0 == w[0].0.0 + 1) {
                    for (s, b) in merged {
                        self.state.apply(rank, b);
                        self.expected = Some(Seq(s.0 + 1));
                    }
                    ReplayOutcome::Recovered
                } else {
                    ReplayOutcome::Lost
                }
            }
            Some(Ok(_)) => ReplayOutcome::Lost,
            Some(Err(e)) => {
                warn!(rank = rank.0, error = %e, "replay failed");
                ReplayOutcome::Failed
            }
            None => ReplayOutcome::Failed,
        };
        self.state.metrics().replays.get_or_create(&ReplayLabels { outcome: outcome.as_str() }).inc();
        if outcome == ReplayOutcome::Recovered {
            return;
        }
        warn!(rank = rank.0, from = from.0, "events lost beyond replay: clearing and resyncing");
        self.state.reset(rank);
        // Apply what the live stream brought: stores of new prefixes key fine,
        // stores chained to forgotten blocks are counted as unanchored.
        for (s, b) in &buffered {
            self.state.apply(rank, b);
            self.expected = Some(Seq(s.0 + 1));
        }
    }
}
