//! Router replicas tell each other what they have in flight on each worker.
//!
//! A replica knows its own pending prefill exactly, but another replica's
//! only as the engine's waiting count, reported once a second, priced at its
//! own mean uncached size; a prefill already running there it does not see
//! at all. In the lab that costs 3 replicas about a fifth of their TTFT
//! (BENCHMARKS.md, "what router replicas do not know"). So every
//! `replica_exchange_interval` (100 ms) each replica POSTs to each configured
//! replica, at [`REPLICA_PATH`], a [`ReplicaReport`]: per worker, its own
//! pending prefill tokens and in-flight requests, and the prefixes it has
//! just sent where ([`prefixes`]). The other answers with its
//! own report, so one configured link exchanges both ways; listing every
//! other replica on every replica works too, and so does the same list on
//! every replica, itself included (a replica recognises its own report by
//! its epoch and stops sending there). A URL's host stands for every address
//! it resolves to, re-resolved every [`RESOLVE_EVERY`]: in Kubernetes, the
//! routers' headless service names every replica.
//!
//! Between those full reports, a replica that routes a request tells the
//! others its new per-worker figures as soon as `replica_news_interval`
//! (10 ms) has passed since its last report there: a report marked
//! `loads_only`, without the `sent` list, answered the same way. While
//! either end of a link has anything in flight, news goes every interval,
//! so the answers bring the other end's news back: one link per pair
//! suffices for news too. A burst of one new prefix or a wave of chat
//! turns reaches every replica within a few requests instead of within
//! 100 ms; in the lab that cut 3 replicas' TTFT by 6 % at p50 and 13 % at
//! p99 (4 and 16 workers), 13 % and 20 % at 64 workers (BENCHMARKS.md,
//! "News between the replicas' reports"). The prefixes wait for the full
//! report: each one received rebuilds the prefix hints, too dear to do a
//! hundred times a second per replica (and rebuilds are spaced by
//! [`MIN_HINTS_REBUILD_GAP`] and bounded by [`MAX_HINT_KEYS`] whatever
//! the reports).
//!
//! What a replica heard from the others is added to its own figures when it
//! routes (`WorkerLive::load`): their pending tokens to its pending prefill,
//! their in-flight requests to its count of the engine's requests that a
//! router accounts for, and a prefix one of them just sent to a worker
//! counts as sent there (`routing.rs`). A report is full state, not a delta: the newest one
//! from a replica replaces the last, a lost one costs nothing, and a
//! replica not heard from for [`Replicas::expiry`] is forgotten (one that
//! died took its requests with it).
//!
//! Replicas authenticate with the shared internal token (a worker's own
//! token from `worker_tokens_file` may not speak for a router). Reports are
//! bounded: at most [`MAX_REPLICAS`] replicas heard at once, [`MAX_WORKERS`]
//! workers per report, [`MAX_REPORT_BODY_BYTES`], and figures no larger
//! than a router can have.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use kvroute_shared::body::read_within;
use kvroute_shared::wire::{DecodeError, Validate, decode_valid, validate_worker_id};
use kvroute_shared::{BlockKey, WorkerId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tracing::Instrument;

use crate::error::RouterError;
use crate::index::MAX_WORKERS;
use crate::proxy::read_in_time;
use crate::state::{AppState, now_ms};
use crate::workers::Worker;

pub mod prefixes;
pub use prefixes::{PrefixHints, SentPrefix};

/// Where replicas send their reports.
pub const REPLICA_PATH: &str = "/internal/replica";
/// Largest report accepted: [`MAX_WORKERS`] load entries of ~200 bytes and
/// [`MAX_SENT`] requests of at most [`prefixes::MAX_SAMPLED_KEYS`] keys of
/// 19 bytes (about 35 keys in practice).
pub const MAX_REPORT_BODY_BYTES: usize = 4 << 20;
/// Other replicas (distinct epochs) remembered at once; past it a new one
/// is refused until one expires.
pub const MAX_REPLICAS: usize = 64;
/// Pending prefill tokens one report may give for one worker: a router
/// holds at most `max_concurrent_requests` prompts of `max_prompt_tokens`,
/// far below this; larger figures are forged or corrupt.
pub const MAX_REPORTED_PENDING_TOKENS: u64 = 1 << 40;

/// Requests one report names in `sent` at most (the newest).
pub const MAX_SENT: usize = 1024;
/// Sampled keys the prefix hints hold at most, over every replica heard:
/// three busy replicas name about 100,000 ([`MAX_SENT`] requests of ~35
/// keys each). Past it the rest of the reports' requests give no hint, so
/// no set of reports, however many replicas send them, makes a rebuild
/// cost more than a few milliseconds.
pub const MAX_HINT_KEYS: usize = 1 << 18;
/// The prefix hints are rebuilt at most this often, and never sooner than
/// ten times the last rebuild took after it: a report arriving in between
/// is taken at once, its prefixes at the next publish past the gap (the
/// next report, news or the exchange tick). A few a second per busy replica
/// are taken (about 40 a second with 3 replicas), so however fast reports
/// arrive, rebuilding costs a router at most a tenth of a core.
pub const MIN_HINTS_REBUILD_GAP: Duration = Duration::from_millis(10);

/// How long a request stays in `sent` after its first token: until the
/// sidecar's report of its stored blocks has reached every replica (100 ms
/// batches, and the push itself).
pub const SENT_LINGER_MS: u64 = 1_000;

/// Is a request still named in reports at `now_ms`: not yet past its first
/// token (`done_ms` `None`), or past it less than [`SENT_LINGER_MS`] ago?
/// (The router's and the lab's sent logs both ask this.)
pub fn still_reported(done_ms: Option<u64>, now_ms: u64) -> bool {
    done_ms.is_none_or(|d| now_ms.saturating_sub(d) < SENT_LINGER_MS)
}

/// One replica's figures, `POST`ed to another and answered with the other's.
/// Unknown fields are ignored, so replicas of two releases keep exchanging
/// during a rolling upgrade.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// The sender's `router_epoch`: random per process start.
    pub router_epoch: String,
    /// Increases with every report the sender makes (to any replica).
    pub seq: u64,
    /// Workers where the sender has anything in flight; any other worker
    /// is 0.
    #[serde(default)]
    pub workers: Vec<ReplicaLoad>,
    /// The requests the sender has sent and not yet seen a first token of,
    /// or saw one less than [`SENT_LINGER_MS`] ago: where each went, and
    /// its prompt's sampled block keys ([`prefixes`]).
    #[serde(default)]
    pub sent: Vec<SentPrefix>,
    /// News between full reports: `workers` is complete, `sent` empty, and
    /// the sender's requests are as its last full report named them. (A
    /// replica of an earlier release takes it as a full report naming no
    /// requests, and forgets the sender's prefixes until its next full one.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub loads_only: bool,
}

