//! The push loop's timing, with a paused clock and an in-memory router.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use std::collections::HashSet;

use kvroute_shared::wire::{AckOutcome, EvictionBatch, InternalAck, PROTOCOL_HEADER, ServedModel, SyncSnapshot};
use kvroute_shared::{BlockKey, BlockSize, KeyDigest, KeyRoot, ModelName, WorkerId, block_keys};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::decode::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use crate::engine::EngineView;
use crate::metrics::Metrics;
use crate::state::{RouterTarget, WallClock, WorkerState};
use crate::translate::{Rank, Translator};

#[derive(Clone, Debug)]
enum Sent {
    Eviction(EvictionBatch),
    Sync(SyncSnapshot),
}

#[derive(Debug)]
struct FakeRouter {
    log: Mutex<Vec<(Instant, Sent)>>,
    attempts: Mutex<Vec<Instant>>,
    /// Attempts that were full syncs, answered or not.
    sync_attempts: Mutex<usize>,
    failures_left: Mutex<usize>,
    /// Attempts refused as if nothing listened on the router's port.
    unreachable_left: Mutex<usize>,
    stale_left: Mutex<usize>,
    /// Messages answered `unknown_worker` (a router that will not register it).
    unknown_left: Mutex<usize>,
    /// Syncs refused 413, as larger than the router's `max_sync_keys`.
    too_large_syncs_left: Mutex<usize>,
    /// Every push refused with this status (a 4xx only an operator fixes).
    refuse_with: Mutex<Option<u16>>,
    epoch: Mutex<String>,
    /// A router of the release before v2: it refuses a version-2 header.
    v1_only: Mutex<bool>,
    /// Deltas acked as applied but lost (a misapplied or lost push).
    lose_left: Mutex<usize>,
    /// Deltas of these seqs are misapplied (dropped), and the ack says so.
    misapply_seqs: Mutex<Vec<u64>>,
    /// The keys this router holds for the worker, as a real router applies
    /// pushes, and the protocol each accepted message was sent under.
    held: Mutex<HashSet<BlockKey>>,
    protocols: Mutex<Vec<u32>>,
    /// The router's causal clock: one tick per ack here.
    clock: Mutex<u64>,
    /// Its acks say it takes a sync's `model_aliases` (this release does).
    takes_aliases: Mutex<bool>,
    /// It refuses a sync naming aliases with a 400 (an older release).
    refuses_aliases: Mutex<bool>,
}

impl FakeRouter {
    fn new() -> Arc<Self> {
        Arc::new(FakeRouter {
            log: Mutex::new(Vec::new()),
            attempts: Mutex::new(Vec::new()),
            sync_attempts: Mutex::new(0),
            failures_left: Mutex::new(0),
            unreachable_left: Mutex::new(0),
            stale_left: Mutex::new(0),
            unknown_left: Mutex::new(0),
            too_large_syncs_left: Mutex::new(0),
            refuse_with: Mutex::new(None),
            epoch: Mutex::new("r1".into()),
            v1_only: Mutex::new(false),
            lose_left: Mutex::new(0),
            misapply_seqs: Mutex::new(Vec::new()),
            held: Mutex::new(HashSet::new()),
            protocols: Mutex::new(Vec::new()),
            clock: Mutex::new(0),
            takes_aliases: Mutex::new(true),
            refuses_aliases: Mutex::new(false),
        })
    }

