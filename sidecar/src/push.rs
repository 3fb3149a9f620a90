//! Pushing to one router: eviction deltas every fast interval, full syncs when
//! due, retries with exponential backoff and jitter.
//!
//! Protocol v2 (DESIGN.md §2): every push carries the digest of the whole key
//! set; a router whose own digest differs answers `resync`. The sidecar then
//! sends a *repair* at once — the current state of every key its last few
//! deltas touched, which heals a lost or misapplied delta whatever the
//! router made of it — and a full sync only if the digests still differ.
//! A delta that failed visibly (an error, a timeout) is repaired the same
//! way on the next push; a second failure in a row, or a failed sync, means
//! a full sync. Otherwise a link gets a full sync only at the safety
//! interval. A router that refuses version 2 (an older release) is spoken to
//! in version 1 — no digests, `as_of_ms`, a full sync every sync interval —
//! until it restarts (a new `router_epoch`), when version 2 is tried again.
//!
//! Failure handling keeps memory bounded: a failed message is never queued for
//! retry. The router's pending delta is dropped and it is marked for a full
//! sync, so the first message after recovery is the complete key set.
//!
//! The HTTP side is behind [`RouterClient`] so the timing logic can be tested
//! with a paused clock.

mod client;

pub use client::{HttpRouterClient, PushError, RouterClient, sync_timeout};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_shared::wire::{
    AckOutcome, EvictionBatch, InternalAck, Load, ModelAliases, PROTOCOL_VERSION, SyncSnapshot,
};
use kvroute_shared::{BlockSize, ModelName, WorkerId};
use rand::Rng;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use crate::engine::EngineView;
use crate::metrics::{MessageKind, PushLabels};
use crate::state::{RouterTarget, WorkerState};

/// How long the last batch may take at shutdown.
const FLUSH_DEADLINE: Duration = Duration::from_secs(1);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Retries after a router answered with an error, or timed out: each is a
/// full sync the router has to read, so they back off to this.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// An idle link still sends an empty batch this often: it is how a sidecar
/// learns that a router restarted (a new `router_epoch`) when no KV event
/// flows, and resyncs it at once instead of at the next periodic sync.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// Retries while a router cannot be connected to (restarting, say) back off
/// only to this: a refused connection costs the router nothing, and a
/// router that comes back after any downtime then hears from every sidecar
/// within this (jittered into its upper half) plus one fast tick — as soon
/// as a heartbeat would reach a router that restarted unnoticed.
const RECONNECT_MAX: Duration = HEARTBEAT;
/// The pause after a router refused a full sync as too large: it will until
/// its `max_sync_keys` is raised, and each attempt makes it read (up to its
/// internal body limit, 128 MiB) and decode the whole set first.
const TOO_LARGE_PAUSE: Duration = Duration::from_secs(30);
/// The pause after a router refused a push for what it is or who sent it
/// ([`PushError::refused`]): each retry is a full sync it reads and decodes
/// before refusing it again, from every sidecar, about once a second.
const REFUSED_PAUSE: Duration = Duration::from_secs(30);
/// The most a full sync that reached the router and failed (a 5xx: a full
/// worker table, a router shutting down; a timeout: a router too busy to
/// read it) waits before the next: its pause doubles from [`BACKOFF_MAX`]
/// per such failure in a row ([`failed_sync_pause`]). Paced at one a
/// second, every sidecar the router could not take sent it its whole key
/// set (19 MB at a million keys) each second, for as long as that lasted.
const FAILED_SYNC_MAX: Duration = Duration::from_secs(16);

/// The pause after the `n`-th full sync in a row that reached the router
/// and failed (before jitter).
fn failed_sync_pause(n: u32) -> Duration {
    BACKOFF_MAX.saturating_mul(1 << n.saturating_sub(1).min(5)).min(FAILED_SYNC_MAX)
}

