//! The router's Prometheus metrics. Every label set is bounded: worker ids
//! (at most `MAX_WORKERS`), policy and reason names, fixed outcome and event
//! kinds — never a prompt, an error string or a request id. Process metrics
//! (`process_*`, unprefixed as Prometheus names them) are read at each scrape
//! ([`crate::process_metrics`]).
//!
//! A removed worker's series are removed with it ([`Metrics::retire_worker`]),
//! and again at each refresh while anything that may still write them (an
//! in-flight request, a scrape's snapshot) holds the removed worker: ids come
//! and go (sidecar registrations), and their series must not pile up.

use std::borrow::Cow;
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::workers::{Worker, WorkerLive};

/// The `kind` labels of [`Metrics::index_worker_entries`].
pub const INDEX_KINDS: [&str; 3] = ["confirmed", "speculative", "approximate"];
/// The `kind` labels of [`Metrics::worker_engine_requests`].
pub const ENGINE_KINDS: [&str; 2] = ["running", "waiting"];
/// The `status` labels of [`Metrics::request_duration`].
pub const STATUS_CLASSES: [&str; 4] = ["2xx", "4xx", "5xx", "error"];
/// The status classes a first byte can have: the router relays an upstream's
/// answer only when it is a success or a client error (a 5xx is retried or
/// answered by the router itself).
pub const TTFT_STATUS_CLASSES: [&str; 2] = ["2xx", "4xx"];
/// The `kind` labels of [`Metrics::syncs`], created at 0 at start.
pub const SYNC_KINDS: [&str; 6] =
    ["applied", "stale", "rejected_block_size", "rejected_too_large", "digest_mismatch", "not_member"];
/// The `kind` labels of [`Metrics::events`], every one created at 0 at
/// start: an alert on `increase()` of a kind that appeared with its first
/// event (a `retries_stopped`, a `stalled`) missed that event.
pub const EVENT_KINDS: [&str; 14] = [
    "stored",
    "evicted",
    "cleared",
    "stale_batch",
    "digest_mismatch",
    "rejected_protocol",
    "rejected_too_large",
    "forbidden_push",
    "unauthorized_push",
    "unauthorized_report",
    "first_token_timeout",
    "stalled",
    "retries_stopped",
    "chat_template_fallback",
];
/// The `worker` label of requests refused before a worker was chosen.
pub const NO_WORKER: &str = kvroute_shared::wire::RESERVED_WORKER_ID;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerOutcome {
    pub worker: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerStatus {
    pub worker: String,
    /// One of [`STATUS_CLASSES`].
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabel {
    pub version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyReason {
    pub policy: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionOutcome {
    /// `sent` or `received`.
    pub direction: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerKind {
    pub worker: String,
    pub kind: &'static str,
}

/// First tokens: 5 ms to 5.5 min, past `first_token_timeout` (60 s, and 2 s
/// more a thousand uncached tokens): topped at 41 s, a TTFT nearing the
/// deadline showed as 41 s.
fn ttft_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 17))
}

/// Whole requests, from arrival to the answer's last byte: 10 ms to 87 min,
/// past `first_byte_timeout` (an hour for a non-streamed answer).
fn request_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 20))
}

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