    fn answer(&self, sent: Sent, protocol: u32) -> Result<InternalAck, PushError> {
        self.attempts.lock().push(Instant::now());
        if matches!(sent, Sent::Sync(_)) {
            *self.sync_attempts.lock() += 1;
        }
        if protocol >= 2 && *self.v1_only.lock() {
            let detail = format!("wire protocol version {protocol} is not supported: this router speaks version 1");
            return Err(PushError::Status {
                url: "fake".into(),
                status: 400,
                detail,
                param: Some(PROTOCOL_HEADER.into()),
            });
        }
        let mut refused = self.unreachable_left.lock();
        if *refused > 0 {
            *refused -= 1;
            let source = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
            return Err(PushError::Unreachable { url: "fake".into(), source });
        }
        let mut too_large = self.too_large_syncs_left.lock();
        if *too_large > 0 && matches!(sent, Sent::Sync(_)) {
            *too_large -= 1;
            return Err(PushError::Status { url: "fake".into(), status: 413, detail: String::new(), param: None });
        }
        drop(too_large);
        if *self.refuses_aliases.lock() && matches!(&sent, Sent::Sync(s) if !s.model_aliases.is_empty()) {
            let detail = "unknown field `model_aliases`".to_owned();
            return Err(PushError::Status { url: "fake".into(), status: 400, detail, param: None });
        }
        if let Some(status) = *self.refuse_with.lock() {
            return Err(PushError::Status { url: "fake".into(), status, detail: String::new(), param: None });
        }
        let mut left = self.failures_left.lock();
        if *left > 0 {
            *left -= 1;
            return Err(PushError::Status { url: "fake".into(), status: 503, detail: String::new(), param: None });
        }
        self.protocols.lock().push(protocol);
        let theirs = self.apply(&sent);
        self.log.lock().push((Instant::now(), sent));
        let mut stale = self.stale_left.lock();
        let mut unknown = self.unknown_left.lock();
        let outcome = if *stale > 0 {
            *stale -= 1;
            AckOutcome::Stale
        } else if *unknown > 0 {
            *unknown -= 1;
            AckOutcome::UnknownWorker
        } else {
            AckOutcome::Applied
        };
        let resync = theirs.is_some_and(|d| d != KeyDigest::of(self.held.lock().iter().copied()));
        let mut clock = self.clock.lock();
        *clock += 1;
        let protocol = if *self.v1_only.lock() { 1 } else { 2 };
        let clock = (protocol >= 2).then_some(*clock);
        let model_aliases = *self.takes_aliases.lock();
        Ok(InternalAck { router_epoch: self.epoch.lock().clone(), outcome, protocol, resync, clock, model_aliases })
    }

    /// Applies what a router would; the digest the message carried.
    fn apply(&self, sent: &Sent) -> Option<KeyDigest> {
        let mut held = self.held.lock();
        match sent {
            Sent::Sync(s) => {
                *held = s.hashes.iter().copied().collect();
                s.digest
            }
            Sent::Eviction(b) => {
                let mut lose = self.lose_left.lock();
                if *lose > 0 {
                    *lose -= 1;
                    return None;
                }
                if b.seq.is_some_and(|seq| self.misapply_seqs.lock().contains(&seq)) {
                    return b.digest;
                }
                if b.cleared {
                    held.clear();
                }
                b.evicted_hashes.iter().for_each(|k| {
                    held.remove(k);
                });
                held.extend(b.stored_hashes.iter().copied());
                b.digest
            }
        }
    }

    fn sent(&self) -> Vec<Sent> {
        self.log.lock().iter().map(|(_, s)| s.clone()).collect()
    }
}

impl RouterClient for FakeRouter {
    fn eviction<'a>(
        &'a self,
        _: &'a RouterTarget,
        body: &'a EvictionBatch,
        protocol: u32,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>> {
        Box::pin(std::future::ready(self.answer(Sent::Eviction(body.clone()), protocol)))
    }
    fn sync<'a>(
        &'a self,
        _: &'a RouterTarget,
        body: &'a SyncSnapshot,
        protocol: u32,
    ) -> BoxFuture<'a, Result<InternalAck, PushError>> {
        Box::pin(std::future::ready(self.answer(Sent::Sync(body.clone()), protocol)))
    }
}

struct Setup {
    router: Arc<FakeRouter>,
    state: Arc<WorkerState>,
    engine: Arc<EngineView>,
    cancel: CancellationToken,
}

fn start() -> Setup {
    start_with(FakeRouter::new(), WallClock::system())
}

