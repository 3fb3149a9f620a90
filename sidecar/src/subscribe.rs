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
//! - the stream is lost (engine gone, or a protocol error such as a message
//!   over `zmtp::MAX_MESSAGE_BYTES`): clear and resync at once, and treat the
//!   first batch after the reconnect as a fresh start (see `Stream::next`).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::decode::{EventBatch, Seq, decode_message};
use crate::metrics::{ReplayLabels, ReplayOutcome};
use crate::replay;
use crate::state::WorkerState;
use crate::translate::Rank;
use crate::zmtp::Subscription;

/// Live batches held while a replay runs, and their bytes on the wire; past
/// either the gap is given up.
const MAX_BUFFERED: usize = 100_000;
const MAX_BUFFERED_BYTES: usize = 256 << 20;
/// Bound on a whole replay exchange.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// After this long without a batch, ask the replay endpoint whether batches
/// after the last one were published: a lost *last* batch shows no gap until
/// the next one arrives, which may be never.
const IDLE_PROBE: Duration = Duration::from_secs(1);
/// Reconnection backoff: doubled from the first to the last.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// Where one rank's events come from.
#[derive(Clone, Debug)]
pub struct RankSource {
    pub rank: Rank,
    pub events: String,
    pub replay: Option<String>,
    pub topic: String,
}

/// Subscribes and applies until cancelled, reconnecting whenever the
/// engine's publisher goes away.
pub async fn run(source: RankSource, state: Arc<WorkerState>, cancel: CancellationToken) {
    if source.replay.is_none() {
        // Nothing the engine published before this start can be read.
        state.mark_caught_up();
    }
    let mut stream = Stream {
        source,
        state,
        subscription: None,
        next_attempt: tokio::time::Instant::now(),
        backoff: RECONNECT_FIRST,
        failed_connects: 0,
        expected: None,
        replayed_through: None,
        lost: false,
        undecodable: LogLimit::default(),
    };
    tokio::select! {
        _ = cancel.cancelled() => return,
        () = stream.connect() => {}
    }
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
            // Not while reconnecting: a tick would cut the attempt short
            // (an engine slower than the tick to accept would never be
            // reached), and there is nothing to probe for.
            _ = probe.tick(), if stream.subscription.is_some() => {
                if last_batch.elapsed() >= IDLE_PROBE {
                    stream.probe().await;
                }
                continue;
            }
        };
        last_batch = tokio::time::Instant::now();
        match next {
            Next::Batch(seq, batch, _) => stream.on_batch(seq, batch).await,
            // Back after a loss: rebuild from the engine's replay buffer now,
            // not when (if ever) the next live batch shows a gap.
            Next::Reconnected if stream.source.replay.is_some() => stream.recover(Seq(0), None).await,
            // Nothing to replay from: the loss already cleared the rank.
            Next::Reconnected => {}
        }
    }
}

struct Stream {
    source: RankSource,
    state: Arc<WorkerState>,
    /// `None` while the engine's publisher is not connected.
    subscription: Option<Subscription>,
    /// When the next connection attempt may start.
    next_attempt: tokio::time::Instant,
    /// The wait after the next failure: doubled at each, back to the first
    /// once a batch has been read (not at a mere connection, or a peer that
    /// accepts and then breaks the protocol would be reconnected to in a
    /// busy loop).
    backoff: Duration,
    /// Connection attempts failed in a row (logged at the first, then every 30th).
    failed_connects: u32,
    expected: Option<Seq>,
    /// The last seq a replay applied: live copies of replayed batches that
    /// were still queued in the socket are skipped, not taken for a restart.
    replayed_through: Option<Seq>,
    /// The stream was lost and has not reconnected yet.
    lost: bool,
    /// Undecodable messages' warnings: an engine whose format changed sent
    /// one a batch, many a second per rank.
    undecodable: LogLimit,
}

/// A warning logged at its first occurrence, then at most once per
/// [`LogLimit::EVERY`], saying how many were not logged meanwhile.
#[derive(Default)]
struct LogLimit {
    last: Option<tokio::time::Instant>,
    unlogged: u64,
}

