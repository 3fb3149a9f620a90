//! The sidecar's own Prometheus metrics, served at `/metrics`.
//!
//! Every label set is bounded: event kinds, skip reasons, replay outcomes and
//! message kinds are closed enums, and `router` takes one value per router
//! address the sidecar pushes to (a handful).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::translate::SkipReason;

/// `kind` is one of `block_stored`, `block_removed`, `all_blocks_cleared`, `unknown`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// The replay covered the gap.
    Recovered,
    /// The engine's buffer no longer held the gap: cleared and resynced.
    Lost,
    /// The replay endpoint failed or timed out: cleared and resynced.
    Failed,
}

impl ReplayOutcome {
    pub const ALL: [ReplayOutcome; 3] = [ReplayOutcome::Recovered, ReplayOutcome::Lost, ReplayOutcome::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            ReplayOutcome::Recovered => "recovered",
            ReplayOutcome::Lost => "lost",
            ReplayOutcome::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum MessageKind {
    Eviction,
    Sync,
}

impl MessageKind {
    pub const ALL: [MessageKind; 2] = [MessageKind::Eviction, MessageKind::Sync];

    pub fn as_str(self) -> &'static str {
        match self {
            MessageKind::Eviction => "eviction",
            MessageKind::Sync => "sync",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PushLabels {
    pub router: String,
    pub kind: &'static str,
}

/// Counter handles the translator bumps on its hot path (fetched once, so no
/// family lookup per event).
#[derive(Clone, Debug, Default)]
pub struct TranslateCounters {
    pub stored: Counter,
    pub removed: Counter,
    pub cleared: Counter,
    pub unknown_events: Counter,
    pub unanchored_stores: Counter,
    pub offload_events: Counter,
    pub unknown_removals: Counter,
    pub block_size_mismatches: Counter,
    /// Stores of blocks already held, re-reported for a prefix hit.
    pub rereported_stores: Counter,
    /// Events about a KV-cache group other than 0 (hybrid models).
    pub other_group_events: Counter,
    skipped: [Counter; 5],
}

impl TranslateCounters {
    pub fn skipped(&self, reason: SkipReason) -> &Counter {
        let i = SkipReason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        &self.skipped[i]
    }
}

fn counter<L: Clone + std::hash::Hash + Eq>(family: &Family<L, Counter>, labels: &L) -> Counter {
    let guard = family.get_or_create(labels);
    guard.clone()
}

/// All of the sidecar's metrics and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    pub translate: TranslateCounters,
    pub decode_errors: Counter,
    pub unknown_fields: Counter,
    pub gaps: Counter,
    pub engine_restarts: Counter,
    pub disconnects: Counter,
    pub replays: Family<ReplayLabels, Counter>,
    pub pushes: Family<PushLabels, Counter>,
    pub push_failures: Family<PushLabels, Counter>,
    /// Acks that asked for a full sync because the digests differed (v2).
    pub digest_mismatches: Counter,
    /// Links that fell back to protocol v1 (an older router refused v2).
    pub protocol_fallbacks: Counter,
    pub tracked_blocks: Gauge,
    pub tracked_keys: Gauge,
    pub snapshot_dropped_blocks: Counter,
    pub snapshot_failures: Counter,
    pub snapshots_deferred: Counter,
    pub load_scrape_failures: Counter,
    pub engine_data_parallel_engines: Gauge,
    pub event_batches: Counter,
    pub events_silent: Gauge,
    pub silent_periods: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvroute_sidecar");
        let events = Family::<KindLabels, Counter>::default();
        let skipped = Family::<ReasonLabels, Counter>::default();
        // One statement per handle: a `get_or_create` guard lives to the end of
        // its statement, and a second creation in the same one would deadlock.
        let kind = |k: &'static str| counter(&events, &KindLabels { kind: k });
        let translate = TranslateCounters {
            stored: kind("block_stored"),
            removed: kind("block_removed"),
            cleared: kind("all_blocks_cleared"),
            unknown_events: kind("unknown"),
            skipped: SkipReason::ALL.map(|r| counter(&skipped, &ReasonLabels { reason: r.as_str() })),
            ..TranslateCounters::default()
        };
        registry.register("events", "KV-cache events received, by kind", events);
        registry.register("skipped_blocks", "Stored blocks that get no router key, by reason", skipped);
        registry.register(
            "unanchored_stores",
            "BlockStored events whose parent hash was never seen (skipped)",
            translate.unanchored_stores.clone(),
        );
        registry.register(
            "offload_events",
            "Events about a non-GPU medium (CPU offload tiers), ignored",
            translate.offload_events.clone(),
        );
        registry.register(
            "unknown_removals",
            "Removed block hashes that were not tracked (e.g. skipped blocks)",
            translate.unknown_removals.clone(),
        );
        registry.register(
            "block_size_mismatches",
            "BlockStored events whose block_size differs from the configured one",
            translate.block_size_mismatches.clone(),
        );
        registry.register(
            "rereported_stores",
            "BlockStored events re-reporting blocks already held (vLLM kv_cache_report_mode=full), not counted as new copies",
            translate.rereported_stores.clone(),
        );
        registry.register(
            "other_group_events",
            "Events of a KV-cache group other than 0 (hybrid models), ignored",
            translate.other_group_events.clone(),
        );
        let m = Metrics {
            registry,
            translate,
            decode_errors: Counter::default(),
            unknown_fields: Counter::default(),
            gaps: Counter::default(),
            engine_restarts: Counter::default(),
            disconnects: Counter::default(),
            replays: Family::default(),
            pushes: Family::default(),
            push_failures: Family::default(),
            digest_mismatches: Counter::default(),
            protocol_fallbacks: Counter::default(),
            tracked_blocks: Gauge::default(),
            tracked_keys: Gauge::default(),
            snapshot_dropped_blocks: Counter::default(),
            snapshot_failures: Counter::default(),
            snapshots_deferred: Counter::default(),
            load_scrape_failures: Counter::default(),
            engine_data_parallel_engines: Gauge::default(),
            event_batches: Counter::default(),
            events_silent: Gauge::default(),
            silent_periods: Counter::default(),
        };
        m.register_rest()
    }

    /// The push series of a router link, at 0 until its first push.
    pub fn init_router(&self, router: &str) {
        for kind in MessageKind::ALL {
            let labels = PushLabels { router: router.to_owned(), kind: kind.as_str() };
            let _ = counter(&self.pushes, &labels);
            let _ = counter(&self.push_failures, &labels);
        }
    }

    /// Removes a router address's series once it is gone: behind a headless
    /// service every router rollout brings new pod addresses, and the old
    /// ones' series stayed for the sidecar's life.
    pub fn retire_router(&self, router: &str) {
        for kind in MessageKind::ALL {
            let labels = PushLabels { router: router.to_owned(), kind: kind.as_str() };
            self.pushes.remove(&labels);
            self.push_failures.remove(&labels);
        }
    }

    fn register_rest(mut self) -> Self {
        let r = &mut self.registry;
        r.register("decode_errors", "ZMQ messages that could not be decoded", self.decode_errors.clone());
        r.register("unknown_fields", "Unknown fields in known events (ignored)", self.unknown_fields.clone());
        r.register("seq_gaps", "Gaps in the engine's batch sequence", self.gaps.clone());
        r.register("engine_restarts", "Sequence went backwards: engine restarted", self.engine_restarts.clone());
        r.register(
            "event_disconnects",
            "Times the engine's event stream was lost (then reconnected)",
            self.disconnects.clone(),
        );
        r.register("replays", "Replay attempts after a gap, by outcome", self.replays.clone());
        // Rated series exist at 0 from the start (dashboards and alerts rate
        // over them); a router's push series from its first link.
        for outcome in ReplayOutcome::ALL.map(ReplayOutcome::as_str).into_iter().chain(["idle_probe"]) {
            let _ = counter(&self.replays, &ReplayLabels { outcome });
        }
        r.register("pushes", "Messages a router applied, by router and kind", self.pushes.clone());
        r.register(
            "push_failures",
            "Messages a router did not apply (no answer, an error, or refused as stale or from a worker it does not \
             know), by router and kind",
            self.push_failures.clone(),
        );
        r.register(
            "digest_mismatches",
            "Acks asking for a full sync: the router's digest of this worker differed (protocol v2)",
            self.digest_mismatches.clone(),
        );
        r.register(
            "protocol_fallbacks",
            "Router links that fell back to protocol v1 (the router refused v2)",
            self.protocol_fallbacks.clone(),
        );
        r.register("tracked_blocks", "Engine blocks tracked (GPU, keyed)", self.tracked_blocks.clone());
        r.register("tracked_keys", "Distinct router keys currently held", self.tracked_keys.clone());
        r.register(
            "snapshot_dropped_blocks",
            "Blocks dropped because the engine snapshot no longer held them",
            self.snapshot_dropped_blocks.clone(),
        );
        r.register("snapshot_failures", "Engine snapshot requests that failed", self.snapshot_failures.clone());
        r.register(
            "snapshots_deferred",
            "Engine snapshots that would have dropped more than half a rank's blocks, held back until the next agreed",
            self.snapshots_deferred.clone(),
        );
        r.register("load_scrape_failures", "Engine /metrics scrapes that failed", self.load_scrape_failures.clone());
        r.register(
            "engine_data_parallel_engines",
            "Data-parallel engines the engine's /metrics lists (engine=\"N\"); more than this sidecar follows is \
             logged as an error",
            self.engine_data_parallel_engines.clone(),
        );
        r.register("event_batches", "KV-event batches received from the engine", self.event_batches.clone());
        r.register(
            "events_silent",
            "1 while the engine prefills but publishes no KV events (check --topic and the engine's --kv-events-config)",
            self.events_silent.clone(),
        );
        r.register(
            "silent_periods",
            "Times the engine prefilled for 10 s without publishing any KV event",
            self.silent_periods.clone(),
        );
        self
    }

    /// Renders the registry in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rated_series_exist_at_zero_from_the_start() {
        let m = Metrics::new();
        let text = m.render();
        for outcome in ["recovered", "lost", "failed", "idle_probe"] {
            let line = format!("kvroute_sidecar_replays_total{{outcome=\"{outcome}\"}} 0");
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        assert!(!text.contains("kvroute_sidecar_pushes_total{"), "push series before any router:\n{text}");
        m.init_router("http://r:8080");
        let text = m.render();
        for family in ["pushes", "push_failures"] {
            for kind in ["eviction", "sync"] {
                let line = format!("kvroute_sidecar_{family}_total{{router=\"http://r:8080\",kind=\"{kind}\"}} 0");
                assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
            }
        }
        m.retire_router("http://r:8080");
        assert!(!m.render().contains("router=\"http://r:8080\""), "a gone router's series stay:\n{}", m.render());
    }
}