/// Everything the per-router tasks share.
#[derive(Debug)]
pub struct Pusher {
    pub client: Arc<dyn RouterClient>,
    pub worker_id: WorkerId,
    pub advertise_url: String,
    /// The data-parallel rank this target is behind `advertise_url` (sent
    /// as the sync's `dp_rank`; its load is that rank's), if it is one.
    pub dp_rank: Option<u32>,
    pub block_size: BlockSize,
    pub engine: Arc<EngineView>,
    pub state: Arc<WorkerState>,
    pub fast_interval: Duration,
    /// Full syncs to a v2 router without a digest mismatch: the safety net
    /// against a bug that corrupts both digests alike (default 5 min).
    pub full_sync_interval: Duration,
    /// Full syncs to a v1 router (it cannot compare digests), as before v2.
    pub v1_sync_interval: Duration,
    /// The last seq sent, shared by every router's task: a task respawned
    /// (a router's address changed) continues the sequence instead of
    /// restarting at 0 under the same epoch, which routers would call stale.
    pub seq: AtomicU64,
}

/// What one round did.
enum Round {
    Idle,
    Sent(MessageKind, InternalAck),
}

/// Per-router connection state that lives in the task.
struct Link {
    target: RouterTarget,
    router_epoch: Option<String>,
    last_load: Option<Load>,
    last_sent: Option<tokio::time::Instant>,
    /// When the last full sync was accepted.
    last_sync: Option<tokio::time::Instant>,
    /// The protocol this link speaks: [`PROTOCOL_VERSION`], or 1 after the
    /// router refused it.
    protocol: u32,
    /// The router's causal clock from its last ack (v2): a sync read after
    /// it covers every speculative entry the router made up to it.
    router_clock: Option<u64>,
    /// The next push must be a repair (v2).
    repair_due: bool,
    /// The message in flight is a repair: if the digests still differ after
    /// it, only a full sync will do.
    repairing: bool,
    /// Failed messages since the last accepted one.
    failures: u32,
    /// The last attempt never reached the router (nothing listened).
    unreachable: bool,
    /// The model list the last sync named: routers take a worker's models
    /// only from syncs, so a new one (a LoRA adapter loaded) is synced at
    /// once rather than at the next full sync, minutes later, its requests
    /// answered "model does not exist" meanwhile.
    synced_models: Vec<ModelName>,
    /// The alias map the last sync named (empty to a router that does not
    /// take one).
    synced_aliases: ModelAliases,
    /// The router's last ack said it takes a sync's `model_aliases`
    /// (routers before the field refuse it).
    takes_aliases: bool,
    /// The router epoch that refused a sync naming aliases: its acks are not
    /// taken at their word (a load-balanced address mixing releases would
    /// have the link swing between syncs with and without them).
    aliases_refused_by: Option<String>,
}

impl Link {
    fn new(target: RouterTarget) -> Self {
        Link {
            target,
            router_epoch: None,
            last_load: None,
            last_sent: None,
            last_sync: None,
            protocol: PROTOCOL_VERSION,
            router_clock: None,
            repair_due: false,
            repairing: false,
            failures: 0,
            unreachable: false,
            synced_models: Vec::new(),
            synced_aliases: ModelAliases::new(),
            takes_aliases: false,
            aliases_refused_by: None,
        }
    }

    fn v2(&self) -> bool {
        self.protocol >= 2
    }

    /// What an ack from router `epoch` says of aliases: taken, unless that
    /// router refused a sync naming them.
    fn ack_aliases(&mut self, says: bool, epoch: &str) {
        self.takes_aliases = says && self.aliases_refused_by.as_deref() != Some(epoch);
    }

    /// The aliases a sync on this link names: none to a router that does
    /// not take them.
    fn aliases(&self, engine: &EngineView) -> ModelAliases {
        if self.takes_aliases { engine.aliases() } else { ModelAliases::new() }
    }
}