/// One worker's figures in a [`ReplicaReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaLoad {
    pub id: WorkerId,
    /// Prompt tokens the sender sent there, not yet past first token.
    pub pending_prefill_tokens: u64,
    /// Requests the sender has in flight there.
    pub inflight: u32,
}

impl Validate for ReplicaReport {
    fn validate(&self) -> Result<(), DecodeError> {
        if self.router_epoch.is_empty() || self.router_epoch.len() > 64 {
            return Err(DecodeError::new("router_epoch", "must be 1 to 64 bytes"));
        }
        if self.workers.len() > MAX_WORKERS {
            return Err(DecodeError::new("workers", format!("at most {MAX_WORKERS} entries")));
        }
        let mut seen = std::collections::HashSet::with_capacity(self.workers.len());
        for (i, w) in self.workers.iter().enumerate() {
            validate_worker_id(&w.id).map_err(|e| DecodeError::new(format!("workers[{i}].id"), e.message))?;
            if !seen.insert(&w.id) {
                return Err(DecodeError::new(format!("workers[{i}].id"), format!("{} appears twice", w.id)));
            }
            if w.pending_prefill_tokens > MAX_REPORTED_PENDING_TOKENS {
                return Err(DecodeError::new(
                    format!("workers[{i}].pending_prefill_tokens"),
                    format!("at most {MAX_REPORTED_PENDING_TOKENS}"),
                ));
            }
        }
        if self.loads_only && !self.sent.is_empty() {
            return Err(DecodeError::new("sent", "a loads_only report names no requests"));
        }
        if self.sent.len() > MAX_SENT {
            return Err(DecodeError::new("sent", format!("at most {MAX_SENT} entries")));
        }
        for (i, sent) in self.sent.iter().enumerate() {
            validate_worker_id(&sent.worker).map_err(|e| DecodeError::new(format!("sent[{i}].worker"), e.message))?;
            if sent.keys.len() > prefixes::MAX_SAMPLED_KEYS {
                return Err(DecodeError::new(
                    format!("sent[{i}].keys"),
                    format!("at most {} sampled keys", prefixes::MAX_SAMPLED_KEYS),
                ));
            }
        }
        Ok(())
    }
}

/// What became of a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// That replica's newest: it replaces what it said before.
    Applied,
    /// Not newer than the last one from that replica (reordered): dropped.
    Stale,
    /// This router's own report, come back (it was listed as a replica of
    /// itself).
    OwnEcho,
    /// [`MAX_REPLICAS`] others are heard already: refused.
    Full,
}

impl Heard {
    pub fn as_str(self) -> &'static str {
        match self {
            Heard::Applied => "applied",
            Heard::Stale => "stale",
            Heard::OwnEcho => "self",
            Heard::Full => "full",
        }
    }
}

/// The `outcome` labels of received reports, created at 0 at start.
pub const RECEIVED_OUTCOMES: [&str; 4] = ["applied", "stale", "self", "full"];
/// The `outcome` labels of sent reports: answered, failed (network, status
/// or body), or answered by this router itself.
pub const SENT_OUTCOMES: [&str; 3] = ["ok", "error", "self"];

#[derive(Debug)]
struct Latest {
    /// The newest report's, full or news.
    seq: u64,
    at: Instant,
    workers: Vec<ReplicaLoad>,
    /// The seq of the full report `sent` came from: news (a later seq) can
    /// overtake a full report on the wire, and that report's `sent` is
    /// still newer than the one kept.
    sent_seq: u64,
    /// Shared, so a rebuild reads it after the lock is let go.
    sent: Arc<Vec<SentPrefix>>,
}

/// A request this router sent, as its reports name it until
/// [`SENT_LINGER_MS`] after its first token.
#[derive(Debug)]
pub struct SentEntry {
    prefix: SentPrefix,
    /// Unix ms of its first token (or of its end without one); 0 before.
    done_ms: AtomicU64,
}