#[derive(Debug)]
pub struct Metrics {
    pub registry: Registry,
    /// The `process_*` metrics, read at each scrape.
    process: Registry,
    pub requests: Family<WorkerOutcome, Counter>,
    pub decisions: Family<PolicyReason, Counter>,
    pub matched_ratio: Histogram,
    pub prompt_tokens: Counter,
    pub matched_tokens: Counter,
    pub index_keys: Gauge,
    pub index_entries: Gauge,
    pub index_worker_entries: Family<WorkerKind, Gauge>,
    pub events: Family<KindLabel, Counter>,
    pub syncs: Family<KindLabel, Counter>,
    pub worker_inflight: Family<WorkerLabel, Gauge>,
    pub worker_pending_tokens: Family<WorkerLabel, Gauge>,
    pub worker_replica_pending_tokens: Family<WorkerLabel, Gauge>,
    pub worker_engine_requests: Family<WorkerKind, Gauge>,
    pub worker_kv_usage: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub worker_pace: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub worker_free_blocks: Family<WorkerLabel, Gauge>,
    pub worker_healthy: Family<WorkerLabel, Gauge>,
    pub worker_tokenizer_mismatch: Family<WorkerLabel, Gauge>,
    pub worker_sync_age: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub worker_sync_timestamp: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub request_duration: HistFamily<WorkerStatus>,
    pub ttft: HistFamily<WorkerStatus>,
    pub routing_seconds: Histogram,
    pub tokenize_seconds: Histogram,
    /// Arrival to the first dispatch to a worker.
    pub dispatch_delay: Histogram,
    pub retries: Counter,
    pub shed: Counter,
    pub speculative_expired: Counter,
    pub ejections: Family<WorkerLabel, Counter>,
    pub replica_reports: Family<DirectionOutcome, Counter>,
    pub replicas_heard: Gauge,
    /// Load reports whose engine counted requests no router this one hears
    /// from sent ([`crate::policy::ForeignTraffic`]).
    pub foreign_reports: Counter,
    /// Every `outcome` label [`Metrics::request`] has used: the (worker,
    /// outcome) series a removed worker may have.
    outcomes: RwLock<Vec<&'static str>>,
    /// Removed workers whose series something may still write: the id, and
    /// the live figures every copy of that registration shares (gone once
    /// the last copy is dropped).
    departed: Mutex<Vec<(String, Weak<WorkerLive>)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics without a `policy` label (tests, tools).
    pub fn new() -> Self {
        Self::build(None)
    }

    /// The router's metrics: its request-duration and TTFT histograms carry
    /// `policy="<name>"` (one value per router process), so routers running
    /// different policies can be compared on one dashboard.
    pub fn for_policy(policy: &'static str) -> Self {
        Self::build(Some(policy))
    }