fn start_with(router: Arc<FakeRouter>, clock: WallClock) -> Setup {
    let metrics = Arc::new(Metrics::new());
    let translator = Translator::new(ModelName::new("m"), BlockSize::new(4).unwrap(), metrics.translate.clone());
    let state = Arc::new(WorkerState::with_clock(translator, metrics, 1 << 20, clock));
    let engine = Arc::new(EngineView::new(&[served("m")], ModelName::new("m"), Vec::new()));
    let target = RouterTarget("http://r".into());
    state.set_routers(std::slice::from_ref(&target));
    let pusher = Arc::new(Pusher {
        client: router.clone(),
        worker_id: WorkerId::new("w1"),
        advertise_url: "http://w1:8000".into(),
        dp_rank: None,
        block_size: BlockSize::new(4).unwrap(),
        engine: engine.clone(),
        state: state.clone(),
        fast_interval: Duration::from_millis(100),
        full_sync_interval: Duration::from_secs(300),
        v1_sync_interval: Duration::from_secs(5),
        seq: Default::default(),
    });
    let cancel = CancellationToken::new();
    tokio::spawn(run_target(pusher, target, Arc::new(Notify::new()), cancel.clone()));
    Setup { router, state, engine, cancel }
}

fn store(hash: u64, tokens: [u32; 4]) -> EventBatch {
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![EngineHash::Int(hash)],
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 4,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        remote: false,
    });
    EventBatch { ts: 0.0, events: vec![ev], data_parallel_rank: None, encoding: None, unknown_fields: 0 }
}

fn remove(hash: u64) -> EventBatch {
    let ev = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineHash::Int(hash)],
        medium: None,
        group_idx: None,
        remote: false,
    });
    EventBatch { ts: 0.0, events: vec![ev], data_parallel_rank: None, encoding: None, unknown_fields: 0 }
}

fn key(tokens: [u32; 4]) -> BlockKey {
    block_keys(KeyRoot::new("m", None), &tokens, BlockSize::new(4).unwrap())[0]
}

