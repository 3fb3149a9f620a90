//! The slow loop, every sync interval: anti-entropy against the engine's own
//! snapshot (when the python hook is configured) and re-resolution of router
//! addresses (starting and stopping one push task per address). Periodic full
//! syncs are each push task's own business (`push`): a v2 router gets one
//! only on a digest mismatch or at the safety interval.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::push::{self, Pusher};
use crate::routers;
use crate::snapshot;
use crate::state::{RouterTarget, WorkerState};
use crate::translate::{Rank, Reconciled};

/// How long push tasks get to flush at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long the first push waits for the engine's replay buffer to be read
/// (`WorkerState::caught_up`): a replay is bounded by 5 s, and an engine
/// whose event endpoint does not answer (the connection comes before the
/// replay) must not keep its worker unregistered for ever.
const CATCH_UP_WAIT: Duration = Duration::from_secs(6);

struct Task {
    cancel: CancellationToken,
    wake: Arc<Notify>,
    handle: JoinHandle<()>,
}

#[derive(Debug)]
pub struct Supervisor {
    pub router_urls: Vec<String>,
    /// Per rank: its snapshot endpoint, and the port its events come from
    /// (a snapshot naming another is another engine's).
    pub snapshot_endpoints: Vec<(Rank, String, u32)>,
    pub sync_interval: Duration,
    pub pusher: Arc<Pusher>,
    pub state: Arc<WorkerState>,
}

impl Supervisor {
    pub async fn run(self, cancel: CancellationToken) {
        // The first sync carries what the engine cached before this sidecar
        // started: sent before the replay, it would register the worker
        // empty (or wipe what a router kept from this sidecar's previous
        // run), and the set would follow in deltas.
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(CATCH_UP_WAIT, self.state.caught_up()) => {
                if r.is_err() {
                    warn!("the engine's events were not caught up within {CATCH_UP_WAIT:?}: pushing what is known");
                }
            }
        }
        let mut tasks: BTreeMap<RouterTarget, Task> = BTreeMap::new();
        let mut resolved: HashMap<String, Vec<RouterTarget>> = HashMap::new();
        let mut deferred = HashSet::new();
        let mut tick = tokio::time::interval(self.sync_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tick.tick() => {}
            }
            self.anti_entropy(&mut deferred).await;
            for url in &self.router_urls {
                match routers::resolve(url).await {
                    Ok(targets) => {
                        resolved.insert(url.clone(), targets);
                    }
                    // Keep the last good addresses through a DNS hiccup.
                    Err(e) => warn!(error = %e, "router resolution failed"),
                }
            }
            let mut targets: Vec<RouterTarget> = resolved.values().flatten().cloned().collect();
            targets.sort();
            targets.dedup();
            self.state.set_routers(&targets);
            let gone: Vec<RouterTarget> = tasks.keys().filter(|t| !targets.contains(t)).cloned().collect();
            for t in gone {
                let Some(task) = tasks.remove(&t) else { continue };
                info!(router = %t.0, "router address gone");
                task.cancel.cancel();
                // Its series go once its task has ended: a push still in
                // flight would count again, and bring them back for good;
                // not if the address has come back meanwhile (a new task
                // counts on them).
                let state = self.state.clone();
                tokio::spawn(async move {
                    let _ = task.handle.await;
                    if !state.has_router(&t) {
                        state.metrics().retire_router(&t.0);
                    }
                });
            }
            for t in &targets {
                // A push task that ended (a panic: it returns only when
                // cancelled) is started again: kept, its router was never
                // pushed to again.
                if tasks.get(t).is_some_and(|task| task.handle.is_finished()) {
                    tracing::error!(router = %t.0, "the push task to this router ended: starting it again");
                    tasks.remove(t);
                }
                tasks.entry(t.clone()).or_insert_with(|| self.spawn(t.clone(), &cancel));
            }
            tasks.values().for_each(|t| t.wake.notify_one());
        }
        for task in tasks.values() {
            task.cancel.cancel();
        }
        for (_, task) in tasks {
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, task.handle).await;
        }
    }

    fn spawn(&self, target: RouterTarget, parent: &CancellationToken) -> Task {
        info!(router = %target.0, "pushing to router");
        let cancel = parent.child_token();
        let wake = Arc::new(Notify::new());
        let span = info_span!("push", router = %target.0);
        let handle =
            tokio::spawn(push::run_target(self.pusher.clone(), target, wake.clone(), cancel.clone()).instrument(span));
        Task { cancel, wake, handle }
    }

    /// Drops blocks the engine no longer holds, per rank. `deferred`: the
    /// ranks whose last snapshot would have dropped most of their blocks.
    async fn anti_entropy(&self, deferred: &mut HashSet<Rank>) {
        for (rank, endpoint, events_port) in &self.snapshot_endpoints {
            self.state.begin_snapshot();
            match snapshot::fetch(endpoint, Some(*events_port)).await {
                Ok(held) => match self.state.reconcile(*rank, &held, deferred.contains(rank)) {
                    Reconciled::Dropped(dropped) => {
                        deferred.remove(rank);
                        if dropped > 0 {
                            info!(rank = rank.0, dropped, "engine snapshot dropped stale blocks");
                        }
                    }
                    Reconciled::Deferred { would_drop, tracked } => {
                        deferred.insert(*rank);
                        self.state.metrics().snapshots_deferred.inc();
                        warn!(
                            rank = rank.0,
                            would_drop,
                            tracked,
                            "the engine's snapshot would drop most of the blocks its events reported: \
                             held back until the next snapshot agrees"
                        );
                    }
                },
                Err(e) => {
                    self.state.metrics().snapshot_failures.inc();
                    warn!(rank = rank.0, error = %e, "engine snapshot failed");
                }
            }
        }
    }
}