impl LogLimit {
    const EVERY: Duration = Duration::from_secs(10);

    /// Whether an occurrence at `now` is logged, and if so how many before
    /// it were not.
    fn log(&mut self, now: tokio::time::Instant) -> Option<u64> {
        if self.last.is_some_and(|last| now.duration_since(last) < Self::EVERY) {
            self.unlogged += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// What the event socket produced.
enum Next {
    /// A batch, and its message's size in bytes.
    Batch(Seq, EventBatch, usize),
    /// The socket reconnected after the stream was lost.
    Reconnected,
}

impl Stream {
    /// Connects and subscribes, retrying with backoff until it does.
    /// Cancel-safe: dropped mid-way, the next call starts again.
    async fn connect(&mut self) {
        loop {
            tokio::time::sleep_until(self.next_attempt).await;
            match Subscription::open(&self.source.events, &self.source.topic).await {
                Ok(s) => {
                    info!(endpoint = %self.source.events, rank = self.source.rank.0, "subscribed to KV events");
                    self.subscription = Some(s);
                    self.failed_connects = 0;
                    return;
                }
                Err(e) => {
                    if self.failed_connects.is_multiple_of(30) {
                        let error = kvroute_shared::logging::error_chain(&e);
                        warn!(endpoint = %self.source.events, error, attempts = self.failed_connects + 1, "cannot subscribe to the engine's KV events; retrying");
                    }
                    self.failed_connects += 1;
                    self.defer_reconnect();
                }
            }
        }
    }

    fn defer_reconnect(&mut self) {
        self.next_attempt = tokio::time::Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(RECONNECT_MAX);
    }

    /// The next decodable batch. Never gives up: when the engine goes away
    /// (restart, crash) or breaks the protocol, the connection is dropped
    /// and made again, and the stream resumes.
    ///
    /// A lost stream means the engine's state is unknown: it may have
    /// restarted empty, and batches published before the subscription is back
    /// are lost to it (ZMQ's slow joiner). So the rank is cleared at once —
    /// the routers drop its keys under a new epoch rather than route to
    /// blocks that may be gone — and `expected` is forgotten: the first batch
    /// after the reconnect is seq 0 (a fresh engine) or a gap that is
    /// replayed from 0, which rebuilds the state exactly while the engine's
    /// buffer holds it. Cancel-safe.
    async fn next(&mut self) -> Next {
        loop {
            let Some(subscription) = &mut self.subscription else {
                self.connect().await;
                if std::mem::take(&mut self.lost) {
                    return Next::Reconnected;
                }
                continue;
            };
            match subscription.recv().await {
                Ok(frames) => match decode_message(&frames) {
                    Ok((seq, batch)) => {
                        self.backoff = RECONNECT_FIRST;
                        return Next::Batch(seq, batch, frames.iter().map(|f| f.len()).sum());
                    }
                    Err(e) => {
                        self.state.metrics().decode_errors.inc();
                        if let Some(unlogged) = self.undecodable.log(tokio::time::Instant::now()) {
                            warn!(error = %e, unlogged, "undecodable KV-event message (at most one logged per 10 s)");
                        }
                    }
                },
                Err(e) => {
                    self.subscription = None;
                    self.defer_reconnect();
                    self.stream_lost(&kvroute_shared::logging::error_chain(&e));
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
        let Some(endpoint) = self.source.replay.clone() else {
            // No replay endpoint: what was missed is gone, and no replay was
            // tried (none is counted). A rank that held something is cleared;
            // one the loss of the stream cleared already is not again (each
            // reset is a full sync to every router).
            if self.expected.is_some() {
                warn!(rank = rank.0, from = from.0, "events missed and no --replay endpoint: clearing and resyncing");
                self.state.reset(rank);
            }
            for (s, b) in &buffered {
                self.state.apply(rank, b);
                self.expected = Some(Seq(s.0.wrapping_add(1)));
            }
            return;
        };
        let mut buffered_bytes = 0;
        let mut reconnected = false;
        let replayed = {
            let fetch = replay::fetch(&endpoint, from, REPLAY_TIMEOUT);
            tokio::pin!(fetch);
            loop {
                tokio::select! {
                    r = &mut fetch => break Some(r),
                    live = self.next() => match live {
                        Next::Batch(s, b, n)
                            if buffered.len() < MAX_BUFFERED && buffered_bytes + n <= MAX_BUFFERED_BYTES =>
                        {
                            buffered.push((s, b));
                            buffered_bytes += n;
                        }
                        Next::Batch(..) => break None,
                        Next::Reconnected => reconnected = true,
                    },
                }
            }
        };
        if reconnected || self.lost {
            // The stream was lost while this replay ran: the rank was
            // cleared, and the engine may have restarted in between, so
            // neither the replay nor the batches buffered before the loss
            // hold. Start again from the engine's first batch once back.
            warn!(rank = rank.0, from = from.0, "event stream lost during a replay: starting again from the beginning");
            self.state.metrics().replays.get_or_create(&ReplayLabels { outcome: ReplayOutcome::Failed.as_str() }).inc();
            self.state.reset(rank);
            self.expected = None;
            self.replayed_through = None;
            if reconnected && !self.lost {
                Box::pin(self.recover(Seq(0), None)).await;
            }
            // Still lost: the next `Reconnected` replays from the beginning.
            return;
        }
        let (replayed, failed) = match replayed {
            Some(Ok(replayed)) => (replayed, false),
            Some(Err(e)) => {
                warn!(rank = rank.0, error = %e, "replay failed");
                (Vec::new(), true)
            }
            // More live batches than can wait for the replay.
            None => (Vec::new(), true),
        };
        // A fresh engine with nothing published yet: nothing was lost.
        if !failed && replayed.is_empty() && buffered.is_empty() {
            self.state
                .metrics()
                .replays
                .get_or_create(&ReplayLabels { outcome: ReplayOutcome::Recovered.as_str() })
                .inc();
            return;
        }
        let reaches_back = replayed.first().is_some_and(|(s, _)| *s == from);
        let mut merged: Vec<&(Seq, EventBatch)> = replayed.iter().chain(buffered.iter()).collect();
        merged.sort_by_key(|(s, _)| *s);
        // Batches both replayed and received live appear twice.
        merged.dedup_by_key(|(s, _)| *s);
        let contiguous = merged.windows(2).all(|w| w[1].0.0 == w[0].0.0.wrapping_add(1));
        let outcome = match (failed, reaches_back && contiguous) {
            (true, _) => ReplayOutcome::Failed,
            (false, true) => ReplayOutcome::Recovered,
            (false, false) => ReplayOutcome::Lost,
        };
        self.state.metrics().replays.get_or_create(&ReplayLabels { outcome: outcome.as_str() }).inc();
        if outcome != ReplayOutcome::Recovered {
            warn!(rank = rank.0, from = from.0, "events lost beyond replay: clearing and resyncing");
            self.state.reset(rank);
        }
        // What the engine still holds from where its buffer begins (it no
        // longer reached back to `from`: a sidecar started after the engine
        // published more than its buffer keeps), or what the live stream
        // brought: stores of new prefixes key fine, stores chained to
        // forgotten blocks are counted as unanchored. Thrown away, the next
        // live batch was taken for another gap: a second replay and reset.
        let applied = if contiguous { merged } else { buffered.iter().collect() };
        for (s, b) in applied {
            self.state.apply(rank, b);
            self.expected = Some(Seq(s.0.wrapping_add(1)));
            self.replayed_through = Some(*s);
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_shared::{BlockSize, ModelName};
    use rmpv::Value;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    use super::*;
    use crate::metrics::Metrics;
    use crate::translate::Translator;
    use crate::zmtp::peer;

    #[test]
    fn a_repeated_warning_is_logged_once_per_period_with_the_count_not_logged() {
        let mut limit = LogLimit::default();
        let t0 = tokio::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(limit.log(at(0)), Some(0));
        assert_eq!((0..1_000).filter_map(|i| limit.log(at(1 + i))).count(), 0);
        assert_eq!(limit.log(at(10_000)), Some(1_000));
        assert_eq!(limit.log(at(10_001)), None);
    }

    /// One vLLM event message: batch `seq` storing one block.
    fn stored(seq: u64, hash: u64) -> Vec<u8> {
        peer::message(&[b"kv", &seq.to_be_bytes(), &payload(hash)])
    }

    /// A batch's payload: one block `hash` of 4 tokens from `hash`, no parent.
    fn payload(hash: u64) -> Vec<u8> {
        let event = Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (Value::from("block_hashes"), Value::Array(vec![Value::from(hash)])),
            (Value::from("parent_block_hash"), Value::Nil),
            (Value::from("token_ids"), Value::Array((0..4).map(|t| Value::from(t + hash)).collect())),
            (Value::from("block_size"), Value::from(4)),
            (Value::from("lora_id"), Value::Nil),
            (Value::from("medium"), Value::from("GPU")),
        ]);
        let mut payload = Vec::new();
        rmpv::encode::write_value(&mut payload, &Value::Array(vec![1.7e9.into(), Value::Array(vec![event]), 0.into()]))
            .unwrap();
        payload
    }

    fn state() -> (Arc<WorkerState>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let translator = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), metrics.translate.clone());
        (Arc::new(WorkerState::new(translator, metrics.clone(), 1_000)), metrics)
    }

    /// The rank-0 source of an engine whose events (and replay) listen here.
    fn source(events: &TcpListener, replays: Option<&TcpListener>) -> RankSource {
        let endpoint = |l: &TcpListener| format!("tcp://{}", l.local_addr().unwrap());
        RankSource { rank: Rank(0), events: endpoint(events), replay: replays.map(endpoint), topic: "kv".into() }
    }

    /// The engine's PUB side: a subscriber's connection, greeted and subscribed.
    async fn accept_subscriber(events: &TcpListener) -> tokio::net::TcpStream {
        let (mut s, _) = events.accept().await.unwrap();
        peer::handshake(&mut s, "PUB").await;
        let _subscription = peer::read_frame(&mut s).await;
        s
    }

    /// The engine's replay side: a request's connection, and the seq it asks from.
    async fn accept_replay(replays: &TcpListener) -> (tokio::net::TcpStream, u64) {
        let (mut s, _) = replays.accept().await.unwrap();
        peer::handshake(&mut s, "ROUTER").await;
        let _ready = peer::read_frame(&mut s).await;
        let (_, _delimiter) = peer::read_frame(&mut s).await;
        let (_, start) = peer::read_frame(&mut s).await;
        (s, u64::from_be_bytes(start.try_into().unwrap()))
    }

    /// Answers a replay with `(seq, block)` batches, then the end marker.
    async fn send_replay(s: &mut tokio::net::TcpStream, batches: impl IntoIterator<Item = (u64, u64)>) {
        for (seq, hash) in batches {
            s.write_all(&peer::message(&[b"", b"kv", &seq.to_be_bytes(), &payload(hash)])).await.unwrap();
        }
        s.write_all(&peer::message(&[b"", b"", &u64::MAX.to_be_bytes(), b""])).await.unwrap();
    }

    /// Polls `done` every 10 ms; panics after 10 s.
    async fn wait_until(what: &str, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The engine restarts while a replay of a gap is in flight: the replay
    /// (the old engine's batches) and the batch that showed the gap must not
    /// be applied to the set the loss cleared; the new engine's buffer is
    /// replayed from its first batch instead. Before, the old engine's blocks
    /// were applied and the new engine's never read.
    #[tokio::test]
    async fn a_stream_lost_during_a_replay_starts_again_from_the_first_batch() {
        let events = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let replays = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let source = source(&events, Some(&replays));
        let (gap_asked, mut gap_asked_rx) = tokio::sync::mpsc::channel::<()>(1);
        let restarted = Arc::new(tokio::sync::Notify::new());
        let restarted_flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The replay endpoint: the old engine's batches 0–5 (blocks 1–6),
        // the new engine's batch 0 (block 100) once it has restarted.
        let replay_side = {
            let (restarted, restarted_flag) = (restarted.clone(), restarted_flag.clone());
            tokio::spawn(async move {
                let mut first = true;
                loop {
                    let (mut s, start) = accept_replay(&replays).await;
                    let batches: Vec<(u64, u64)> = if restarted_flag.load(std::sync::atomic::Ordering::SeqCst) {
                        vec![(0, 100)]
                    } else if first {
                        vec![(0, 1), (1, 2)]
                    } else {
                        // The gap's replay: held until the engine has restarted.
                        gap_asked.send(()).await.unwrap();
                        restarted.notified().await;
                        (2..6).map(|seq| (seq, seq + 1)).collect()
                    };
                    first = false;
                    send_replay(&mut s, batches.into_iter().filter(|&(seq, _)| seq >= start)).await;
                }
            })
        };
        let (state, _metrics) = state();
        let cancel = CancellationToken::new();
        let subscriber = tokio::spawn(run(source, state.clone(), cancel.clone()));
        let mut old = accept_subscriber(&events).await;
        wait_until("the initial replay", || state.counts().0 == 2).await;
        old.write_all(&stored(5, 6)).await.unwrap(); // batches 2–4 went by unseen
        gap_asked_rx.recv().await.unwrap();
        drop(old); // the engine restarts while the gap is being replayed
        let _new = accept_subscriber(&events).await;
        restarted_flag.store(true, std::sync::atomic::Ordering::SeqCst);
        restarted.notify_one();
        let want = kvroute_shared::block_keys(
            kvroute_shared::KeyRoot::new("m", None),
            &[100, 101, 102, 103],
            BlockSize::new(4).unwrap(),
        );
        wait_until("the new engine's block alone", || state.keys() == want).await;
        cancel.cancel();
        subscriber.await.unwrap();
        replay_side.abort();
    }

    /// A sidecar started after its engine published more than the replay
    /// buffer keeps: the replay no longer reaches back to the first batch,
    /// but what it holds is applied, and the next live batch continues it.
    /// Before, the replay was thrown away, and that batch was taken for a
    /// gap: a second replay, a second reset (a full sync to every router).
    #[tokio::test]
    async fn a_replay_that_no_longer_reaches_back_is_applied() {
        let events = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let replays = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let source = source(&events, Some(&replays));
        // The engine's buffer: batches 100–105 (one block each) of 106.
        let replay_side = tokio::spawn(async move {
            loop {
                let (mut s, start) = accept_replay(&replays).await;
                send_replay(&mut s, (100..106u64).filter(|seq| *seq >= start).map(|seq| (seq, seq))).await;
            }
        });
        let (state, metrics) = state();
        let cancel = CancellationToken::new();
        let subscriber = tokio::spawn(run(source, state.clone(), cancel.clone()));
        let mut engine = accept_subscriber(&events).await;
        wait_until("the replayed batches", || state.counts().0 == 6).await;
        let epoch = state.epoch();
        engine.write_all(&stored(106, 106)).await.unwrap();
        wait_until("the live batch", || state.counts().0 == 7).await;
        let replays =
            |outcome: ReplayOutcome| metrics.replays.get_or_create(&ReplayLabels { outcome: outcome.as_str() }).get();
        assert_eq!((replays(ReplayOutcome::Lost), metrics.gaps.get()), (1, 0), "one replay, no gap after it");
        assert_eq!(state.epoch(), epoch, "no second reset");
        cancel.cancel();
        subscriber.await.unwrap();
        replay_side.abort();
    }

    /// A replay keeps what it can use: past a batch that does not decode,
    /// what follows it; past its byte cap, its newest batches. Either was
    /// the whole replay's failure, and a sidecar started beside a busy
    /// engine (10,000 batches of long prompts are past 256 MiB) kept nothing.
    #[tokio::test]
    async fn a_replay_keeps_its_newest_usable_batches() {
        let replays = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", replays.local_addr().unwrap());
        let replay_side = tokio::spawn(async move {
            loop {
                let (mut s, _) = accept_replay(&replays).await;
                s.write_all(&peer::message(&[b"", b"kv", &100u64.to_be_bytes(), &payload(100)])).await.unwrap();
                s.write_all(&peer::message(&[b"", b"kv", &101u64.to_be_bytes(), b"\xc1 not msgpack"])).await.unwrap();
                send_replay(&mut s, (102..106u64).map(|seq| (seq, seq))).await;
            }
        });
        let fetch = |cap| replay::fetch_within(&endpoint, Seq(100), Duration::from_secs(10), cap);
        let seqs = |r: Vec<(Seq, EventBatch)>| r.into_iter().map(|(s, _)| s.0).collect::<Vec<_>>();
        assert_eq!(seqs(fetch(usize::MAX).await.unwrap()), [102, 103, 104, 105], "what follows the hole");
        let one = peer::message(&[b"kv", &102u64.to_be_bytes(), &payload(102)]).len();
        assert_eq!(seqs(fetch(2 * one).await.unwrap()), [104, 105], "the newest within the cap");
        replay_side.abort();
    }

    /// Without a replay endpoint, a stream lost and back counts no failed
    /// replay (none was tried) and clears the rank once, at the loss; the
    /// reconnect cleared it again, each reset a full sync to every router.
    #[tokio::test]
    async fn a_reconnect_without_a_replay_endpoint_clears_once_and_replays_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (state, metrics) = state();
        let source = source(&listener, None);
        let cancel = CancellationToken::new();
        let subscriber = tokio::spawn(run(source, state.clone(), cancel.clone()));
        let mut first = accept_subscriber(&listener).await;
        first.write_all(&stored(0, 1)).await.unwrap();
        wait_until("the first block", || state.counts().0 == 1).await;
        let before = state.epoch();
        drop(first);
        wait_until("the loss", || metrics.disconnects.get() == 1).await;
        let cleared = state.epoch();
        assert_ne!(cleared, before, "the loss clears the rank");
        let mut second = accept_subscriber(&listener).await;
        second.write_all(&stored(7, 8)).await.unwrap();
        wait_until("the block after the loss", || state.counts().0 == 1 && state.keys() != Vec::new()).await;
        wait_until("the next batch", || metrics.event_batches.get() >= 2).await;
        let replays =
            |outcome: ReplayOutcome| metrics.replays.get_or_create(&ReplayLabels { outcome: outcome.as_str() }).get();
        assert_eq!(replays(ReplayOutcome::Failed), 0, "no replay was tried");
        assert_eq!(state.epoch(), cleared, "cleared once");
        cancel.cancel();
        subscriber.await.unwrap();
    }

    /// An engine back on its port that takes longer to answer than the idle
    /// probe's 1 s tick is reached all the same: the tick used to cut every
    /// attempt short, for ever.
    #[tokio::test]
    async fn a_reconnect_slower_than_the_probe_tick_is_not_cut_short() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let events = format!("tcp://{}", listener.local_addr().unwrap());
        let engine = tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.unwrap();
            peer::handshake(&mut first, "PUB").await;
            let _subscription = peer::read_frame(&mut first).await;
            first.write_all(&stored(0, 1)).await.unwrap();
            drop(first);
            // Restarted, and slow to greet.
            let (mut second, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            peer::handshake(&mut second, "PUB").await;
            let _subscription = peer::read_frame(&mut second).await;
            second.write_all(&stored(0, 2)).await.unwrap();
            second
        });
        let (state, metrics) = state();
        let source = RankSource { rank: Rank(0), events, replay: None, topic: "kv".into() };
        let cancel = CancellationToken::new();
        let subscriber = tokio::spawn(run(source, state, cancel.clone()));
        wait_until("the restarted engine", || metrics.event_batches.get() >= 2).await;
        assert_eq!(metrics.disconnects.get(), 1);
        cancel.cancel();
        subscriber.await.unwrap();
        drop(engine);
    }
}
