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
//! - the stream is lost (engine gone): clear and resync at once, and treat the
//!   first batch after the reconnect as a fresh start (see `Stream::recv`).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

use crate::decode::{EventBatch, Seq, decode_message};
use crate::metrics::{ReplayLabels, ReplayOutcome};
use crate::replay;
use crate::state::WorkerState;
use crate::translate::Rank;

/// Live batches held while a replay runs; past this the gap is given up.
const MAX_BUFFERED: usize = 100_000;
/// Bound on a whole replay exchange.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// After this long without a batch, ask the replay endpoint whether batches
/// after the last one were published: a lost *last* batch shows no gap until
/// the next one arrives, which may be never.
const IDLE_PROBE: Duration = Duration::from_secs(1);

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
    if source.replay.is_none() {
        // Nothing the engine published before this start can be read.
        state.mark_caught_up();
    }
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
    let monitor = Some(socket.monitor());
    let mut stream = Stream { source, state, socket, monitor, expected: None, replayed_through: None, lost: false };
    // A sidecar (re)starting beside a running engine: rebuild what the engine
    // already cached from its replay buffer now, not at the next live batch.
    if stream.source.replay.is_some() {
        stream.recover(Seq(0), None).await;
        stream.state.mark_caught_up();
    }
    let mut probe = tokio::time::interval(IDLE_PROBE);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_batch = tokio::time::Instant::now();
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            next = stream.next() => next,
            _ = probe.tick() => {
                if last_batch.elapsed() >= IDLE_PROBE {
                    stream.probe().await;
                }
                continue;
            }
        };
        last_batch = tokio::time::Instant::now();
        match next {
            Next::Batch(seq, batch) => stream.on_batch(seq, batch).await,
            // Back after a loss: rebuild from the engine's replay buffer now,
            // not when (if ever) the next live batch shows a gap.
            Next::Reconnected => stream.recover(Seq(0), None).await,
        }
    }
}

struct Stream {
    source: RankSource,
    state: Arc<WorkerState>,
    socket: SubSocket,
    /// The socket's connection events: a `Disconnected` means the engine went
    /// away (the socket reconnects by itself without failing `recv`).
    /// `None` once the socket dropped its end.
    monitor: Option<futures::channel::mpsc::Receiver<SocketEvent>>,
    expected: Option<Seq>,
    /// The last seq a replay applied: live copies of replayed batches that
    /// were still queued in the socket are skipped, not taken for a restart.
    replayed_through: Option<Seq>,
    /// The stream was lost and has not reconnected yet.
    lost: bool,
}

/// What the event socket produced.
enum Next {
    Batch(Seq, EventBatch),
    /// The socket reconnected after the stream was lost.
    Reconnected,
}