impl Pusher {
    async fn round(&self, link: &mut Link) -> Result<Round, (MessageKind, PushError)> {
        let load = self.engine.load_for(self.dp_rank);
        let every = if link.v2() { self.full_sync_interval } else { self.v1_sync_interval };
        let models = self.engine.models();
        // A router that says it takes aliases gets them at once (the first
        // sync went before its ack said so).
        let aliases = link.aliases(&self.engine);
        if link.last_sync.is_some_and(|t| t.elapsed() >= every)
            || (link.last_sync.is_some() && (models != link.synced_models || aliases != link.synced_aliases))
        {
            self.state.require_sync(&link.target);
        }
        if self.state.needs_sync(&link.target) {
            if link.unreachable {
                // Nothing listened last time: knock with an empty message
                // before copying the whole set under the state's lock and
                // serializing it (a million keys, 19 MB, every half second
                // for as long as a router was down). Its answer says only
                // that the router is there; the sync's says the rest.
                let probe = EvictionBatch {
                    worker_id: self.worker_id.clone(),
                    epoch: None,
                    seq: None,
                    evicted_hashes: Vec::new(),
                    stored_hashes: Vec::new(),
                    cleared: false,
                    load,
                    digest: None,
                };
                let ack = self
                    .client
                    .eviction(&link.target, &probe, link.protocol)
                    .await
                    .map_err(|e| (MessageKind::Eviction, e))?;
                link.unreachable = false;
                // A router back after an outage may be another release.
                link.ack_aliases(ack.model_aliases, &ack.router_epoch);
            }
            let aliases = link.aliases(&self.engine);
            let Some(content) = self.state.take_sync(&link.target) else {
                return Ok(Round::Idle);
            };
            let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
            let v2 = link.v2();
            let body = SyncSnapshot {
                worker_id: self.worker_id.clone(),
                epoch: Some(content.epoch.as_str().to_owned()),
                seq: Some(seq),
                as_of_ms: (!v2).then_some(content.as_of_ms),
                covers: if v2 { link.router_clock } else { None },
                digest: v2.then_some(content.digest),
                url: Some(self.advertise_url.clone()),
                dp_rank: self.dp_rank,
                models,
                model_aliases: aliases,
                block_size: Some(self.block_size),
                hashes: content.keys,
                load,
            };
            // The whole set replaces whatever a pending repair would mend.
            link.repair_due = false;
            let ack = self.client.sync(&link.target, &body, link.protocol).await.map_err(|e| (MessageKind::Sync, e))?;
            link.last_load = load;
            link.last_sent = Some(tokio::time::Instant::now());
            link.last_sync = link.last_sent;
            link.synced_models = body.models;
            link.synced_aliases = body.model_aliases;
            return Ok(Round::Sent(MessageKind::Sync, ack));
        }
        let repair = std::mem::take(&mut link.repair_due) && link.v2();
        let taken = if repair {
            match self.state.take_repair(&link.target) {
                Some(taken) => Some(taken),
                None => {
                    // Nothing remembered to repair with: the whole set, now.
                    self.state.require_sync(&link.target);
                    return Box::pin(self.round(link)).await;
                }
            }
        } else {
            self.state.take_delta(&link.target)
        };
        let Some((epoch, delta, digest)) = taken else {
            return Ok(Round::Idle);
        };
        let heartbeat_due = link.last_sent.is_none_or(|t| t.elapsed() >= HEARTBEAT);
        if !repair && delta.is_empty() && load == link.last_load && !heartbeat_due {
            return Ok(Round::Idle);
        }
        link.repairing = repair;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let body = EvictionBatch {
            worker_id: self.worker_id.clone(),
            epoch: Some(epoch.as_str().to_owned()),
            seq: Some(seq),
            evicted_hashes: delta.evicted,
            stored_hashes: delta.stored,
            cleared: delta.cleared,
            load,
            digest: link.v2().then_some(digest),
        };
        let ack =
            self.client.eviction(&link.target, &body, link.protocol).await.map_err(|e| (MessageKind::Eviction, e))?;
        link.last_load = load;
        link.last_sent = Some(tokio::time::Instant::now());
        Ok(Round::Sent(MessageKind::Eviction, ack))
    }

    fn labels(target: &RouterTarget, kind: MessageKind) -> PushLabels {
        PushLabels { router: target.0.clone(), kind: kind.as_str() }
    }