async fn advance(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

#[tokio::test(start_paused = true)]
async fn one_window_is_one_net_message() {
    let s = start();
    advance(1).await;
    assert!(matches!(s.router.sent()[..], [Sent::Sync(_)]), "registration sync first");
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    s.state.apply(Rank(0), &store(2, [2, 2, 2, 2]));
    s.state.apply(Rank(0), &remove(1));
    advance(100).await;
    let sent = s.router.sent();
    assert_eq!(sent.len(), 2);
    let Sent::Eviction(b) = &sent[1] else { panic!("{sent:?}") };
    assert_eq!((b.stored_hashes.clone(), b.evicted_hashes.clone()), (vec![key([2, 2, 2, 2])], vec![]));
    assert_eq!(b.seq, Some(2));
    advance(1_000).await;
    let later = s.router.sent();
    assert!(later.len() > 2, "an idle link sends heartbeats");
    for m in &later[2..] {
        let Sent::Eviction(b) = m else { panic!("{later:?}") };
        assert!(b.stored_hashes.is_empty() && b.evicted_hashes.is_empty() && !b.cleared, "heartbeats carry no change");
    }
    s.cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn failures_back_off_and_recovery_starts_with_a_sync() {
    let s = start();
    *s.router.failures_left.lock() = 4;
    for h in 0..50 {
        s.state.apply(Rank(0), &store(h, [h as u32, 0, 0, 0]));
        advance(20).await;
        if *s.router.failures_left.lock() > 0 {
            let pending = s.state.pending_len(&RouterTarget("http://r".into()));
            assert_eq!(pending, Some(0), "no delta kept while failing");
        }
    }
    advance(20_000).await;
    let attempts = s.router.attempts.lock().clone();
    let gaps: Vec<Duration> = attempts.windows(2).take(4).map(|w| w[1] - w[0]).collect();
    // Each a full sync that reached the router and failed (503): 1, 2, 4,
    // 8 s, each jittered into its upper half. Paced at most a second apart,
    // a router that could not take a sidecar got its whole key set each
    // second.
    assert_eq!(gaps.len(), 4, "{attempts:?}");
    for (gap, base) in gaps.iter().zip([1_000u64, 2_000, 4_000, 8_000]) {
        assert!(*gap >= Duration::from_millis(base / 2), "{gaps:?}");
    }
    let sent = s.router.sent();
    let Sent::Sync(first) = &sent[0] else { panic!("first message after recovery must be a sync: {sent:?}") };
    // The jittered backoff may end before the last stores: those follow as deltas.
    let mut held: std::collections::HashSet<_> = first.hashes.iter().copied().collect();
    for m in &sent[1..] {
        let Sent::Eviction(b) = m else { continue };
        held.extend(b.stored_hashes.iter().copied());
    }
    assert_eq!(held.len(), 50, "every store reached the router once it recovered");
    s.cancel.cancel();
}

/// A router that refuses the worker's key set as too large does until its
/// limit is raised: the sidecar pauses before each new attempt instead of
/// resending the whole set every second.
#[tokio::test(start_paused = true)]
async fn a_sync_refused_as_too_large_is_retried_after_a_pause() {
    let router = FakeRouter::new();
    *router.too_large_syncs_left.lock() = 1_000;
    let s = start_with(router, WallClock::system());
    advance(95_000).await;
    let attempts = s.router.attempts.lock().len();
    assert!((3..=5).contains(&attempts), "{attempts} attempts in 95 s");
    // Raised: the next attempt is taken.
    *s.router.too_large_syncs_left.lock() = 0;
    advance(31_000).await;
    assert!(matches!(s.router.sent().first(), Some(Sent::Sync(_))), "{:?}", s.router.sent());
    s.cancel.cancel();
}

/// A router that refuses every push for what it is or who sent it (a block
/// size, a token: a 4xx only an operator fixes) is retried after a pause, not
/// sent a full sync about once a second; a rate limit is retried sooner,
/// backing off to 16 s.
#[tokio::test(start_paused = true)]
async fn a_push_refused_for_its_configuration_is_retried_after_a_pause() {
    for (status, paused) in [(400, true), (401, true), (403, true), (429, false)] {
        let router = FakeRouter::new();
        *router.refuse_with.lock() = Some(status);
        let s = start_with(router, WallClock::system());
        advance(95_000).await;
        let attempts = s.router.attempts.lock().len();
        let expected = if paused { (3..=5).contains(&attempts) } else { (8..=20).contains(&attempts) };
        assert!(expected, "{status}: {attempts} attempts in 95 s");
        // Fixed: the next attempt is taken.
        *s.router.refuse_with.lock() = None;
        advance(31_000).await;
        assert!(matches!(s.router.sent().first(), Some(Sent::Sync(_))), "{status}: {:?}", s.router.sent());
        s.cancel.cancel();
    }
}

/// A router that calls a push stale holds a newer epoch/seq for this worker
/// (a forged push, say): the sidecar continues under a new, later epoch with
/// a full sync at once, and its seq never goes back.
#[tokio::test(start_paused = true)]
async fn a_stale_reply_draws_a_new_epoch_and_resyncs() {
    let s = start();
    advance(1).await;
    let Sent::Sync(first) = &s.router.sent()[0] else { panic!() };
    let old_epoch = first.epoch.clone().unwrap();
    *s.router.stale_left.lock() = 1;
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(100).await;
    let sent = s.router.sent();
    let [Sent::Sync(_), Sent::Eviction(stale), Sent::Sync(resync), ..] = &sent[..] else { panic!("{sent:?}") };
    let new_epoch = resync.epoch.clone().unwrap();
    assert!(new_epoch > old_epoch, "epochs are ordered: {new_epoch} after {old_epoch}");
    assert!(resync.seq > stale.seq);
    assert_eq!(resync.hashes, vec![key([1, 1, 1, 1])]);
    s.cancel.cancel();
}

/// A router that answers every sync by asking for another (here: it never
/// registers the worker) gets them paced by a backoff, not back to back;
/// once it accepts one, deltas follow at the usual interval.
#[tokio::test(start_paused = true)]
async fn a_router_that_keeps_refusing_syncs_gets_them_paced() {
    let router = FakeRouter::new();
    *router.unknown_left.lock() = 40;
    let s = start_with(router, WallClock::system());
    advance(1_000).await;
    let syncs = s.router.sent().iter().filter(|m| matches!(m, Sent::Sync(_))).count();
    // Back to back, all 40 refusals (and the 41st sync) came at once.
    assert!((2..=12).contains(&syncs), "{syncs} syncs in the first second");
    advance(60_000).await;
    assert_eq!(*s.router.unknown_left.lock(), 0);
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(100).await;
    let sent = s.router.sent();
    let Some(Sent::Eviction(last)) = sent.last() else { panic!("{sent:?}") };
    assert_eq!(last.stored_hashes, vec![key([1, 1, 1, 1])]);
    s.cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_new_router_epoch_gets_a_sync_at_once() {
    let s = start();
    advance(1).await;
    *s.router.epoch.lock() = "r2".into();
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(100).await;
    let log = s.router.log.lock().clone();
    assert!(matches!(log[..], [(_, Sent::Sync(_)), (_, Sent::Eviction(_)), (_, Sent::Sync(_))]), "{log:?}");
    assert_eq!(log[1].0, log[2].0, "the sync follows the eviction without waiting for a tick");
    s.cancel.cancel();
}

/// A router that restarted while it was unreachable takes the sidecar's
/// first message after the outage, a full sync, from its new epoch: that
/// sync holds the whole set, and no second one follows.
#[tokio::test(start_paused = true)]
async fn a_router_back_from_a_restart_gets_one_sync() {
    let s = start();
    advance(1).await;
    assert!(matches!(s.router.sent()[..], [Sent::Sync(_)]));
    *s.router.unreachable_left.lock() = 5;
    *s.router.epoch.lock() = "r2".into();
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(10_000).await;
    let sent = s.router.sent();
    let synced = syncs(&sent);
    assert_eq!(synced.len(), 2, "the registration's and one after the outage: {sent:?}");
    // Its clock started again: the old one would cover (drop) every
    // speculative entry the new router made.
    assert_eq!(synced[1].covers, None, "the old router's clock: {sent:?}");
    s.cancel.cancel();
}

/// Routers take a worker's models from syncs alone: an adapter the engine
/// loads is synced within a fast interval, not at the next full sync (5 min).
#[tokio::test(start_paused = true)]
async fn a_new_model_is_synced_at_once() {
    let s = start();
    advance(1).await;
    assert_eq!(syncs(&s.router.sent()).len(), 1);
    advance(1_000).await;
    assert_eq!(syncs(&s.router.sent()).len(), 1, "nothing new, no sync");
    s.engine.set_models(vec![ModelName::new("m"), ModelName::new("m-lora")]);
    advance(200).await;
    let sent = s.router.sent();
    let synced = syncs(&sent);
    assert_eq!(synced.len(), 2, "{sent:?}");
    assert_eq!(synced[1].models, [ModelName::new("m"), ModelName::new("m-lora")]);
    advance(1_000).await;
    assert_eq!(syncs(&s.router.sent()).len(), 2, "once");
    s.cancel.cancel();
}

fn served(name: &str) -> ServedModel {
    ServedModel { name: ModelName::new(name), parent: None }
}

/// A pusher whose engine serves `m` also as `m2`, registered (its second
/// sync, naming the alias, sent).
async fn start_with_alias() -> Setup {
    let s = start();
    s.engine.set_served(&[served("m"), served("m2")]);
    advance(1).await;
    advance(1_000).await;
    s
}

/// `--served-model-name m m2`: a router that says it takes aliases gets a
/// sync naming them at once (the first went before its ack said so), and
/// again when they change; one that does not say (an older release refuses
/// the field) never gets them.
#[tokio::test(start_paused = true)]
async fn aliases_are_synced_to_routers_that_take_them() {
    for takes in [true, false] {
        let router = FakeRouter::new();
        *router.takes_aliases.lock() = takes;
        let s = start_with(router, WallClock::system());
        let lora = ServedModel { name: ModelName::new("m-lora"), parent: Some("m".into()) };
        s.engine.set_served(&[served("m"), served("m2"), lora]);
        advance(1).await;
        advance(1_000).await;
        let sent = s.router.sent();
        let synced = syncs(&sent);
        let aliases: Vec<_> = synced.iter().map(|s| s.model_aliases.clone()).collect();
        let named = ModelAliases::from([(ModelName::new("m2"), ModelName::new("m"))]);
        if takes {
            assert_eq!(aliases, [ModelAliases::new(), named], "{sent:?}");
        } else {
            assert_eq!(aliases, [ModelAliases::new()], "{sent:?}");
        }
        // The same names, m2 now an adapter: only the aliases changed.
        let m2_adapter = ServedModel { name: ModelName::new("m2"), parent: Some("m".into()) };
        let lora = ServedModel { name: ModelName::new("m-lora"), parent: Some("m".into()) };
        s.engine.set_served(&[served("m"), m2_adapter, lora]);
        advance(1_000).await;
        let synced = syncs(&s.router.sent()).len();
        assert_eq!(synced, if takes { 3 } else { 1 }, "takes {takes}: an alias gone is synced too");
        s.cancel.cancel();
    }
}

/// A router rolled back to a release before aliases (it refuses the field)
/// gets syncs without them, and registers the worker: the link kept sending
/// them, and every sync was refused for ever. Back after an outage, the
/// probe's ack says so; met at once, the refused sync is sent again without
/// them, not after a refusal's 30 s pause.
#[tokio::test(start_paused = true)]
async fn a_router_rolled_back_gets_syncs_without_aliases() {
    for outage in [true, false] {
        let s = start_with_alias().await;
        assert!(syncs(&s.router.sent()).last().is_some_and(|s| !s.model_aliases.is_empty()));
        *s.router.epoch.lock() = "r2".into();
        *s.router.takes_aliases.lock() = false;
        *s.router.refuses_aliases.lock() = true;
        if outage {
            *s.router.unreachable_left.lock() = 3;
        } else {
            s.state.require_sync(&RouterTarget("http://r".into()));
        }
        let before = syncs(&s.router.sent()).len();
        advance(5_000).await;
        let sent = s.router.sent();
        let after: Vec<_> = syncs(&sent).into_iter().skip(before).collect();
        assert!(!after.is_empty(), "outage {outage}: the rolled-back router has the worker");
        assert!(after.iter().all(|s| s.model_aliases.is_empty()), "{after:?}");
        s.cancel.cancel();
    }
}

/// A router whose acks say it takes aliases but which refuses a sync naming
/// them (a load-balanced address over two releases, a stricter check) has
/// them turned off for its epoch: the link does not swing between syncs
/// with and without them. Another refusal (a rotated token) is not taken
/// for one of aliases.
#[tokio::test(start_paused = true)]
async fn a_router_that_refuses_aliases_it_says_it_takes_gets_none_again() {
    let s = start_with_alias().await;
    *s.router.refuses_aliases.lock() = true;
    s.state.require_sync(&RouterTarget("http://r".into()));
    advance(20_000).await;
    let attempts = *s.router.sync_attempts.lock();
    assert!(attempts <= 4, "{attempts} sync attempts: swinging");
    assert!(syncs(&s.router.sent()).last().is_some_and(|s| s.model_aliases.is_empty()));
    s.cancel.cancel();

    let s = start_with_alias().await;
    *s.router.refuse_with.lock() = Some(401);
    s.state.require_sync(&RouterTarget("http://r".into()));
    let before = *s.router.sync_attempts.lock();
    advance(10_000).await;
    assert_eq!(*s.router.sync_attempts.lock() - before, 1, "a 401 waits the refusal's pause");
    s.cancel.cancel();
}

/// A failed delta to a router that takes aliases is repaired as any other:
/// no full sync, no alias map dropped.
#[tokio::test(start_paused = true)]
async fn a_failed_delta_with_aliases_is_repaired_without_a_sync() {
    let s = start_with_alias().await;
    let synced = syncs(&s.router.sent()).len();
    *s.router.failures_left.lock() = 1;
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(400).await;
    assert_eq!(*s.router.held.lock(), s.state.keys().into_iter().collect::<HashSet<_>>());
    assert_eq!(syncs(&s.router.sent()).len(), synced, "repaired, not resynced");
    s.cancel.cancel();
}

/// A router that is down (connections refused) is tried at least every half
/// second however long it stays down, so one that comes back is resynced
/// within about that; a router that answers with errors backs off further.
#[tokio::test(start_paused = true)]
async fn an_unreachable_router_is_retried_at_least_every_half_second() {
    let s = start();
    *s.router.unreachable_left.lock() = 12;
    advance(20_000).await;
    let attempts = s.router.attempts.lock().clone();
    assert!(attempts.len() > 12, "{} attempts", attempts.len());
    let gaps: Vec<Duration> = attempts.windows(2).take(12).map(|w| w[1] - w[0]).collect();
    // The pause, then at most one fast tick.
    assert!(gaps.iter().all(|g| *g <= RECONNECT_MAX + Duration::from_millis(100)), "{gaps:?}");
    assert!(gaps[4..].iter().all(|g| *g >= RECONNECT_MAX / 2), "still backing off: {gaps:?}");
    let sent = s.router.sent();
    let [Sent::Eviction(probe), Sent::Sync(_), ..] = sent.as_slice() else { panic!("{sent:?}") };
    assert!(probe.seq.is_none() && probe.stored_hashes.is_empty(), "an empty probe, then the sync: {probe:?}");
    // Knocked with the probe: the whole set was built for the first attempt
    // and for the one that reached the router, not for each of the 12.
    assert_eq!(*s.router.sync_attempts.lock(), 2);
    s.cancel.cancel();
}

/// A reset (engine gone, or events lost beyond replay) reaches the router
/// as a full sync at once, not at the next fast-path tick.
#[tokio::test(start_paused = true)]
async fn a_reset_is_synced_at_once() {
    let s = start();
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(130).await;
    let before = s.router.sent().len();
    let at = Instant::now();
    s.state.reset(Rank(0));
    advance(1).await;
    let log = s.router.log.lock().clone();
    let [(when, Sent::Sync(sync))] = &log[before..] else { panic!("{log:?}") };
    assert!(*when - at < Duration::from_millis(1), "sent {:?} after the reset", *when - at);
    assert!(sync.hashes.is_empty(), "the rank's keys are gone");
    s.cancel.cancel();
}

fn syncs(sent: &[Sent]) -> Vec<&SyncSnapshot> {
    sent.iter()
        .filter_map(|m| match m {
            Sent::Sync(s) => Some(s),
            Sent::Eviction(_) => None,
        })
        .collect()
}

/// Protocol v2: a push the router acked but lost is detected by the digest of
/// the next push (≤ one fast interval later), and the repair that heals it —
/// the current state of the recent deltas' keys, not the whole set — follows
/// in the same round.
#[tokio::test(start_paused = true)]
async fn a_lost_push_is_detected_at_the_next_push_and_repaired_at_once() {
    let s = start();
    advance(1).await;
    *s.router.lose_left.lock() = 1;
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(100).await;
    assert!(s.router.held.lock().is_empty(), "the batch carrying key 1 was lost");
    let lost_at = Instant::now();
    s.state.apply(Rank(0), &store(2, [2, 2, 2, 2]));
    advance(100).await;
    let log = s.router.log.lock().clone();
    let (healed_at, Sent::Eviction(repair)) = log.last().unwrap() else { panic!("{log:?}") };
    assert!(*healed_at - lost_at <= Duration::from_millis(100), "healed {:?} after the loss", *healed_at - lost_at);
    assert!(repair.stored_hashes.contains(&key([1, 1, 1, 1])), "{repair:?}");
    let want: HashSet<BlockKey> = s.state.keys().into_iter().collect();
    assert_eq!(*s.router.held.lock(), want);
    assert_eq!(s.state.metrics().digest_mismatches.get(), 1);
    assert_eq!(syncs(&s.router.sent()).len(), 1, "no full sync: only the registration");
    // In sync again: no more full syncs for the safety interval.
    advance(60_000).await;
    assert_eq!(syncs(&s.router.sent()).len(), 1, "no periodic sync within the safety interval");
    s.cancel.cancel();
}

/// When the repair does not bring the digests together either (here the
/// router misapplies it too), the whole key set follows at once.
#[tokio::test(start_paused = true)]
async fn a_failed_repair_is_followed_by_a_full_sync() {
    let s = start();
    advance(1).await;
    // The registration sync is seq 1; the delta (2) and its repair (3) are
    // misapplied.
    *s.router.misapply_seqs.lock() = vec![2, 3];
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(100).await;
    let sent = s.router.sent();
    let [.., Sent::Eviction(_), Sent::Sync(heal)] = &sent[..] else { panic!("{sent:?}") };
    assert_eq!(heal.digest, Some(s.state.digest()));
    assert_eq!(*s.router.held.lock(), s.state.keys().into_iter().collect::<HashSet<_>>());
    assert_eq!(s.state.metrics().digest_mismatches.get(), 2);
    s.cancel.cancel();
}

/// A delta that failed visibly (the router answered an error) is repaired
/// by the next push, not replaced by a full sync.
#[tokio::test(start_paused = true)]
async fn a_failed_delta_is_repaired_by_the_next_push() {
    let s = start();
    advance(1).await;
    *s.router.failures_left.lock() = 1;
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(400).await;
    assert_eq!(*s.router.held.lock(), s.state.keys().into_iter().collect::<HashSet<_>>());
    assert_eq!(syncs(&s.router.sent()).len(), 1, "only the registration sync");
    s.cancel.cancel();
}

/// A v2 sidecar and a router of the release before: the first push is
/// refused for its version; the link falls back to v1 bodies (no digest,
/// `as_of_ms`) and v1's periodic full syncs, and tries v2 again once the
/// router restarts (perhaps upgraded).
#[tokio::test(start_paused = true)]
async fn a_v1_router_gets_v1_bodies_and_periodic_syncs() {
    let router = FakeRouter::new();
    *router.v1_only.lock() = true;
    let s = start_with(router, WallClock::system());
    s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
    advance(12_000).await;
    let sent = s.router.sent();
    assert!(s.router.protocols.lock().iter().all(|p| *p == 1));
    assert_eq!(s.state.metrics().protocol_fallbacks.get(), 1);
    let all_syncs = syncs(&sent);
    assert!(all_syncs.len() >= 3, "a sync at start and every 5 s: {}", all_syncs.len());
    for sync in &all_syncs {
        assert!(sync.digest.is_none() && sync.covers.is_none() && sync.as_of_ms.is_some(), "{sync:?}");
    }
    for m in &sent {
        if let Sent::Eviction(b) = m {
            assert!(b.digest.is_none(), "a v1 router refuses unknown fields: {b:?}");
        }
    }
    // Upgraded and restarted: v2 again.
    *s.router.v1_only.lock() = false;
    *s.router.epoch.lock() = "r2".into();
    advance(1_000).await;
    assert_eq!(s.router.protocols.lock().last(), Some(&2));
    let last = s.router.sent();
    assert!(syncs(&last).last().is_some_and(|s| s.digest.is_some() && s.as_of_ms.is_none()));
    s.cancel.cancel();
}

/// No wall clock crosses the wire in v2: with the sidecar's clock ten
/// minutes off either way, its syncs name the router clock of the last ack
/// they follow (`covers`), never a time.
#[tokio::test(start_paused = true)]
async fn a_skewed_sidecar_clock_never_reaches_a_v2_router() {
    for skew_ms in [-600_000i64, 600_000] {
        let s = start_with(FakeRouter::new(), WallClock::skewed(skew_ms));
        advance(1).await;
        s.state.apply(Rank(0), &store(1, [1, 1, 1, 1]));
        advance(300).await;
        let acked_clock = *s.router.clock.lock();
        s.state.reset(Rank(0));
        advance(1).await;
        let sent = s.router.sent();
        let all = syncs(&sent);
        let [first, .., last] = &all[..] else { panic!("{all:?}") };
        assert_eq!(first.covers, None, "nothing acked before the first sync");
        assert_eq!(last.covers, Some(acked_clock), "the reset's sync covers the last ack");
        assert!(all.iter().all(|s| s.as_of_ms.is_none()), "no wall clock in v2");
        s.cancel.cancel();
    }
}