impl SentEntry {
    /// Its first token came (or it ended without one) at `now_ms`.
    pub fn done(&self, now_ms: u64) {
        let _ = self.done_ms.compare_exchange(0, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Its worker failed it before any answer (it is retried elsewhere, or
    /// failed): no longer named from the next report on.
    pub fn abandon(&self) {
        self.done_ms.store(1, Ordering::Relaxed);
    }
}

/// What the other replicas last said, by their epoch.
#[derive(Debug)]
pub struct Replicas {
    heard: Mutex<HashMap<String, Latest>>,
    /// What the others' `sent` lists say, rebuilt when they change
    /// (`hints_stale`: a report was taken since the last rebuild), no
    /// sooner than `next_rebuild` ([`MIN_HINTS_REBUILD_GAP`]); held while a
    /// rebuild runs, so two never race to store theirs.
    hints: ArcSwap<PrefixHints>,
    hints_stale: AtomicBool,
    next_rebuild: Mutex<Option<Instant>>,
    /// This router's own recent requests, oldest first, kept once it
    /// exchanges reports with anyone (`exchanging`).
    sent: Mutex<VecDeque<Arc<SentEntry>>>,
    exchanging: AtomicBool,
    /// `heard.len()` as of the last publish, read without the lock.
    heard_count: AtomicUsize,
    /// Counts the requests this router has routed while exchanging: the
    /// exchange tasks wake on it to send news.
    routed: tokio::sync::watch::Sender<u64>,
    seq: AtomicU64,
    /// A replica not heard from for this long is forgotten.
    pub expiry: Duration,
}

impl Replicas {
    /// Forgets a replica after 10 exchange periods without a report, and never
    /// sooner than 1 s (a busy replica's report may be late).
    pub fn new(interval: Duration) -> Replicas {
        Replicas {
            heard: Mutex::new(HashMap::new()),
            hints: ArcSwap::from_pointee(PrefixHints::default()),
            hints_stale: AtomicBool::new(false),
            next_rebuild: Mutex::new(None),
            sent: Mutex::new(VecDeque::new()),
            exchanging: AtomicBool::new(false),
            heard_count: AtomicUsize::new(0),
            routed: tokio::sync::watch::Sender::new(0),
            seq: AtomicU64::new(0),
            expiry: (interval * 10).max(Duration::from_secs(1)),
        }
    }

    /// Takes another replica's report, unless it is this router's own
    /// (`own_epoch`), older than what that replica said last, or from one
    /// replica too many.
    pub fn hear(&self, report: ReplicaReport, own_epoch: &str, now: Instant) -> Heard {
        if report.router_epoch == own_epoch {
            return Heard::OwnEcho;
        }
        let mut heard = self.heard.lock();
        let before = heard.len();
        heard.retain(|_, l| now.saturating_duration_since(l.at) < self.expiry);
        if heard.len() < before {
            self.hints_stale.store(true, Ordering::Relaxed);
        }
        let full = heard.len() >= MAX_REPLICAS;
        // News names no prefixes: a replica first heard by its news has none yet.
        let sent_seq = if report.loads_only { 0 } else { report.seq };
        let latest =
            Latest { seq: report.seq, at: now, workers: report.workers, sent_seq, sent: Arc::new(report.sent) };
        match heard.get_mut(&report.router_epoch) {
            Some(l) if report.loads_only && latest.seq <= l.seq => Heard::Stale,
            Some(l) if report.loads_only => {
                (l.seq, l.at, l.workers) = (latest.seq, latest.at, latest.workers);
                Heard::Applied
            }
            Some(l) if latest.seq <= l.sent_seq => Heard::Stale,
            Some(l) => {
                // Overtaken by news: its figures are older than those kept,
                // its prefixes newer.
                if latest.seq > l.seq {
                    (l.seq, l.at, l.workers) = (latest.seq, latest.at, latest.workers);
                }
                (l.sent_seq, l.sent) = (latest.sent_seq, latest.sent);
                self.hints_stale.store(true, Ordering::Relaxed);
                Heard::Applied
            }
            None if full => Heard::Full,
            None => {
                heard.insert(report.router_epoch, latest);
                self.hints_stale.store(true, Ordering::Relaxed);
                Heard::Applied
            }
        }
    }

    /// Forgets silent replicas and stores the sum of what the others said
    /// into each of `workers`' live figures (a worker none named gets 0),
    /// and rebuilds the prefix hints from their `sent` lists when they
    /// changed and [`MIN_HINTS_REBUILD_GAP`] allows. Returns how many
    /// replicas are heard. The figures are written under the lock that
    /// reports are taken under, so two publishes cannot interleave; the
    /// hints are built after it is let go, so reports are not held up.
    pub fn publish(&self, workers: &[Arc<Worker>], now: Instant) -> usize {
        let mut heard = self.heard.lock();
        let before = heard.len();
        heard.retain(|_, l| now.saturating_duration_since(l.at) < self.expiry);
        if heard.len() < before {
            self.hints_stale.store(true, Ordering::Relaxed);
        }
        let mut sums: HashMap<&WorkerId, (u64, u32)> = HashMap::new();
        for l in heard.values() {
            for w in &l.workers {
                let s = sums.entry(&w.id).or_default();
                s.0 = s.0.saturating_add(w.pending_prefill_tokens);
                s.1 = s.1.saturating_add(w.inflight);
            }
        }
        for w in workers {
            let (pending, inflight) = sums.get(&w.id).copied().unwrap_or_default();
            w.live.replica_pending_prefill_tokens.store(pending, Ordering::Relaxed);
            w.live.replica_inflight.store(inflight, Ordering::Relaxed);
        }
        let n = heard.len();
        self.heard_count.store(n, Ordering::Relaxed);
        // Another publish rebuilding: it leaves the stale mark to the next.
        let Some(mut next_rebuild) = self.next_rebuild.try_lock() else { return n };
        if !self.hints_stale.load(Ordering::Relaxed) || next_rebuild.is_some_and(|next| now < next) {
            return n;
        }
        self.hints_stale.store(false, Ordering::Relaxed);
        let lists: Vec<Arc<Vec<SentPrefix>>> = heard.values().map(|l| l.sent.clone()).collect();
        drop(heard);
        let started = Instant::now();
        // Only workers this router routes to: routing has no use for the
        // others, and a replica naming thousands of made-up workers for
        // one key would make every rebuild quadratic in them.
        let known: std::collections::HashSet<&WorkerId> = workers.iter().map(|w| &w.id).collect();
        let sent = lists.iter().flat_map(|l| l.iter()).filter(|s| known.contains(&s.worker));
        self.hints.store(Arc::new(PrefixHints::build(sent, MAX_HINT_KEYS)));
        *next_rebuild = Some(now + MIN_HINTS_REBUILD_GAP.max(started.elapsed() * 10));
        n
    }

    /// The prefix hints as of the last publish.
    pub fn hints(&self) -> Arc<PrefixHints> {
        self.hints.load_full()
    }

    /// From now on this router's requests are kept for its reports: it has
    /// replicas configured, or one reported to it.
    pub fn start_exchanging(&self) {
        self.exchanging.store(true, Ordering::Relaxed);
    }

    /// Has this router replicas configured, or has one reported to it?
    pub fn exchanging(&self) -> bool {
        self.exchanging.load(Ordering::Relaxed)
    }

    /// Other replicas heard as of the last [`Self::publish`].
    pub fn heard(&self) -> usize {
        self.heard_count.load(Ordering::Relaxed)
    }

    /// This router sends a request with block keys `keys` to `worker`: its
    /// exchange tasks wake to send news, and its reports name the request
    /// until [`SENT_LINGER_MS`] after the entry is [`SentEntry::done`].
    /// `None` for a prompt without a full block, or while this router
    /// exchanges with no one.
    pub fn record_sent(&self, worker: &WorkerId, keys: &[BlockKey]) -> Option<Arc<SentEntry>> {
        if !self.exchanging.load(Ordering::Relaxed) {
            return None;
        }
        self.routed.send_modify(|n| *n = n.wrapping_add(1));
        if keys.is_empty() {
            return None;
        }
        let entry = Arc::new(SentEntry {
            prefix: SentPrefix { worker: worker.clone(), keys: prefixes::sample(keys) },
            done_ms: AtomicU64::new(0),
        });
        let mut sent = self.sent.lock();
        if sent.len() == MAX_SENT {
            sent.pop_front();
        }
        sent.push_back(entry.clone());
        Some(entry)
    }

    /// Wakes when this router routes a request (while it exchanges).
    pub fn routed(&self) -> tokio::sync::watch::Receiver<u64> {
        self.routed.subscribe()
    }

    /// This router's own figures, for the others: every worker where it has
    /// something in flight, and, unless `loads_only`, its recent requests as
    /// of `now_ms`.
    pub fn own_report(&self, epoch: &str, workers: &[Arc<Worker>], now_ms: u64, loads_only: bool) -> ReplicaReport {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let loads = workers
            .iter()
            .filter_map(|w| {
                let pending_prefill_tokens = w.live.pending_prefill_tokens.load(Ordering::Relaxed);
                let inflight = w.live.inflight.load(Ordering::Relaxed);
                (pending_prefill_tokens > 0 || inflight > 0).then(|| ReplicaLoad {
                    id: w.id.clone(),
                    pending_prefill_tokens,
                    inflight,
                })
            })
            .collect();
        let sent = if loads_only {
            Vec::new()
        } else {
            let mut log = self.sent.lock();
            log.retain(|e| still_reported(Some(e.done_ms.load(Ordering::Relaxed)).filter(|d| *d != 0), now_ms));
            log.iter().map(|e| e.prefix.clone()).collect()
        };
        ReplicaReport { router_epoch: epoch.to_owned(), seq, workers: loads, sent, loads_only }
    }
}

/// Takes `report` and brings the workers' figures up to date.
fn take(state: &AppState, report: ReplicaReport) -> Heard {
    let now = Instant::now();
    let heard = state.replicas.hear(report, &state.router_epoch, now);
    if heard == Heard::Applied {
        state.replicas.start_exchanging();
        let n = state.replicas.publish(&state.workers.snapshot(), now);
        state.metrics.replicas_heard.set(n as i64);
    }
    heard
}

/// `POST /internal/replica`: another replica's report, answered with this
/// router's (news with news).
pub async fn report(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<ReplicaReport>, RouterError> {
    crate::internal::authenticate_replica(&state, &headers)?;
    let body = read_in_time(&state, body, MAX_REPORT_BODY_BYTES).await?;
    let report: ReplicaReport = decode_valid(&body)?;
    let loads_only = report.loads_only;
    let heard = take(&state, report);
    state.metrics.replica_report("received", heard.as_str());
    if heard == Heard::Full {
        return Err(RouterError::Unavailable(format!(
            "this router already hears {MAX_REPLICAS} replicas; a new one is taken when one of them falls silent"
        )));
    }
    Ok(Json(state.replicas.own_report(&state.router_epoch, &state.workers.snapshot(), now_ms(), loads_only)))
}

/// How often the configured replica URLs are resolved again: a name (a
/// headless Kubernetes service) stands for every address it resolves to,
/// and replicas come and go.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// Exchanges with every address the configured replica URLs resolve to,
/// and forgets silent replicas, until the server has stopped (through a
/// shutdown's drain: the others keep hearing what is still in flight here).
pub async fn run(state: Arc<AppState>) {
    if !state.config.replicas.is_empty() {
        state.replicas.start_exchanging();
    }
    let mut resolved: HashMap<String, Vec<String>> = HashMap::new();
    let mut exchanges: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut next_resolve = Instant::now();
    let mut tick = tokio::time::interval(state.config.raw.replica_exchange_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = state.drained.cancelled() => {
                // Each link's last report (bounded) is sent before this returns.
                futures::future::join_all(exchanges.into_values()).await;
                return;
            }
        }
        if !state.config.replicas.is_empty() && Instant::now() >= next_resolve {
            next_resolve = Instant::now() + RESOLVE_EVERY;
            for url in &state.config.replicas {
                match resolve(url).await {
                    Ok(addresses) => {
                        resolved.insert(url.clone(), addresses);
                    }
                    // Keep the last good addresses through a DNS hiccup.
                    Err(e) => tracing::warn!(error = %e, "replica resolution failed"),
                }
            }
            let targets: std::collections::BTreeSet<&String> = resolved.values().flatten().collect();
            exchanges.retain(|address, task| {
                let keep = targets.contains(address);
                if !keep {
                    tracing::info!(replica = %address, "replica address gone");
                    task.abort();
                }
                keep
            });
            for address in targets {
                if !exchanges.contains_key(address) {
                    let span = tracing::info_span!("replica_exchange", replica = %address);
                    let task = tokio::spawn(exchange_with(state.clone(), address.clone()).instrument(span));
                    exchanges.insert(address.clone(), task);
                }
            }
        }
        let n = state.replicas.publish(&state.workers.snapshot(), Instant::now());
        state.metrics.replicas_heard.set(n as i64);
    }
}

/// The addresses `url` stands for (the lookup on the blocking pool).
async fn resolve(url: &str) -> Result<Vec<String>, kvroute_shared::resolve::ResolveError> {
    use kvroute_shared::resolve::{RESOLVE_TIMEOUT, ResolveError};
    let owned = url.to_owned();
    let lookup = tokio::task::spawn_blocking(move || kvroute_shared::resolve::resolve(&owned));
    match tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await {
        Ok(Ok(resolved)) => resolved,
        Ok(Err(e)) => Err(ResolveError::Lookup { url: url.to_owned(), source: std::io::Error::other(e) }),
        Err(_) => Err(ResolveError::TimedOut { url: url.to_owned(), after: RESOLVE_TIMEOUT }),
    }
}

/// How often an address that answered as this router itself is asked
/// again: it may be a load-balanced address that picked this router.
pub const SELF_RECHECK: Duration = Duration::from_secs(5);

/// Whether an address has answered both as this router and as another:
/// a load-balanced address (a Kubernetes Service's virtual IP, not the
/// headless Service's name), warned about once and exchanged with.
fn shared_address(warned: &mut bool, by_self: bool, by_others: bool) -> bool {
    if by_self && by_others && !*warned {
        *warned = true;
        tracing::warn!(
            "this replica address answers for this router and for others: a load-balanced address (a Service's \
             virtual IP?) reaches one replica at a time; give every replica's address (a headless Service's name)"
        );
    }
    *warned
}

/// One replica address: a full report every interval and news between
/// them (when this router routes a request, and every news interval while
/// either side has anything in flight), the answer taken as that
/// replica's. One exchange at a time, so a slow replica is asked less
/// often, never by a pile of requests. An address that turns out to be
/// this router itself is asked again only every [`SELF_RECHECK`] (until the
/// server stops, or until it is no longer resolved); one that answers as
/// this router and as others is load-balanced: warned about, and sent to
/// as any other (this router ignores its own reports).
async fn exchange_with(state: Arc<AppState>, base: String) {
    let url = format!("{base}{REPLICA_PATH}");
    let mut tick = tokio::time::interval(state.config.raw.replica_exchange_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let news_every = state.config.raw.replica_news_interval;
    let mut routed = state.replicas.routed();
    let mut last = tokio::time::Instant::now();
    // Sends failed in a row (the link is failing while any did), and the
    // ticks still to skip: a replica refused (a 65th) or down got a full
    // report every interval, each read and decoded before its refusal.
    // Retries back off to every 8th tick.
    let (mut failures, mut skip) = (0u32, 0u32);
    // Either side had something in flight at the last exchange.
    let mut busy = false;
    // Who answered at this address: this router, another, or both (a
    // load-balanced address, which is warned about and exchanged with).
    let (mut answered_by_self, mut answered_by_others, mut shared) = (false, false, false);
    loop {
        // No news for a replica that does not answer: the full reports retry it.
        let news = !news_every.is_zero() && failures == 0;
        let loads_only = tokio::select! {
            _ = tick.tick() => false,
            // While either side is busy, news every interval: the answers
            // carry the other's news back, so one link per pair suffices.
            _ = tokio::time::sleep_until(last + news_every), if news && busy => true,
            Ok(()) = routed.changed(), if news => {
                tokio::select! {
                    _ = tokio::time::sleep_until(last + news_every) => true,
                    _ = state.drained.cancelled() => return farewell(&state, &url, failures > 0).await,
                }
            }
            _ = state.drained.cancelled() => return farewell(&state, &url, failures > 0).await,
        };
        if skip > 0 {
            skip -= 1;
            continue;
        }
        // What was routed until now is in this report.
        routed.mark_unchanged();
        last = tokio::time::Instant::now();
        let report = state.replicas.own_report(&state.router_epoch, &state.workers.snapshot(), now_ms(), loads_only);
        match send(&state, &url, &report).await {
            Ok(answer) if answer.router_epoch == state.router_epoch => {
                state.metrics.replica_report("sent", "self");
                if !answered_by_self {
                    tracing::info!("this address is this router itself: asking it again only every {SELF_RECHECK:?}");
                }
                answered_by_self = true;
                if shared_address(&mut shared, answered_by_self, answered_by_others) {
                    continue;
                }
                // Left alone, asked again now and then: an address that
                // once answered as this router (a Service's virtual IP that
                // picked it) was never sent to again, and the exchange
                // through it stopped for good, without a word.
                tokio::select! {
                    _ = tokio::time::sleep(SELF_RECHECK) => {}
                    _ = state.drained.cancelled() => return,
                }
            }
            Ok(answer) => {
                answered_by_others = true;
                shared_address(&mut shared, answered_by_self, answered_by_others);
                state.metrics.replica_report("sent", "ok");
                busy = !report.workers.is_empty() || !answer.workers.is_empty();
                take(&state, answer);
                if failures > 0 {
                    tracing::info!("replica exchange works again");
                }
                failures = 0;
            }
            Err(e) => {
                state.metrics.replica_report("sent", "error");
                if failures == 0 {
                    tracing::warn!(error = %e, "replica exchange failed; retrying, backing off to every 8th interval");
                }
                failures += 1;
                skip = (1 << (failures - 1).min(3)) - 1;
            }
        }
    }
}

/// A draining router's last word to a replica: nothing of its own to count
/// any more (it is exiting), so the others stop counting what it last
/// reported at once, not when it expires a second later. Best effort, within
/// half a second; not to a replica that is not answering.
async fn farewell(state: &AppState, url: &str, failing: bool) {
    if failing {
        return;
    }
    // Over no worker: it names none.
    let report = state.replicas.own_report(&state.router_epoch, &[], now_ms(), true);
    let _ = tokio::time::timeout(Duration::from_millis(500), send(state, url, &report)).await;
}

#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("{0}")]
    Http(#[from] reqwest::Error),
    #[error("answered {status}: {body}")]
    Status { status: reqwest::StatusCode, body: String },
    #[error("answered an invalid report: {0}")]
    Invalid(#[from] DecodeError),
    #[error("answered more than {MAX_REPORT_BODY_BYTES} bytes")]
    TooLarge,
}

async fn send(state: &AppState, url: &str, report: &ReplicaReport) -> Result<ReplicaReport, SendError> {
    let mut req = state.client.post(url).json(report).timeout(state.replicas.expiry);
    if let Some(token) = &state.config.raw.internal_token {
        req = req.bearer_auth(token.expose());
    }
    let resp = req.send().await?;
    let status = resp.status();
    let body = read_within(reqwest::Body::from(resp), MAX_REPORT_BODY_BYTES).await?.ok_or(SendError::TooLarge)?;
    if !status.is_success() {
        let body = String::from_utf8_lossy(&body).chars().take(300).collect();
        return Err(SendError::Status { status, body });
    }
    Ok(decode_valid(&body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str) -> Arc<Worker> {
        Worker::for_test(id)
    }

    fn report(epoch: &str, seq: u64, loads: &[(&str, u64, u32)]) -> ReplicaReport {
        ReplicaReport {
            router_epoch: epoch.into(),
            seq,
            workers: loads
                .iter()
                .map(|&(id, pending_prefill_tokens, inflight)| ReplicaLoad {
                    id: WorkerId::new(id),
                    pending_prefill_tokens,
                    inflight,
                })
                .collect(),
            sent: Vec::new(),
            loads_only: false,
        }
    }

    fn figures(w: &Worker) -> (u64, u32) {
        let load = w.live.load(0, 0);
        (load.replica_pending_prefill_tokens, load.replica_inflight)
    }

    #[test]
    fn other_replicas_figures_are_summed_per_worker_and_replaced_by_each_newer_report() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let (a, b) = (worker("a"), worker("b"));
        let t0 = Instant::now();
        assert_eq!(replicas.hear(report("p1", 1, &[("a", 1_000, 2)]), "me", t0), Heard::Applied);
        assert_eq!(replicas.hear(report("p2", 7, &[("a", 500, 1), ("b", 40, 1)]), "me", t0), Heard::Applied);
        assert_eq!(replicas.publish(&[a.clone(), b.clone()], t0), 2);
        assert_eq!(figures(&a), (1_500, 3));
        assert_eq!(figures(&b), (40, 1));
        // The own figures stay apart, and routing sees both.
        a.live.pending_prefill_tokens.store(100, Ordering::Relaxed);
        assert_eq!(a.live.load(0, 0).pending_prefill_tokens, 1_600);
        // p1's requests there finished: its next report leaves `a` out.
        assert_eq!(replicas.hear(report("p1", 2, &[]), "me", t0), Heard::Applied);
        // A report overtaken by a newer one changes nothing.
        assert_eq!(replicas.hear(report("p1", 1, &[("a", 9_999, 9)]), "me", t0), Heard::Stale);
        replicas.publish(&[a.clone(), b.clone()], t0);
        assert_eq!(figures(&a), (500, 1));
    }

    #[test]
    fn a_silent_replica_is_forgotten_and_its_own_echo_never_counts() {
        let replicas = Replicas::new(Duration::from_millis(100));
        assert_eq!(replicas.expiry, Duration::from_secs(1));
        let a = worker("a");
        let t0 = Instant::now();
        assert_eq!(replicas.hear(report("me", 1, &[("a", 1_000, 1)]), "me", t0), Heard::OwnEcho);
        assert_eq!(replicas.publish(std::slice::from_ref(&a), t0), 0);
        assert_eq!(figures(&a), (0, 0));
        replicas.hear(report("p1", 1, &[("a", 1_000, 1)]), "me", t0);
        assert_eq!(replicas.publish(std::slice::from_ref(&a), t0 + Duration::from_millis(999)), 1);
        assert_eq!(figures(&a), (1_000, 1));
        assert_eq!(replicas.publish(std::slice::from_ref(&a), t0 + Duration::from_secs(1)), 0);
        assert_eq!(figures(&a), (0, 0));
    }

    #[test]
    fn no_more_than_max_replicas_are_remembered() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let t0 = Instant::now();
        for p in 0..MAX_REPLICAS {
            assert_eq!(replicas.hear(report(&format!("p{p}"), 1, &[]), "me", t0), Heard::Applied);
        }
        assert_eq!(replicas.hear(report("one-too-many", 1, &[]), "me", t0), Heard::Full);
        // Known replicas still report; once the others expire a newcomer fits.
        assert_eq!(replicas.hear(report("p0", 2, &[]), "me", t0), Heard::Applied);
        let later = t0 + replicas.expiry;
        assert_eq!(replicas.hear(report("one-too-many", 1, &[]), "me", later), Heard::Applied);
    }

    #[test]
    fn figures_that_would_overflow_saturate() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let a = worker("a");
        let t0 = Instant::now();
        for p in 0..3 {
            replicas.hear(report(&format!("p{p}"), 1, &[("a", MAX_REPORTED_PENDING_TOKENS, u32::MAX)]), "me", t0);
        }
        replicas.publish(std::slice::from_ref(&a), t0);
        assert_eq!(figures(&a), (3 * MAX_REPORTED_PENDING_TOKENS, u32::MAX));
        a.live.inflight.store(5, Ordering::Relaxed);
        let load = a.live.load(0, 0);
        assert_eq!(load.routed_inflight(), u32::MAX);
        assert_eq!(load.requests(), u64::from(u32::MAX));
    }

    #[test]
    fn hostile_reports_are_refused_naming_the_field() {
        let refused = |body: &str| decode_valid::<ReplicaReport>(body.as_bytes()).unwrap_err().field;
        assert_eq!(refused(r#"{"router_epoch":"","seq":1}"#), "router_epoch");
        let long = "e".repeat(65);
        assert_eq!(refused(&format!(r#"{{"router_epoch":"{long}","seq":1}}"#)), "router_epoch");
        assert_eq!(refused(r#"{"router_epoch":"e","seq":-1}"#), "seq");
        let w = |id: &str, p: u64| format!(r#"{{"id":"{id}","pending_prefill_tokens":{p},"inflight":1}}"#);
        let body = |ws: &[String]| format!(r#"{{"router_epoch":"e","seq":1,"workers":[{}]}}"#, ws.join(","));
        assert_eq!(refused(&body(&[w("a b", 1)])), "workers[0].id");
        assert_eq!(refused(&body(&[w("a", 1), w("a", 2)])), "workers[1].id");
        assert_eq!(refused(&body(&[w("a", MAX_REPORTED_PENDING_TOKENS + 1)])), "workers[0].pending_prefill_tokens");
        let many: Vec<String> = (0..=MAX_WORKERS).map(|i| w(&format!("w{i}"), 1)).collect();
        assert_eq!(refused(&body(&many)), "workers");
        let sent = |worker: &str, keys: usize| {
            let keys: Vec<String> = (0..keys).map(|i| format!("\"{i:016x}\"")).collect();
            format!(r#"{{"router_epoch":"e","seq":1,"sent":[{{"worker":"{worker}","keys":[{}]}}]}}"#, keys.join(","))
        };
        assert!(decode_valid::<ReplicaReport>(sent("w1", 30).as_bytes()).is_ok());
        assert_eq!(refused(&sent("w/1", 3)), "sent[0].worker");
        assert_eq!(refused(&sent("w1", prefixes::MAX_SAMPLED_KEYS + 1)), "sent[0].keys");
        // Fields of a later release are ignored.
        let newer = r#"{"router_epoch":"e","seq":1,"workers":[],"queued_decode_tokens":5}"#;
        assert!(decode_valid::<ReplicaReport>(newer.as_bytes()).is_ok());
    }

    #[test]
    fn the_own_report_names_only_workers_with_something_in_flight() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let (a, b) = (worker("a"), worker("b"));
        a.live.pending_prefill_tokens.store(300, Ordering::Relaxed);
        a.live.inflight.store(2, Ordering::Relaxed);
        // Another replica's figures are never passed on as this router's own.
        b.live.replica_pending_prefill_tokens.store(5_000, Ordering::Relaxed);
        let first = replicas.own_report("me", &[a.clone(), b.clone()], 0, false);
        assert_eq!(first, report("me", 1, &[("a", 300, 2)]));
        assert_eq!(replicas.own_report("me", &[a, b], 0, false).seq, 2);
    }

    #[test]
    fn a_sent_request_is_reported_until_a_while_after_its_first_token() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let keys: Vec<BlockKey> = (0..40).map(BlockKey).collect();
        assert!(replicas.record_sent(&WorkerId::new("a"), &keys).is_none(), "kept only while exchanging");
        replicas.start_exchanging();
        assert!(replicas.record_sent(&WorkerId::new("a"), &[]).is_none(), "no full block, nothing to name");
        let first = replicas.record_sent(&WorkerId::new("a"), &keys).unwrap();
        let second = replicas.record_sent(&WorkerId::new("b"), &keys[..3]).unwrap();
        let sent = |now_ms| replicas.own_report("me", &[], now_ms, false).sent;
        assert_eq!(sent(5_000), [first.prefix.clone(), second.prefix.clone()]);
        assert_eq!(first.prefix.keys, prefixes::sample(&keys));
        first.done(5_000);
        first.done(9_000); // the first time counts
        let failed = replicas.record_sent(&WorkerId::new("c"), &keys).unwrap();
        failed.abandon();
        assert_eq!(sent(5_999).len(), 2);
        assert_eq!(sent(6_000), std::slice::from_ref(&second.prefix));
        // Pending requests stay however long their prefill takes.
        assert_eq!(sent(60_000), std::slice::from_ref(&second.prefix));
        for _ in 0..MAX_SENT + 10 {
            replicas.record_sent(&WorkerId::new("a"), &keys);
        }
        assert_eq!(sent(60_000).len(), MAX_SENT, "the newest only");
    }

    #[test]
    fn the_others_sent_requests_become_prefix_hints_and_leave_with_them() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let keys: Vec<BlockKey> = (0..40).map(BlockKey).collect();
        let t0 = Instant::now();
        let mut r = report("p1", 1, &[]);
        r.sent = vec![SentPrefix { worker: WorkerId::new("w2"), keys: prefixes::sample(&keys) }];
        // A worker this router does not route to gives no hint.
        r.sent.push(SentPrefix { worker: WorkerId::new("elsewhere"), keys: prefixes::sample(&keys) });
        replicas.hear(r, "me", t0);
        assert!(replicas.hints().is_empty(), "not before the next publish");
        let w2 = [worker("w2")];
        replicas.publish(&w2, t0);
        let hints = replicas.hints();
        assert_eq!(hints.depths(&keys).iter().map(|(w, d)| (w.as_str(), *d)).collect::<Vec<_>>(), [("w2", 40)]);
        // p1 falls silent. It is forgotten while a stale report from p2 is
        // taken, before any publish: the hints go with it all the same.
        let half = replicas.expiry / 2;
        replicas.hear(report("p2", 5, &[]), "me", t0 + half);
        replicas.publish(&w2, t0 + half);
        assert!(!replicas.hints().is_empty());
        assert_eq!(replicas.hear(report("p2", 3, &[]), "me", t0 + replicas.expiry), Heard::Stale);
        assert_eq!(replicas.publish(&w2, t0 + replicas.expiry), 1);
        assert!(replicas.hints().is_empty());
    }

    /// However fast full reports arrive, the hints are rebuilt at most
    /// once per [`MIN_HINTS_REBUILD_GAP`]; what came in between is taken at
    /// the first publish past it. The figures are taken at once all along.
    #[test]
    fn hint_rebuilds_are_spaced() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let (first, second): (Vec<BlockKey>, Vec<BlockKey>) =
            ((0..40).map(BlockKey).collect(), (1_000..1_040).map(BlockKey).collect());
        let (t0, w2) = (Instant::now(), [worker("w2")]);
        let full = |seq, keys: &[BlockKey], pending| {
            let mut r = report("p1", seq, &[("w2", pending, 1)]);
            r.sent = vec![SentPrefix { worker: WorkerId::new("w2"), keys: prefixes::sample(keys) }];
            r
        };
        replicas.hear(full(1, &first, 100), "me", t0);
        replicas.publish(&w2, t0);
        assert_eq!(replicas.hints().depths(&first).len(), 1);
        let soon = t0 + MIN_HINTS_REBUILD_GAP / 2;
        replicas.hear(full(2, &second, 200), "me", soon);
        replicas.publish(&w2, soon);
        assert_eq!(figures(&w2[0]), (200, 1), "the figures at once");
        assert!(replicas.hints().depths(&second).is_empty(), "the prefixes after the gap");
        assert_eq!(replicas.hints().depths(&first).len(), 1);
        // Past the gap whatever the rebuild took (ten times a rebuild's own
        // time on a busy machine may pass 10 ms), within the expiry.
        let later = t0 + Duration::from_millis(500);
        replicas.publish(&w2, later);
        assert_eq!(replicas.hints().depths(&second).len(), 1);
        assert!(replicas.hints().depths(&first).is_empty());
    }

    /// News between full reports replaces a replica's figures and keeps the
    /// prefixes its last full report named; the next full report replaces
    /// both.
    #[test]
    fn news_replaces_the_figures_and_keeps_the_prefixes() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let keys: Vec<BlockKey> = (0..40).map(BlockKey).collect();
        let (t0, w2) = (Instant::now(), [worker("w2")]);
        let mut full = report("p1", 1, &[("w2", 900, 1)]);
        full.sent = vec![SentPrefix { worker: WorkerId::new("w2"), keys: prefixes::sample(&keys) }];
        replicas.hear(full, "me", t0);
        replicas.publish(&w2, t0);
        let news = ReplicaReport { loads_only: true, ..report("p1", 2, &[("w2", 4_000, 3)]) };
        assert_eq!(replicas.hear(news, "me", t0), Heard::Applied);
        replicas.publish(&w2, t0);
        assert_eq!(figures(&w2[0]), (4_000, 3));
        assert_eq!(replicas.hints().depths(&keys).len(), 1, "the prefix stays");
        // Older news than what was heard is stale, like any report.
        let late = ReplicaReport { loads_only: true, ..report("p1", 2, &[]) };
        assert_eq!(replicas.hear(late, "me", t0), Heard::Stale);
        let later = t0 + Duration::from_millis(500); // past any rebuild gap
        replicas.hear(report("p1", 3, &[]), "me", later);
        replicas.publish(&w2, later);
        assert_eq!(figures(&w2[0]), (0, 0));
        assert!(replicas.hints().is_empty(), "a full report replaces the prefixes too");
    }

    /// A full report overtaken on the wire by the same replica's later news
    /// (answers and news share one seq) still brings its prefixes, and keeps
    /// the news' newer figures; a full report older than the prefixes kept
    /// is stale. It was refused as older than the news, and its prefixes
    /// lost while news kept the replica heard.
    #[test]
    fn a_full_report_overtaken_by_news_still_brings_its_prefixes() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let keys: Vec<BlockKey> = (0..40).map(BlockKey).collect();
        let (t0, w2) = (Instant::now(), [worker("w2")]);
        let news = ReplicaReport { loads_only: true, ..report("p1", 6, &[("w2", 4_000, 3)]) };
        assert_eq!(replicas.hear(news, "me", t0), Heard::Applied);
        let mut full = report("p1", 5, &[("w2", 900, 1)]);
        full.sent = vec![SentPrefix { worker: WorkerId::new("w2"), keys: prefixes::sample(&keys) }];
        assert_eq!(replicas.hear(full.clone(), "me", t0), Heard::Applied);
        replicas.publish(&w2, t0);
        assert_eq!(figures(&w2[0]), (4_000, 3), "the news' figures, newer");
        assert_eq!(replicas.hints().depths(&keys).len(), 1, "the full report's prefix");
        assert_eq!(replicas.hear(full, "me", t0), Heard::Stale, "the same report twice");
        let older = report("p1", 4, &[]);
        assert_eq!(replicas.hear(older, "me", t0), Heard::Stale, "older than the prefixes kept");
    }

    /// News leaves the requests out (and a news report naming some is
    /// refused); a full report does not say it is one, so it reads as
    /// before to a replica of an earlier release.
    #[test]
    fn news_names_no_requests_and_full_reports_read_as_before() {
        let replicas = Replicas::new(Duration::from_millis(100));
        replicas.start_exchanging();
        let keys: Vec<BlockKey> = (0..40).map(BlockKey).collect();
        replicas.record_sent(&WorkerId::new("a"), &keys).unwrap();
        let news = replicas.own_report("me", &[], 0, true);
        assert!(news.loads_only && news.sent.is_empty());
        let full = replicas.own_report("me", &[], 0, false);
        assert_eq!(full.sent.len(), 1);
        assert!(!serde_json::to_string(&full).unwrap().contains("loads_only"));
        let forged = ReplicaReport { loads_only: true, ..full };
        let e = decode_valid::<ReplicaReport>(&serde_json::to_vec(&forged).unwrap()).unwrap_err();
        assert!(e.to_string().contains("sent"), "{e}");
    }

    /// Every request routed while exchanging wakes the exchange tasks, a
    /// prompt without a full block too; none before.
    #[test]
    fn a_routed_request_wakes_the_exchange_tasks() {
        let replicas = Replicas::new(Duration::from_millis(100));
        let mut routed = replicas.routed();
        replicas.record_sent(&WorkerId::new("a"), &[]);
        assert!(!routed.has_changed().unwrap(), "not exchanging yet");
        replicas.start_exchanging();
        replicas.record_sent(&WorkerId::new("a"), &[]);
        assert!(routed.has_changed().unwrap());
        routed.mark_unchanged();
        replicas.record_sent(&WorkerId::new("a"), &[BlockKey(1)]);
        assert!(routed.has_changed().unwrap());
    }
}
