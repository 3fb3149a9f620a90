//! `kvroute-bench antientropy`: protocol v1 against v2 at scale, in one
//! process (DESIGN.md §2, issue 14).
//!
//! A synthetic pusher plays `--workers` sidecars of `--blocks` keys each
//! against the router's real state and HTTP app (`app(state).oneshot`: auth,
//! body limits, JSON decoding, the internal handlers, the index), on a
//! simulated timeline: every worker pushes every 100 ms a delta of `--churn`
//! stores and as many evictions (its key set is a sliding window of ids, so
//! a million-key worker costs the pusher no memory), and `--loss` of the
//! pushes are lost — half visibly (the sidecar sees an error), half silently
//! (acked, never applied). v1 sidecars send a full sync every 5 s and after a
//! visible loss; v2 sidecars send the digest on every push, repair on a
//! mismatch or a visible loss, and a full sync every `--safety-interval`.
//!
//! Router CPU is the time spent inside the router's handlers (the pusher
//! calls them from one thread, so their wall time is CPU time); bytes are
//! the bodies received. Meanwhile a second thread makes routing lookups
//! (read lock + longest-prefix match) and records their latency, split by
//! whether a full sync was being applied.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use hdrhistogram::Histogram;
use http_body_util::BodyExt;
use kvroute_router::config::RawConfig;
use kvroute_router::state::AppState;
use kvroute_router::{app, build_state};
use kvroute_shared::digest::mix;
use kvroute_shared::{BlockKey, KeyDigest, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::error::BenchError;

const FAST_MS: u64 = 100;
const V1_SYNC_MS: u64 = 5_000;
/// Keys per worker remembered for a repair: the last 4 deltas.
const REPAIR_WINDOW: u64 = 4;

#[derive(Debug, Clone, clap::Args)]
pub struct AntientropyArgs {
    /// Simulated workers (sidecars), at most 128 (the index's slots).
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Cached blocks (keys) per worker.
    #[arg(long, default_value_t = 1_000_000)]
    pub blocks: u64,
    /// Stores (and as many evictions) per worker per 100 ms push.
    #[arg(long, default_value_t = 64)]
    pub churn: u64,
    /// Fraction of pushes lost (half visibly, half silently).
    #[arg(long, default_value_t = 0.01)]
    pub loss: f64,
    /// Simulated seconds of steady state per protocol.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// v2's safety-net full sync interval, seconds.
    #[arg(long, default_value_t = 300)]
    pub safety_interval: u64,
    /// Which protocols: v1, v2 or both.
    #[arg(long, default_value = "both")]
    pub protocol: String,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    #[arg(long, default_value = "bench-out/antientropy")]
    pub out: PathBuf,
}

/// One protocol's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Figures {
    pub protocol: u32,
    pub workers: usize,
    pub blocks: u64,
    pub simulated_s: f64,
    pub bytes_per_s: f64,
    pub sync_bytes_per_s: f64,
    /// Router handler time per simulated second (cores).
    pub router_cores: f64,
    pub full_syncs: u64,
    pub repairs: u64,
    pub pushes: u64,
    pub lost: u64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookup_p999_us: f64,
    pub lookup_max_us: f64,
    pub lookup_p99_during_sync_us: f64,
    pub lookup_max_during_sync_us: f64,
    pub lookups_during_sync: u64,
    /// Read-lock acquisition alone.
    pub lock_wait_p99_us: f64,
    pub lock_wait_max_us: f64,
    /// From a lost push to the router's map equal to the worker's again.
    pub heal_p50_ms: f64,
    pub heal_max_ms: f64,
    pub heals: u64,
    /// Router handler time of one initial (registration) full sync.
    pub initial_sync_ms: f64,
    pub rss_bytes_per_entry: f64,
    /// Every worker whose last loss was followed by a push is equal again.
    pub healed_all: bool,
    /// Workers whose map differs at the end (losses in the last round; v1:
    /// silent losses not yet resynced).
    pub unhealed_at_end: usize,
}