impl Stream {
    /// The next decodable batch. Never gives up: when the engine goes away
    /// (restart, crash), the socket reconnects in the background and
    /// re-subscribes, and the stream resumes.
    ///
    /// A lost stream means the engine's state is unknown: it may have
    /// restarted empty, and batches published before the socket is back are
    /// lost to it (ZMQ's slow joiner). So the rank is cleared at once — the
    /// routers drop its keys under a new epoch rather than route to blocks
    /// that may be gone — and `expected` is forgotten: the first batch after
    /// the reconnect is seq 0 (a fresh engine) or a gap that is replayed from
    /// 0, which rebuilds the state exactly while the engine's buffer holds it.
    async fn next(&mut self) -> Next {
        let mut backoff = Duration::from_millis(50);
        loop {
            let monitor = async {
                match &mut self.monitor {
                    Some(m) => m.next().await,
                    None => std::future::pending().await,
                }
            };
            let received = tokio::select! {
                r = self.socket.recv() => r,
                event = monitor => {
                    match event {
                        Some(SocketEvent::Disconnected(_)) => self.stream_lost("peer disconnected"),
                        Some(SocketEvent::Connected(..)) if self.lost => {
                            self.lost = false;
                            return Next::Reconnected;
                        }
                        Some(_) => {}
                        None => self.monitor = None,
                    }
                    continue;
                }
            };
            let msg = match received {
                Ok(m) => {
                    backoff = Duration::from_millis(50);
                    m
                }
                Err(e) => {
                    self.stream_lost(&e.to_string());
                    // Until the socket's reconnect task is done, recv fails
                    // fast: pace the retries.
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            match decode_message(&msg.into_vec()) {
                Ok((seq, batch)) => return Next::Batch(seq, batch),
                Err(e) => {
                    self.state.metrics().decode_errors.inc();
                    warn!(error = %e, "undecodable KV-event message");
                }
            }
        }
    }

    /// Fetches what was published after `expected`, if anything, and applies
    /// it as if it had arrived live (a gap in it is recovered as usual).
    async fn probe(&mut self) {
        let (Some(expected), Some(endpoint)) = (self.expected, self.source.replay.clone()) else { return };
        match replay::fetch(&endpoint, expected, REPLAY_TIMEOUT).await {
            Ok(missed) => {
                if !missed.is_empty() {
                    warn!(
                        rank = self.source.rank.0,
                        from = expected.0,
                        n = missed.len(),
                        "recovered batches the live stream lost"
                    );
                    self.state.metrics().replays.get_or_create(&ReplayLabels { outcome: "idle_probe" }).inc();
                }
                let mut last = None;
                for (seq, batch) in missed {
                    if self.expected.is_some_and(|e| seq < e) {
                        continue; // arrived live meanwhile
                    }
                    Box::pin(self.on_batch(seq, batch)).await;
                    last = Some(seq);
                }
                // Their live copies may still be queued in the socket: those
                // are duplicates, not an engine that restarted.
                if let Some(last) = last {
                    self.replayed_through = Some(last);
                }
            }
            Err(e) => tracing::debug!(error = %e, "idle replay probe failed"),
        }
    }

    fn stream_lost(&mut self, why: &str) {
        self.lost = true;
        if self.expected.is_none() && self.state.metrics().tracked_blocks.get() == 0 {
            return; // nothing known that could be stale
        }
        self.state.metrics().disconnects.inc();
        warn!(endpoint = %self.source.events, why, "engine event stream lost: clearing until it is back");
        self.state.reset(self.source.rank);
        self.expected = None;
    }

    fn apply(&mut self, seq: Seq, batch: &EventBatch) {
        self.state.apply(self.source.rank, batch);
        self.expected = Some(Seq(seq.0.wrapping_add(1)));
        // A new live batch: copies of replayed ones are behind us, so an older
        // seq from now on means a restart again.
        self.replayed_through = None;
    }

    async fn on_batch(&mut self, seq: Seq, batch: EventBatch) {
        let metrics = self.state.metrics();
        match self.expected {
            Some(expected) if seq == expected => self.apply(seq, &batch),
            Some(_) if self.replayed_through.is_some_and(|r| seq <= r) => {} // already replayed
            Some(expected) if seq < expected => {
                metrics.engine_restarts.inc();
                warn!(rank = self.source.rank.0, seq = seq.0, expected = expected.0, "engine restarted: resync");
                self.state.reset(self.source.rank);
                self.expected = None;
                if seq.0 == 0 {
                    self.apply(seq, &batch);
                } else {
                    // The new engine's first batches went by unseen (the
                    // disconnect was not reported): replayed from its first,
                    // or later blocks chained to theirs would be unanchored.
                    metrics.gaps.inc();
                    self.recover(Seq(0), Some((seq, batch))).await;
                }
            }
            // The engine started before us with nothing cached yet.
            None if seq.0 == 0 => self.apply(seq, &batch),
            expected => {
                metrics.gaps.inc();
                self.recover(expected.unwrap_or(Seq(0)), Some((seq, batch))).await;
            }
        }
    }

    /// Replays `[from, seq)` while buffering live batches, then applies in order.
    async fn recover(&mut self, from: Seq, live: Option<(Seq, EventBatch)>) {
        let rank = self.source.rank;
        let mut buffered: Vec<(Seq, EventBatch)> = live.into_iter().collect();
        let replayed = match self.source.replay.clone() {
            None => None,
            Some(endpoint) => {
                let fetch = replay::fetch(&endpoint, from, REPLAY_TIMEOUT);
                tokio::pin!(fetch);
                loop {
                    tokio::select! {
                        r = &mut fetch => break Some(r),
                        live = self.next() => match live {
                            Next::Batch(s, b) if buffered.len() < MAX_BUFFERED => buffered.push((s, b)),
                            Next::Batch(..) => break None,
                            // Lost and back again mid-replay: this replay still stands.
                            Next::Reconnected => {}
                        },
                    }
                }
            }
        };
        let outcome = match replayed {
            // A fresh engine with nothing published yet: nothing was lost.
            Some(Ok(replayed)) if replayed.is_empty() && buffered.is_empty() => ReplayOutcome::Recovered,
            Some(Ok(replayed)) if replayed.first().is_some_and(|(s, _)| *s == from) => {
                let mut merged: Vec<&(Seq, EventBatch)> = replayed.iter().chain(buffered.iter()).collect();
                merged.sort_by_key(|(s, _)| *s);
                // Batches both replayed and received live appear twice.
                merged.dedup_by_key(|(s, _)| *s);
                if merged.windows(2).all(|w| w[1].0.0 == w[0].0.0.wrapping_add(1)) {
                    for (s, b) in merged {
                        self.state.apply(rank, b);
                        self.expected = Some(Seq(s.0.wrapping_add(1)));
                        self.replayed_through = Some(*s);
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
            self.expected = Some(Seq(s.0.wrapping_add(1)));
        }
    }
}