    /// Handles an accepted message; `true` when a sync must follow at once.
    fn on_ack(&self, link: &mut Link, kind: MessageKind, ack: InternalAck) -> bool {
        // Refused (stale, or from a worker the router does not know) is not
        // applied: a router that refused every push showed as healthy.
        let counted = match ack.outcome {
            AckOutcome::Applied => &self.state.metrics().pushes,
            AckOutcome::Stale | AckOutcome::UnknownWorker => &self.state.metrics().push_failures,
        };
        counted.get_or_create(&Self::labels(&link.target, kind)).inc();
        let restarted = link.router_epoch.as_ref().is_some_and(|e| *e != ack.router_epoch);
        link.ack_aliases(ack.model_aliases, &ack.router_epoch);
        link.router_epoch = Some(ack.router_epoch);
        link.router_clock = ack.clock;
        if restarted && !link.v2() {
            // Restarted, perhaps upgraded: try the current protocol again.
            link.protocol = PROTOCOL_VERSION;
            link.router_clock = None;
        }
        let was_repair = std::mem::take(&mut link.repairing);
        link.failures = 0;
        if ack.resync {
            self.state.metrics().digest_mismatches.inc();
            if was_repair || kind == MessageKind::Sync {
                debug!(router = %link.target.0, "the router's digest still differs: full sync now");
                self.state.require_sync(&link.target);
            } else {
                debug!(router = %link.target.0, "the router's digest differs: repairing now");
                link.repair_due = true;
            }
        }
        if ack.outcome == AckOutcome::Stale {
            warn!(router = %link.target.0, "the router called a push stale: continuing under a new epoch with a full sync");
            self.state.renew_epoch();
        }
        // A restarted router that has just taken a full sync holds the
        // whole set already (the usual first message after an outage).
        if (restarted && kind != MessageKind::Sync) || ack.outcome == AckOutcome::UnknownWorker {
            debug!(router = %link.target.0, restarted, "router needs a full sync");
            self.state.require_sync(&link.target);
        }
        link.repair_due || self.state.needs_sync(&link.target)
    }
}