/// The summary line and the figures of every protocol run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub runs: Vec<Figures>,
}

/// One synthetic sidecar: its keys are `key(w, i)` for `i` in `lo..hi`.
struct Sidecar {
    id: WorkerId,
    w: u64,
    lo: u64,
    hi: u64,
    digest: KeyDigest,
    seq: u64,
    epoch: String,
    clock: Option<u64>,
    /// The next push is a repair (v2) or a full sync (v1) after a loss.
    repair_due: bool,
    sync_due: bool,
    /// A silent loss not yet healed: when it happened (simulated ms).
    lost_at: Option<u64>,
    next_sync_ms: u64,
}

fn key(w: u64, i: u64) -> BlockKey {
    BlockKey(mix(BlockKey((w << 40) | i)))
}

fn hex(keys: impl Iterator<Item = BlockKey>) -> Vec<String> {
    keys.map(|k| k.to_string()).collect()
}

impl Sidecar {
    fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        (self.lo..self.hi).map(|i| key(self.w, i))
    }

    fn sync_body(&mut self, v2: bool, now_ms: u64) -> Value {
        self.seq += 1;
        let mut b = json!({"worker_id": self.id, "epoch": self.epoch, "seq": self.seq,
            "url": format!("http://10.0.{}.{}:8000", self.w / 250, self.w % 250 + 1), "hashes": hex(self.keys())});
        if v2 {
            b["digest"] = serde_json::to_value(self.digest).unwrap_or_default();
            if let Some(c) = self.clock {
                b["covers"] = json!(c);
            }
        } else {
            b["as_of_ms"] = json!(now_ms);
        }
        b
    }

    /// Advances the window by `churn` and returns the push for it; with
    /// `repair`, also the current state of the last deltas' `back` keys.
    fn delta_body(&mut self, v2: bool, churn: u64, repair: Option<u64>) -> Value {
        let stored: Vec<BlockKey> = (self.hi..self.hi + churn).map(|i| key(self.w, i)).collect();
        let evicted: Vec<BlockKey> = (self.lo..self.lo + churn).map(|i| key(self.w, i)).collect();
        for &k in &stored {
            self.digest.insert(k);
        }
        for &k in &evicted {
            self.digest.remove(k);
        }
        let (mut stored_all, mut evicted_all) = (stored, evicted);
        if let Some(back) = repair {
            // The current state of every key of the last deltas.
            stored_all.extend((self.hi.saturating_sub(back)..self.hi).map(|i| key(self.w, i)));
            evicted_all.extend((self.lo.saturating_sub(back)..self.lo).map(|i| key(self.w, i)));
        }
        self.hi += churn;
        self.lo += churn;
        self.seq += 1;
        let mut b = json!({"worker_id": self.id, "epoch": self.epoch, "seq": self.seq,
            "stored_hashes": hex(stored_all.into_iter()), "evicted_hashes": hex(evicted_all.into_iter()),
            "load": {"running": 4, "waiting": 0, "kv_usage": 0.9}});
        if v2 {
            b["digest"] = serde_json::to_value(self.digest).unwrap_or_default();
        }
        b
    }
}

/// Calls the router's app with one push; the ack, the body size and the
/// handler time.
async fn post(state: &Arc<AppState>, path: &str, v2: bool, body: &Value) -> (Value, usize, Duration) {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let size = bytes.len();
    let req = Request::post(path)
        .header("content-type", "application/json")
        .header("x-kvroute-protocol", if v2 { "2" } else { "1" })
        .body(Body::from(bytes))
        .unwrap_or_default();
    let t = Instant::now();
    let resp = app(state.clone()).oneshot(req).await;
    let ack = match resp {
        Ok(r) => r.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default(),
        Err(never) => match never {},
    };
    let took = t.elapsed();
    (serde_json::from_slice(&ack).unwrap_or(Value::Null), size, took)
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        })
        .map_or(0, |kb| kb * 1024)
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds and precision")
}