    fn build(policy: Option<&'static str>) -> Self {
        let mut registry = Registry::with_prefix("kvroute");
        // Process metrics keep their standard, unprefixed names.
        let mut process = Registry::default();
        process.register_collector(Box::new(crate::process_metrics::ProcessCollector));
        let build_info = Family::<VersionLabel, Gauge>::default();
        registry.register("build_info", "1, labelled with the router's version", build_info.clone());
        build_info.get_or_create(&VersionLabel { version: env!("CARGO_PKG_VERSION") }).set(1);
        let request_duration: HistFamily<WorkerStatus> = Family::new_with_constructor(request_histogram);
        let ttft: HistFamily<WorkerStatus> = Family::new_with_constructor(ttft_histogram);
        let per_request = match policy {
            Some(p) => registry.sub_registry_with_label((Cow::Borrowed("policy"), Cow::Borrowed(p))),
            None => &mut registry,
        };
        per_request.register(
            "upstream_ttft_seconds",
            "Time from dispatch to a streamed answer's first body byte (its first token)",
            ttft.clone(),
        );
        per_request.register(
            "request_duration_seconds",
            "Proxied requests from arrival to the answer's end, by worker (none: refused before one was chosen) \
             and status class",
            request_duration.clone(),
        );
        // Refusals before a worker is chosen are 4xx or 5xx; their series
        // exist from the start so a rate over them is never "no data".
        for status in ["4xx", "5xx"] {
            let _ = request_duration.get_or_create(&WorkerStatus { worker: NO_WORKER.into(), status });
        }
        let requests = Family::<WorkerOutcome, Counter>::default();
        registry.register(
            "requests",
            "Proxied attempts by worker and outcome: a retried request counts once for each worker tried \
             (request_duration_seconds counts each request once)",
            requests.clone(),
        );
        let decisions = Family::<PolicyReason, Counter>::default();
        registry.register("decisions", "Routing decisions by policy and reason", decisions.clone());
        // Every reason, labelled with this router's policy, exists at 0 before
        // the first decision: dashboards rate over series there from the start.
        if let Some(p) = policy {
            for r in crate::policy::Reason::ALL {
                let _ = decisions.get_or_create(&PolicyReason { policy: p, reason: r.as_str() });
            }
        }
        let matched_ratio = Histogram::new([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0]);
        registry.register(
            "matched_prefix_ratio",
            "Share of each request's prompt tokens cached on the chosen worker (per the index)",
            matched_ratio.clone(),
        );
        // Token-weighted, as vLLM's prefix_cache_hits / prefix_cache_queries
        // are: the histogram's mean weighs a 16-token turn as a 16k-token
        // document, and compared with the engine's ratio it raised the
        // stale-index alarm where nothing was wrong.
        let prompt_tokens = Counter::default();
        registry.register("prompt_tokens", "Prompt tokens of the requests routed", prompt_tokens.clone());
        let matched_tokens = Counter::default();
        registry.register(
            "matched_prompt_tokens",
            "Of the prompt tokens routed, those cached on the chosen worker (per the index)",
            matched_tokens.clone(),
        );
        let index_keys = Gauge::default();
        registry.register("index_keys", "Distinct block keys in the index", index_keys.clone());
        let index_entries = Gauge::default();
        registry.register("index_entries", "(key, worker) entries in the index", index_entries.clone());
        let index_worker_entries = Family::<WorkerKind, Gauge>::default();
        registry.register(
            "index_worker_entries",
            "Index entries per worker by kind (confirmed, speculative, approximate)",
            index_worker_entries.clone(),
        );
        let events = Family::<KindLabel, Counter>::default();
        registry.register(
            "events_applied",
            "Block events applied from sidecars' pushes, pushes and reports refused, and requests given up or \
             placed by their plain text, by kind",
            events.clone(),
        );
        let syncs = Family::<KindLabel, Counter>::default();
        registry.register("syncs", "Sidecar syncs by outcome", syncs.clone());
        // Series a dashboard or an alert rates over exist from the start at 0:
        // `rate()` of a series that appears with its first event misses that event.
        for kind in SYNC_KINDS {
            let _ = syncs.get_or_create(&KindLabel { kind });
        }
        for kind in EVENT_KINDS {
            let _ = events.get_or_create(&KindLabel { kind });
        }
        let worker_inflight = Family::<WorkerLabel, Gauge>::default();
        registry.register("worker_inflight", "Requests this router has in flight per worker", worker_inflight.clone());
        let worker_pending_tokens = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_pending_prefill_tokens",
            "Prompt tokens sent by this router and not yet past first token",
            worker_pending_tokens.clone(),
        );
        let worker_replica_pending_tokens = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_replica_pending_prefill_tokens",
            "Prompt tokens the other router replicas last reported sent there and not yet past first token",
            worker_replica_pending_tokens.clone(),
        );
        let worker_engine_requests = Family::<WorkerKind, Gauge>::default();
        registry.register(
            "worker_engine_requests",
            "vLLM's running / waiting requests as the sidecar last reported them",
            worker_engine_requests.clone(),
        );
        let worker_kv_usage = Family::<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register("worker_kv_usage", "vLLM's KV-cache usage (0..1) as last reported", worker_kv_usage.clone());
        let worker_pace = Family::<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "worker_pace",
            "Measured time to first token over the timing model's, on streamed answers with nothing queued \
             ahead (absent until 8 of them)",
            worker_pace.clone(),
        );
        let worker_free_blocks = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_free_blocks",
            "KV blocks the engine has never filled: its num_gpu_blocks less the blocks the index holds there \
             (absent until the engine's /metrics has been read, or if it does not publish num_gpu_blocks)",
            worker_free_blocks.clone(),
        );
        let worker_healthy = Family::<WorkerLabel, Gauge>::default();
        registry.register("worker_healthy", "1 when the worker takes traffic", worker_healthy.clone());
        let worker_tokenizer_mismatch = Family::<WorkerLabel, Gauge>::default();
        registry.register(
            "worker_tokenizer_mismatch",
            "1 when the worker's engine tokenizes a probe text (or chat) otherwise than the router: the router's \
             keys are not the engine's blocks; 0 when they agree; absent until compared",
            worker_tokenizer_mismatch.clone(),
        );
        let worker_sync_age = Family::<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "worker_last_sync_age_seconds",
            "Seconds since the worker's sidecar last synced (absent for workers without a sidecar)",
            worker_sync_age.clone(),
        );
        let worker_sync_timestamp = Family::<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "worker_last_sync_timestamp_seconds",
            "Unix time of the worker's sidecar's last full sync (absent for workers without a sidecar)",
            worker_sync_timestamp.clone(),
        );
        let routing_seconds = Histogram::new(exponential_buckets(0.000_002, 2.0, 16));
        registry.register(
            "routing_duration_seconds",
            "Time to match a tokenized request against the index and choose a worker (tokenizing: \
             kvroute_tokenize_duration_seconds)",
            routing_seconds.clone(),
        );
        // 20 µs to ~21 s: a short chat to a body of megabytes in a debug build.
        let tokenize_seconds = Histogram::new(exponential_buckets(0.000_02, 2.0, 21));
        registry.register(
            "tokenize_duration_seconds",
            "Time to parse, render, tokenize and key one request on the tokenizer pool (its wait for a \
             tokenizer slot not counted: kvroute_dispatch_delay_seconds has it)",
            tokenize_seconds.clone(),
        );
        // 50 µs to ~13 s: the router's own queueing before a worker sees the request.
        let dispatch_delay = Histogram::new(exponential_buckets(0.000_05, 2.0, 19));
        registry.register(
            "dispatch_delay_seconds",
            "Time from a request's arrival to its first dispatch to a worker: reading the body, rendering, \
             tokenizing, routing and waiting for admission (the router's own queueing)",
            dispatch_delay.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "retries",
            "Attempts retried on another worker before any byte reached the client",
            retries.clone(),
        );
        let shed = Counter::default();
        registry.register(
            "shed",
            "Requests refused with 503: at the concurrency limit, the cap on requests reading their bodies, or the in-flight body budget",
            shed.clone(),
        );
        let speculative_expired = Counter::default();
        registry.register(
            "speculative_expired",
            "Speculative entries expired unconfirmed",
            speculative_expired.clone(),
        );
        let ejections = Family::<WorkerLabel, Counter>::default();
        registry.register("worker_ejections", "Times a worker was ejected as unhealthy", ejections.clone());
        let replica_reports = Family::<DirectionOutcome, Counter>::default();
        registry.register(
            "replica_reports",
            "In-flight reports exchanged with other router replicas (full reports and news), by direction and outcome",
            replica_reports.clone(),
        );
        for outcome in crate::replicas::SENT_OUTCOMES {
            let _ = replica_reports.get_or_create(&DirectionOutcome { direction: "sent", outcome });
        }
        for outcome in crate::replicas::RECEIVED_OUTCOMES {
            let _ = replica_reports.get_or_create(&DirectionOutcome { direction: "received", outcome });
        }
        let replicas_heard = Gauge::default();
        registry.register(
            "replicas_heard",
            "Other router replicas whose in-flight report is recent enough to count",
            replicas_heard.clone(),
        );
        let foreign_reports = Counter::default();
        registry.register(
            "foreign_traffic_reports",
            "Load reports whose engine counted requests that neither this router nor a replica it hears from sent (another router, or clients bypassing the routers)",
            foreign_reports.clone(),
        );
        Metrics {
            registry,
            process,
            requests,
            decisions,
            matched_ratio,
            prompt_tokens,
            matched_tokens,
            index_keys,
            index_entries,
            index_worker_entries,
            events,
            syncs,
            worker_inflight,
            worker_pending_tokens,
            worker_replica_pending_tokens,
            worker_engine_requests,
            worker_kv_usage,
            worker_pace,
            worker_free_blocks,
            worker_healthy,
            worker_tokenizer_mismatch,
            worker_sync_age,
            worker_sync_timestamp,
            request_duration,
            ttft,
            routing_seconds,
            tokenize_seconds,
            dispatch_delay,
            retries,
            shed,
            speculative_expired,
            ejections,
            replica_reports,
            replicas_heard,
            foreign_reports,
            outcomes: RwLock::new(Vec::new()),
            departed: Mutex::new(Vec::new()),
        }
    }

    pub fn request(&self, worker: &str, outcome: &'static str) {
        self.note_outcome(outcome);
        self.requests.get_or_create(&WorkerOutcome { worker: worker.to_owned(), outcome }).inc();
    }

    /// Creates a worker's counters and histograms at 0 (ejections, TTFT,
    /// request durations, `ok` requests), so rates and quantiles over them
    /// exist from the worker's first scrape rather than its first request.
    /// Called at each refresh for every registered worker (a lookup when the
    /// series exist); [`Metrics::retire_worker`] removes them again.
    pub fn init_worker_series(&self, worker: &str) {
        let label = WorkerLabel { worker: worker.to_owned() };
        let _ = self.ejections.get_or_create(&label);
        for status in TTFT_STATUS_CLASSES {
            let _ = self.ttft.get_or_create(&WorkerStatus { worker: worker.to_owned(), status });
        }
        for status in STATUS_CLASSES {
            let _ = self.request_duration.get_or_create(&WorkerStatus { worker: worker.to_owned(), status });
        }
        self.note_outcome("ok");
        let _ = self.requests.get_or_create(&WorkerOutcome { worker: worker.to_owned(), outcome: "ok" });
    }

    /// Remembers an `outcome` label, so a removed worker's series with it are found.
    fn note_outcome(&self, outcome: &'static str) {
        if !self.outcomes.read().contains(&outcome) {
            let mut seen = self.outcomes.write();
            if !seen.contains(&outcome) {
                seen.push(outcome);
            }
        }
    }

    /// A request's end: how long it took and its status class.
    pub fn request_finished(&self, worker: &str, status: &'static str, seconds: f64) {
        self.request_duration.get_or_create(&WorkerStatus { worker: worker.to_owned(), status }).observe(seconds);
    }

    pub fn event(&self, kind: &'static str, n: usize) {
        debug_assert!(EVENT_KINDS.contains(&kind), "{kind} is not in EVENT_KINDS (created at 0)");
        self.events.get_or_create(&KindLabel { kind }).inc_by(n as u64);
    }

    pub fn sync(&self, kind: &'static str) {
        self.syncs.get_or_create(&KindLabel { kind }).inc();
    }

    /// A report sent to or received from another replica (`crate::replicas`).
    pub fn replica_report(&self, direction: &'static str, outcome: &'static str) {
        self.replica_reports.get_or_create(&DirectionOutcome { direction, outcome }).inc();
    }

    /// Removes a removed worker's series now, and again at each
    /// [`Metrics::sweep_departed`] until nothing can write them any more.
    pub fn retire_worker(&self, worker: &Worker) {
        self.forget_worker(worker.id.as_str());
        self.departed.lock().push((worker.id.to_string(), Arc::downgrade(&worker.live)));
    }

    /// Removes departed workers' series again (an in-flight request or a
    /// refresh from an older snapshot may have written them since) and lets
    /// go of those nothing holds any more. An id registered again
    /// (`is_registered`) owns its series from then on.
    pub fn sweep_departed(&self, is_registered: impl Fn(&str) -> bool) {
        self.departed.lock().retain(|(id, live)| {
            if is_registered(id) {
                return false;
            }
            // Read before removing: once no copy is left, nothing writes after.
            let gone = live.strong_count() == 0;
            self.forget_worker(id);
            !gone
        });
    }

    /// Removes every series labelled with this worker.
    fn forget_worker(&self, worker: &str) {
        let w = WorkerLabel { worker: worker.to_owned() };
        self.worker_inflight.remove(&w);
        self.worker_pending_tokens.remove(&w);
        self.worker_replica_pending_tokens.remove(&w);
        self.worker_kv_usage.remove(&w);
        self.worker_pace.remove(&w);
        self.worker_free_blocks.remove(&w);
        self.worker_healthy.remove(&w);
        self.worker_tokenizer_mismatch.remove(&w);
        self.worker_sync_age.remove(&w);
        self.worker_sync_timestamp.remove(&w);
        for status in TTFT_STATUS_CLASSES {
            self.ttft.remove(&WorkerStatus { worker: worker.to_owned(), status });
        }
        self.ejections.remove(&w);
        for status in STATUS_CLASSES {
            self.request_duration.remove(&WorkerStatus { worker: worker.to_owned(), status });
        }
        for kind in ENGINE_KINDS {
            self.worker_engine_requests.remove(&WorkerKind { worker: worker.to_owned(), kind });
        }
        for kind in INDEX_KINDS {
            self.index_worker_entries.remove(&WorkerKind { worker: worker.to_owned(), kind });
        }
        for &outcome in self.outcomes.read().iter() {
            self.requests.remove(&WorkerOutcome { worker: worker.to_owned(), outcome });
        }
    }

    pub fn encode(&self) -> String {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode_registry(&mut out, &self.process)
            .and_then(|()| encode_registry(&mut out, &self.registry))
            .and_then(|()| encode_eof(&mut out));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str) -> Arc<Worker> {
        Worker::for_test(id)
    }

    fn series_of(m: &Metrics, id: &str) -> usize {
        m.encode().lines().filter(|l| l.contains(&format!("worker=\"{id}\""))).count()
    }

    #[test]
    fn a_retired_worker_leaves_no_series_even_when_written_late() {
        let m = Metrics::new();
        let w = worker("gone");
        let label = WorkerLabel { worker: "gone".into() };
        m.request("gone", "ok");
        m.request_finished("gone", "2xx", 0.5);
        m.request_finished("gone", "error", 0.5);
        m.worker_sync_timestamp.get_or_create(&label).set(1.0);
        m.ttft.get_or_create(&WorkerStatus { worker: "gone".into(), status: "2xx" }).observe(0.1);
        m.ejections.get_or_create(&label).inc();
        m.worker_inflight.get_or_create(&label).set(1);
        m.worker_replica_pending_tokens.get_or_create(&label).set(1);
        m.index_worker_entries.get_or_create(&WorkerKind { worker: "gone".into(), kind: "confirmed" }).set(3);
        m.request("stays", "ok");
        m.retire_worker(&w);
        assert_eq!(series_of(&m, "gone"), 0, "{}", m.encode());
        // A request in flight on the removed worker finishes after its removal.
        m.request("gone", "broken_stream");
        m.request_finished("gone", "5xx", 0.5);
        m.sweep_departed(|_| false);
        assert_eq!(series_of(&m, "gone"), 0);
        let late = w.clone();
        drop(w);
        m.ttft.get_or_create(&WorkerStatus { worker: "gone".into(), status: "4xx" }).observe(0.2);
        drop(late);
        m.sweep_departed(|_| false);
        assert_eq!(series_of(&m, "gone"), 0);
        assert!(m.departed.lock().is_empty(), "nothing holds the worker: forgotten");
        assert!(series_of(&m, "stays") > 0);
    }

    #[test]
    fn rated_series_exist_at_zero_from_the_start_and_leave_with_their_worker() {
        let m = Metrics::new();
        let text = m.encode();
        for line in [
            "kvroute_syncs_total{kind=\"applied\"} 0",
            "kvroute_events_applied_total{kind=\"stored\"} 0",
            "kvroute_events_applied_total{kind=\"retries_stopped\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        m.init_worker_series("w1");
        let text = m.encode();
        for line in [
            "kvroute_worker_ejections_total{worker=\"w1\"} 0",
            "kvroute_requests_total{worker=\"w1\",outcome=\"ok\"} 0",
            "kvroute_upstream_ttft_seconds_count{worker=\"w1\",status=\"2xx\"} 0",
            "kvroute_request_duration_seconds_count{worker=\"w1\",status=\"5xx\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        m.retire_worker(&worker("w1"));
        assert_eq!(series_of(&m, "w1"), 0, "{}", m.encode());
    }

    #[test]
    fn every_decision_reason_exists_at_zero_for_the_policy() {
        let text = Metrics::for_policy("predicted_ttft").encode();
        for r in crate::policy::Reason::ALL {
            let line = format!("kvroute_decisions_total{{policy=\"predicted_ttft\",reason=\"{}\"}} 0", r.as_str());
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        let reasons: std::collections::BTreeSet<_> = crate::policy::Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(reasons.len(), crate::policy::Reason::ALL.len(), "a reason listed twice");
    }

    #[test]
    fn per_request_histograms_name_the_policy() {
        let m = Metrics::for_policy("round_robin");
        m.request_finished("w1", "2xx", 0.5);
        m.ttft.get_or_create(&WorkerStatus { worker: "w1".into(), status: "2xx" }).observe(0.1);
        let text = m.encode();
        for line in [
            "kvroute_request_duration_seconds_count{policy=\"round_robin\",worker=\"w1\",status=\"2xx\"} 1",
            "kvroute_upstream_ttft_seconds_count{policy=\"round_robin\",worker=\"w1\",status=\"2xx\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        // Other series do not repeat it.
        assert!(!text.contains("kvroute_build_info{policy"), "{text}");
        m.retire_worker(&worker("w1"));
        assert_eq!(series_of(&m, "w1"), 0, "{}", m.encode());
    }

    #[test]
    fn an_id_registered_again_keeps_its_series() {
        let m = Metrics::new();
        let w = worker("back");
        m.retire_worker(&w);
        m.request("back", "ok");
        m.sweep_departed(|id| id == "back");
        assert!(series_of(&m, "back") > 0);
        assert!(m.departed.lock().is_empty());
    }
}