/// Pushes to `target` until cancelled; `wake`, or a reset of the worker
/// state (`WorkerState::resync_due`), makes it act before its next tick.
pub async fn run_target(pusher: Arc<Pusher>, target: RouterTarget, wake: Arc<Notify>, cancel: CancellationToken) {
    pusher.state.metrics().init_router(&target.0);
    let mut link = Link::new(target);
    let mut tick = tokio::time::interval(pusher.fast_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resync = pusher.state.resync_due();
    let mut backoff = BACKOFF_MIN;
    // Full syncs in a row that the router at once asked to be followed by
    // another (an `unknown_worker`, `stale` or digest-mismatch answer to a
    // sync): past the first, each waits a backoff, so a router that never
    // accepts one gets a paced sync, not a storm of them.
    let mut refused_syncs = 0u32;
    let mut sync_backoff = BACKOFF_MIN;
    // Full syncs in a row that reached the router and failed.
    let mut failed_syncs = 0u32;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tick.tick() => {}
            _ = wake.notified() => {}
            Ok(()) = resync.changed() => {}
        }
        loop {
            match pusher.round(&mut link).await {
                Ok(Round::Idle) => break,
                Ok(Round::Sent(kind, ack)) => {
                    backoff = BACKOFF_MIN;
                    failed_syncs = 0;
                    link.unreachable = false;
                    let again = pusher.on_ack(&mut link, kind, ack);
                    if kind == MessageKind::Sync {
                        if again {
                            refused_syncs += 1;
                        } else {
                            (refused_syncs, sync_backoff) = (0, BACKOFF_MIN);
                        }
                    }
                    if !again {
                        break;
                    }
                    if kind == MessageKind::Sync && refused_syncs > 1 {
                        warn!(router = %link.target.0, refused_syncs, "the router asked for another full sync right after one: pacing them");
                        let pause = jitter(sync_backoff);
                        sync_backoff = (sync_backoff * 2).min(BACKOFF_MAX);
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(pause) => {}
                        }
                    }
                }
                Err((_, e)) if e.protocol_refused() && link.v2() => {
                    // An older router: speak its version from now on, with a
                    // full sync first (the refused push changed nothing).
                    warn!(router = %link.target.0, error = %kvroute_shared::logging::error_chain(&e), "the router refused wire protocol v{PROTOCOL_VERSION}: falling back to v1 on this link");
                    pusher.state.metrics().protocol_fallbacks.inc();
                    link.protocol = 1;
                    link.router_clock = None;
                    // Nor does a release before v2 take aliases.
                    link.takes_aliases = false;
                    pusher.state.require_sync(&link.target);
                }
                Err((kind, e)) => {
                    pusher.state.metrics().push_failures.get_or_create(&Pusher::labels(&link.target, kind)).inc();
                    link.failures += 1;
                    link.unreachable = e.nothing_sent();
                    link.repairing = false;
                    // The router may be restarting: its new clock starts
                    // again, and the old one named in the next sync's
                    // `covers` would drop its every speculative entry here.
                    link.router_clock = None;
                    // A router rolled back to a release that refuses the
                    // field answers a sync naming aliases with a 400 (one
                    // back after an outage says so to the probe first): the
                    // next sync goes without them, without the pause of a
                    // refusal, and its ack says whether to send them again.
                    let without_aliases =
                        kind == MessageKind::Sync && link.takes_aliases && e.field_refused("model_aliases");
                    if without_aliases {
                        link.takes_aliases = false;
                        link.aliases_refused_by = link.router_epoch.clone();
                    }
                    if link.v2() && kind == MessageKind::Eviction && link.failures == 1 {
                        // One lost delta: the next push repairs it (its keys
                        // are among the recent ones); the digest checks that.
                        warn!(router = %link.target.0, error = %kvroute_shared::logging::error_chain(&e), "push failed; next message repairs it");
                        link.repair_due = true;
                    } else {
                        warn!(router = %link.target.0, error = %kvroute_shared::logging::error_chain(&e), "push failed; next message is a full sync");
                        link.repair_due = false;
                        pusher.state.require_sync(&link.target);
                    }
                    let cap = if e.nothing_sent() { RECONNECT_MAX } else { BACKOFF_MAX };
                    let mut pause = jitter(backoff.min(cap));
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    if without_aliases {
                        warn!(router = %link.target.0, error = %kvroute_shared::logging::error_chain(&e), "the router refused a sync naming model aliases (a release before them?): syncing without them");
                    } else if kind == MessageKind::Sync && e.too_large() {
                        let (_, keys) = pusher.state.counts();
                        error!(router = %link.target.0, keys, pause_secs = TOO_LARGE_PAUSE.as_secs(), "the router refuses this worker's key set as too large: raise its max_sync_keys (and max_internal_body_bytes) above the engine's KV blocks; retrying after a pause");
                        pause = TOO_LARGE_PAUSE;
                    } else if e.refused() {
                        error!(router = %link.target.0, error = %kvroute_shared::logging::error_chain(&e), pause_secs = REFUSED_PAUSE.as_secs(), "the router refuses this sidecar's pushes: its configuration or token must change (the error says what); retrying after a pause");
                        pause = REFUSED_PAUSE;
                    } else if kind == MessageKind::Sync && !e.nothing_sent() {
                        failed_syncs += 1;
                        pause = jitter(failed_sync_pause(failed_syncs));
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    break;
                }
            }
        }
    }
    // Shutdown: one last delta, if the router is in a state to take one.
    if !pusher.state.needs_sync(&link.target) {
        let _ = tokio::time::timeout(FLUSH_DEADLINE, pusher.round(&mut link)).await;
    }
}

/// Full jitter over the upper half: spreads retries of many sidecars.
///
/// Hand-written rather than `backon` (issue 15): this is not one call retried
/// until it succeeds but a long-lived push loop whose next message changes
/// after a failure (a repair, or a full sync), whose pause cap depends on
/// whether anything was sent (`RECONNECT_MAX` vs `BACKOFF_MAX`), and whose
/// sleep races cancellation; `backon` would replace these three lines and
/// not the loop around them.
fn jitter(base: Duration) -> Duration {
    let half = base / 2;
    half + half.mul_f64(rand::thread_rng().r#gen::<f64>())
}

#[cfg(test)]
mod tests;