/// Routing lookups until `stop`: read lock + longest-prefix match of 32
/// consecutive keys of a random worker's current window.
/// Latencies of lookups outside and during full syncs, and of the read-lock
/// acquisitions alone (a long lookup whose lock came at once was a thread
/// descheduled, not a lock held too long).
fn lookups(
    state: Arc<AppState>,
    windows: Arc<Vec<AtomicU64>>,
    syncing: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> (Histogram<u64>, Histogram<u64>, Histogram<u64>) {
    let (mut calm, mut during, mut waits) = (hist(), hist(), hist());
    let mut rng = StdRng::seed_from_u64(99);
    let mut keys = Vec::with_capacity(32);
    while !stop.load(Ordering::Relaxed) {
        let w = rng.gen_range(0..windows.len());
        let hi = windows[w].load(Ordering::Relaxed);
        keys.clear();
        keys.extend((hi.saturating_sub(1_000)..hi.saturating_sub(968)).map(|i| key(w as u64, i)));
        let in_sync = syncing.load(Ordering::Relaxed);
        let t = Instant::now();
        let map = state.map.read();
        let locked = t.elapsed();
        let depth = map.index.match_depths(&keys).len();
        drop(map);
        let ns = t.elapsed().as_nanos() as u64;
        std::hint::black_box(depth);
        let h = if in_sync { &mut during } else { &mut calm };
        let _ = h.record(ns.max(1));
        let _ = waits.record((locked.as_nanos() as u64).max(1));
    }
    (calm, during, waits)
}

async fn run_protocol(args: &AntientropyArgs, v2: bool) -> Result<Figures, BenchError> {
    let raw = RawConfig { max_sync_keys: (args.blocks as usize * 2).max(4_000_000), ..RawConfig::default() };
    let config = raw.validate().map_err(|e| BenchError::Usage(format!("router config: {e}")))?;
    let state = build_state(config, CancellationToken::new()).map_err(|e| BenchError::Usage(e.to_string()))?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let rss_before = rss_bytes();
    let mut sidecars: Vec<Sidecar> = (0..args.workers as u64)
        .map(|w| Sidecar {
            id: WorkerId::new(format!("w{w}")),
            w,
            lo: 0,
            hi: args.blocks,
            digest: KeyDigest::of((0..args.blocks).map(|i| key(w, i))),
            seq: 0,
            epoch: format!("0190000000000000{w:04x}"),
            clock: None,
            repair_due: false,
            sync_due: false,
            lost_at: None,
            next_sync_ms: 0,
        })
        .collect();
    let sync_every = if v2 { args.safety_interval * 1000 } else { V1_SYNC_MS };
    let n = sidecars.len() as u64;
    let mut initial = Duration::ZERO;
    for (i, s) in sidecars.iter_mut().enumerate() {
        let body = s.sync_body(v2, 0);
        let (ack, _, took) = post(&state, "/internal/sync", v2, &body).await;
        if ack["outcome"] != "applied" {
            return Err(BenchError::Usage(format!("initial sync of {} not applied: {ack}", s.id)));
        }
        s.clock = ack["clock"].as_u64();
        initial += took;
        // Periodic syncs staggered over the interval.
        s.next_sync_ms = (i as u64 + 1) * sync_every / n;
    }
    let entries = args.workers as u64 * args.blocks;
    let rss_per_entry = rss_bytes().saturating_sub(rss_before) as f64 / entries as f64;
    eprintln!(
        "v{}: {} workers × {} keys registered ({:.0} ms of router time each), {:.1} B/entry RSS",
        if v2 { 2 } else { 1 },
        args.workers,
        args.blocks,
        initial.as_secs_f64() * 1e3 / n as f64,
        rss_per_entry
    );

    let windows: Arc<Vec<AtomicU64>> = Arc::new(sidecars.iter().map(|s| AtomicU64::new(s.hi)).collect());
    let syncing = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (state, windows, syncing, stop) = (state.clone(), windows.clone(), syncing.clone(), stop.clone());
        std::thread::spawn(move || lookups(state, windows, syncing, stop))
    };

    let (mut bytes, mut sync_bytes, mut busy) = (0u64, 0u64, Duration::ZERO);
    let (mut full_syncs, mut repairs, mut pushes, mut lost) = (0u64, 0u64, 0u64, 0u64);
    let mut heals: Vec<f64> = Vec::new();
    let end_ms = args.seconds * 1000;
    let mut t_ms = 0u64;
    while t_ms < end_ms {
        t_ms += FAST_MS;
        if t_ms.is_multiple_of(1000) {
            // The router's housekeeping: reverse vectors compacted off the lock.
            let t = Instant::now();
            kvroute_router::health::compact_reverse_vectors(&state);
            busy += t.elapsed();
        }
        for s in sidecars.iter_mut() {
            let periodic = t_ms >= s.next_sync_ms;
            if periodic {
                s.next_sync_ms += sync_every;
            }
            if periodic || s.sync_due {
                // The window moves on meanwhile; the sync carries it whole.
                s.lo += args.churn;
                s.hi += args.churn;
                s.digest = KeyDigest::of(s.keys());
                let body = s.sync_body(v2, t_ms);
                syncing.store(true, Ordering::Relaxed);
                let (ack, size, took) = post(&state, "/internal/sync", v2, &body).await;
                syncing.store(false, Ordering::Relaxed);
                s.clock = ack["clock"].as_u64().or(s.clock);
                (bytes, sync_bytes, busy) = (bytes + size as u64, sync_bytes + size as u64, busy + took);
                full_syncs += 1;
                pushes += 1;
                if let Some(at) = s.lost_at.take() {
                    heals.push((t_ms - at) as f64 + took.as_secs_f64() * 1e3);
                }
                s.sync_due = false;
                s.repair_due = false;
                continue;
            }
            let repair = v2 && s.repair_due;
            s.repair_due = false;
            let back = args.churn * REPAIR_WINDOW;
            let body = s.delta_body(v2, args.churn, repair.then_some(back));
            repairs += u64::from(repair);
            pushes += 1;
            if rng.r#gen::<f64>() < args.loss {
                lost += 1;
                if rng.gen_bool(0.5) {
                    // Visible: the sidecar saw the error.
                    if v2 {
                        s.repair_due = true;
                    } else {
                        s.sync_due = true;
                    }
                }
                s.lost_at.get_or_insert(t_ms);
                continue;
            }
            let (ack, size, mut took) = post(&state, "/internal/eviction", v2, &body).await;
            (bytes, busy) = (bytes + size as u64, busy + took);
            s.clock = ack["clock"].as_u64().or(s.clock);
            let mut in_sync = ack["resync"] != true;
            if !in_sync {
                // The digests differ: the repair follows in the same round.
                let body = s.delta_body(v2, 0, Some(back));
                repairs += 1;
                pushes += 1;
                let (ack2, size2, took2) = post(&state, "/internal/eviction", v2, &body).await;
                (bytes, busy, took) = (bytes + size2 as u64, busy + took2, took + took2);
                in_sync = ack2["resync"] != true;
                s.sync_due = !in_sync;
            }
            windows[s.w as usize].store(s.hi, Ordering::Relaxed);
            if v2
                && in_sync
                && let Some(at) = s.lost_at.take()
            {
                heals.push((t_ms - at) as f64 + took.as_secs_f64() * 1e3);
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (calm, during, waits) = reader.join().unwrap_or_else(|_| (hist(), hist(), hist()));
    let mut all = calm.clone();
    let _ = all.add(&during);
    // Is every worker's map equal to its sidecar's set, but for losses in
    // the last round (not yet followed by a push that could heal them)?
    let (healed_all, unhealed_at_end) = {
        let map = state.map.read();
        let equal = |s: &Sidecar| state.workers.get(&s.id).is_some_and(|w| map.index.digest(w.slot) == s.digest);
        let mut settled = sidecars.iter().filter(|s| s.lost_at.is_none_or(|at| at + FAST_MS < t_ms));
        (settled.all(equal), sidecars.iter().filter(|s| !equal(s)).count())
    };
    heals.sort_by(f64::total_cmp);
    let secs = end_ms as f64 / 1e3;
    Ok(Figures {
        protocol: if v2 { 2 } else { 1 },
        workers: args.workers,
        blocks: args.blocks,
        simulated_s: secs,
        bytes_per_s: bytes as f64 / secs,
        sync_bytes_per_s: sync_bytes as f64 / secs,
        router_cores: busy.as_secs_f64() / secs,
        full_syncs,
        repairs,
        pushes,
        lost,
        lookup_p50_us: all.value_at_quantile(0.5) as f64 / 1e3,
        lookup_p99_us: all.value_at_quantile(0.99) as f64 / 1e3,
        lookup_p999_us: all.value_at_quantile(0.999) as f64 / 1e3,
        lookup_max_us: all.max() as f64 / 1e3,
        lookup_p99_during_sync_us: during.value_at_quantile(0.99) as f64 / 1e3,
        lookup_max_during_sync_us: during.max() as f64 / 1e3,
        lookups_during_sync: during.len(),
        lock_wait_p99_us: waits.value_at_quantile(0.99) as f64 / 1e3,
        lock_wait_max_us: waits.max() as f64 / 1e3,
        heal_p50_ms: heals.get(heals.len() / 2).copied().unwrap_or(0.0),
        heal_max_ms: heals.last().copied().unwrap_or(0.0),
        heals: heals.len() as u64,
        initial_sync_ms: initial.as_secs_f64() * 1e3 / n as f64,
        rss_bytes_per_entry: rss_per_entry,
        healed_all,
        unhealed_at_end,
    })
}

pub async fn run(args: AntientropyArgs) -> Result<Report, BenchError> {
    if args.workers == 0 || args.workers > kvroute_router::index::MAX_WORKERS {
        return Err(BenchError::Usage(format!("--workers must be 1 to {}", kvroute_router::index::MAX_WORKERS)));
    }
    let protocols: Vec<bool> = match args.protocol.as_str() {
        "v1" => vec![false],
        "v2" => vec![true],
        _ => vec![false, true],
    };
    let mut runs = Vec::new();
    for v2 in protocols {
        runs.push(run_protocol(&args, v2).await?);
    }
    let write = |path: PathBuf| move |source| BenchError::Write { path, source };
    std::fs::create_dir_all(&args.out).map_err(write(args.out.clone()))?;
    let report = Report { runs };
    // results.json, like every other subcommand: the run (commit, arguments,
    // machine) and the figures.
    crate::report::write_results(&args.out, &args, &report)?;
    for f in &report.runs {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At a small scale: v2 heals every loss (digests agree at the end) and
    /// receives a fraction of v1's bytes, whose full syncs dominate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v2_heals_every_loss_with_far_fewer_bytes_than_v1() {
        let args = AntientropyArgs {
            workers: 4,
            blocks: 20_000,
            churn: 16,
            loss: 0.05,
            seconds: 6,
            safety_interval: 300,
            protocol: "both".into(),
            seed: 3,
            out: std::env::temp_dir(),
        };
        let v1 = run_protocol(&args, false).await.unwrap();
        let v2 = run_protocol(&args, true).await.unwrap();
        assert!(v2.lost > 0 && v2.heals > 0, "{v2:?}");
        assert!(v2.healed_all, "{v2:?}");
        assert_eq!(v2.full_syncs, 0, "repairs, not syncs: {v2:?}");
        assert!(v2.bytes_per_s * 10.0 < v1.bytes_per_s, "v1 {} B/s, v2 {} B/s", v1.bytes_per_s, v2.bytes_per_s);
    }
}
