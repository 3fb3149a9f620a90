//! Everything the router's handlers share.
//!
//! The index sits behind one `parking_lot::RwLock`: matching (every request)
//! takes the read side for a few microseconds; events, syncs and speculative
//! records take the write side for microseconds (a 100 k-key sync for a few
//! milliseconds, see BENCHMARKS.md). A single-owner task fed by a channel
//! would add a hop to every request's match for no gain at these hold times.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvroute_shared::WorkerId;
use kvroute_shared::tokenize::PromptTokenizer;
use parking_lot::RwLock;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::sessions::Sessions;
use crate::workers::Registry;

/// The last (epoch, seq) applied per worker: reordered or duplicated sidecar
/// batches are dropped.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SeqState {
    pub epoch: Option<String>,
    pub seq: Option<u64>,
}

impl SeqState {
    /// Accepts (and records) a message unless it is not newer than the last
    /// one of the same epoch.
    pub fn accept(&mut self, epoch: Option<&str>, seq: Option<u64>) -> bool {
        self.accept_as(epoch, seq, false)
    }

    /// As [`SeqState::accept`]; a full sync (`is_sync`) is also accepted from
    /// an epoch older than the one held. A delta from an older epoch is a
    /// replayed or forged push and is refused; a sync replaces the worker's
    /// whole state, and refusing it would lock out a sidecar whose clock is
    /// behind its predecessor's (a pod rescheduled on another node): its
    /// stale reply → new epoch → sync loop would never end.
    pub fn accept_as(&mut self, epoch: Option<&str>, seq: Option<u64>, is_sync: bool) -> bool {
        let Some(seq) = seq else { return true };
        if self.epoch.as_deref() == epoch && self.seq.is_some_and(|last| seq <= last) {
            return false;
        }
        // Ordered epochs (20 hex digits, draw time first). Older sidecars'
        // random epochs are not ordered.
        if let (Some(held), Some(new)) = (self.epoch.as_deref(), epoch)
            && !is_sync
            && held.len() == 20
            && new.len() == 20
            && new < held
        {
            return false;
        }
        self.epoch = epoch.map(str::to_owned);
        self.seq = Some(seq);
        true
    }
}

/// The index and the sequence numbers it was built from, changed together.
#[derive(Debug, Default)]
pub struct MapState {
    pub index: Index,
    pub seqs: HashMap<WorkerId, SeqState>,
}

/// Tokenizers by served model name, with a default for other models.
#[derive(Debug)]
pub struct Tokenizers {
    pub by_model: BTreeMap<String, Arc<PromptTokenizer>>,
    pub default: Arc<PromptTokenizer>,
}

impl Tokenizers {
    pub fn for_model(&self, model: &str) -> &Arc<PromptTokenizer> {
        self.by_model.get(model).unwrap_or(&self.default)
    }
}

#[derive(Debug)]
pub struct AppState {
    pub config: Config,
    pub workers: Registry,
    pub map: RwLock<MapState>,
    pub tokenizers: Tokenizers,
    pub policy: Box<dyn Policy>,
    pub metrics: Metrics,
    pub sessions: Sessions,
    pub client: reqwest::Client,
    /// Random per process start: sidecars resync at once when it changes.
    pub router_epoch: String,
    pub concurrency: Arc<Semaphore>,
    /// Rendering + tokenizing jobs on the blocking pool at once: one per core.
    pub tokenize_slots: Arc<Semaphore>,
    /// Mean prompt tokens (EWMA, f64 bits), turning request counts into tokens.
    mean_prompt_tokens: AtomicU64,
    pub started: Instant,
    pub shutdown: CancellationToken,
}

impl AppState {
    pub fn new(config: Config, tokenizers: Tokenizers, shutdown: CancellationToken, client: reqwest::Client) -> Self {
        let policy = config.policy.build();
        let concurrency = Arc::new(Semaphore::new(config.raw.max_concurrent_requests));
        let sessions = Sessions::new(config.raw.max_sessions);
        AppState {
            workers: Registry::default(),
            map: RwLock::new(MapState::default()),
            tokenizers,
            policy,
            metrics: Metrics::new(),
            sessions,
            client,
            router_epoch: format!("{:016x}", rand::random::<u64>()),
            concurrency,
            tokenize_slots: Arc::new(Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get()))),
            mean_prompt_tokens: AtomicU64::new(512f64.to_bits()),
            started: Instant::now(),
            shutdown,
            config,
        }
    }

    pub fn mean_prompt_tokens(&self) -> f64 {
        f64::from_bits(self.mean_prompt_tokens.load(Ordering::Relaxed))
    }

    /// Folds one request's prompt size into the moving mean (racy updates
    /// lose a sample at worst; it is an estimate).
    pub fn observe_prompt_tokens(&self, tokens: usize) {
        let old = self.mean_prompt_tokens();
        let new = old * 0.95 + tokens as f64 * 0.05;
        self.mean_prompt_tokens.store(new.to_bits(), Ordering::Relaxed);
    }
}

/// Wall-clock milliseconds since the Unix epoch: the clock sidecars stamp
/// `as_of_ms` with.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_drops_reordered_and_duplicated_batches_within_an_epoch() {
        let mut s = SeqState::default();
        assert!(s.accept(Some("a"), Some(5)));
        assert!(!s.accept(Some("a"), Some(5)));
        assert!(!s.accept(Some("a"), Some(4)));
        assert!(s.accept(Some("a"), Some(6)));
        // A new epoch (sidecar restart) starts over.
        assert!(s.accept(Some("b"), Some(0)));
        // No seq: always applied (the paper's minimal body).
        assert!(s.accept(None, None));
    }

    #[test]
    fn ordered_epochs_never_go_back() {
        let (old, new) = ("0190000000000000aaaa", "0190000000010000bbbb");
        let mut s = SeqState::default();
        assert!(s.accept(Some(old), Some(7)));
        assert!(s.accept(Some(new), Some(8)), "a later epoch is a restart");
        assert!(!s.accept(Some(old), Some(u64::MAX)), "an earlier epoch's delta is a replay or a forgery");
        assert!(s.accept(Some(new), Some(9)));
        // A sync replaces everything: accepted even from an older epoch (a
        // sidecar whose clock is behind its predecessor's), and it then holds.
        let skewed = "018f000000000000cccc";
        assert!(s.accept_as(Some(skewed), Some(1), true));
        assert!(s.accept(Some(skewed), Some(2)));
    }
}
