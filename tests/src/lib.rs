//! Harness for kvroute's end-to-end tests: starts the real binaries (engines,
//! sidecars, routers) as a local cluster on loopback and talks HTTP to them.
//!
//! Binaries come from the workspace's `target/debug` (`scripts/test.sh` builds
//! them first); a test run without them builds them once.

pub mod lossy;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvroute_sim::cluster::{Cluster, ClusterSpec};
use serde_json::{Value, json};

/// Where cargo puts this profile's binaries.
pub fn bin_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvroute_shared::testdata::workspace_root().join("target"));
    target.join("debug")
}

/// Makes sure the three binaries exist (built once per test process).
pub fn ensure_built() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = bin_dir();
            let missing = ["kvroute-sim", "kvroute-router", "kvroute-sidecar"].iter().any(|b| !dir.join(b).is_file());
            if missing {
                let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
                let ok = std::process::Command::new(cargo)
                    .args(["build", "-p", "kvroute-sim", "-p", "kvroute-router", "-p", "kvroute-sidecar", "--bins"])
                    .current_dir(kvroute_shared::testdata::workspace_root())
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "could not build the kvroute binaries (run `cargo build --workspace --bins`)");
            }
            dir
        })
        .clone()
}

/// A cluster spec for tests: fast simulated engines, fast sidecar pushes.
pub fn spec(workers: usize) -> ClusterSpec {
    ClusterSpec {
        workers,
        bin_dir: ensure_built(),
        // Real-time costs divided by 50: prefills take milliseconds.
        sim_args: vec!["--time-scale".into(), "50".into()],
        sidecar_args: vec!["--sync-interval".into(), "1s".into()],
        ..ClusterSpec::default()
    }
}

pub async fn start(spec: ClusterSpec) -> Cluster {
    match Cluster::start(spec).await {
        Ok(c) => c,
        Err(e) => panic!("cluster did not start: {e}"),
    }
}

/// Polls `check` until it returns `Some`, for at most `within`; the poll
/// backs off from 10 ms to 200 ms. Panics with `what` on timeout.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(started.elapsed() < within, "timed out after {within:?} waiting for: {what}");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// A prompt of about `words` words, distinct per `seed`.
pub fn text(seed: u64, words: usize) -> String {
    (0..words).map(|i| format!("w{}x{}", seed, i % 97)).collect::<Vec<_>>().join(" ")
}

#[derive(Clone, Debug)]
pub struct Client {
    pub http: reqwest::Client,
}

impl Default for Client {
    fn default() -> Self {
        Client { http: reqwest::Client::new() }
    }
}

impl Client {
    /// Sends a completion; returns (worker, body).
    pub async fn complete(&self, base: &str, prompt: &str, max_tokens: u32) -> (String, Value) {
        let resp = self
            .http
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}))
            .send()
            .await
            .expect("router answers");
        assert!(resp.status().is_success(), "status {}", resp.status());
        let worker = resp.headers()["x-kvroute-worker"].to_str().expect("ascii").to_owned();
        (worker, resp.json().await.expect("json body"))
    }

    pub async fn debug_route(&self, base: &str, prompt: &str) -> Value {
        self.http
            .post(format!("{base}/debug/route"))
            .json(&json!({"model": "sim-model", "prompt": prompt}))
            .send()
            .await
            .expect("router answers")
            .json()
            .await
            .expect("json")
    }

    pub async fn get(&self, url: &str) -> Value {
        self.http.get(url).send().await.expect("answers").json().await.expect("json")
    }

    pub async fn post(&self, url: &str, body: Value) -> reqwest::Response {
        self.http.post(url).json(&body).send().await.expect("answers")
    }

    /// A metric from `base`'s Prometheus text, summed over its label sets
    /// (series exist at 0 from the start, so the first line is not
    /// necessarily the one that moved); NaN when absent.
    pub async fn metric(&self, base: &str, name: &str) -> f64 {
        let text = self.http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        let values: Vec<f64> = text
            .lines()
            .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        if values.is_empty() { f64::NAN } else { values.iter().sum() }
    }
}

/// An engine's cached blocks as router keys (`GET /sim/cache`): the truth.
pub async fn truth(c: &Client, engine: &str) -> Vec<Value> {
    c.get(&format!("{engine}/sim/cache")).await["block_keys"].as_array().cloned().unwrap_or_default()
}

pub async fn confirmed(c: &Client, router: &str, worker: &str) -> Vec<Value> {
    c.get(&format!("{router}/debug/index?worker={worker}")).await["confirmed"].as_array().cloned().unwrap_or_default()
}

/// Waits until every worker's entries on `router` are exactly its engine's
/// cached blocks: all confirmed, none speculative left over.
pub async fn converge(c: &Client, router: &str, engines: &[String], within: Duration, what: &str) {
    let targets: Vec<(String, String)> =
        engines.iter().enumerate().map(|(i, e)| (format!("w{}", i + 1), format!("{e}/sim/cache"))).collect();
    converge_targets(c, router, &targets, within, what).await;
}

/// [`converge`] for explicit `(worker id, GET /sim/cache URL)` pairs (e.g.
/// one per data-parallel rank: `/sim/cache?rank=R`).
pub async fn converge_targets(c: &Client, router: &str, targets: &[(String, String)], within: Duration, what: &str) {
    let started = Instant::now();
    loop {
        let mut diffs = Vec::new();
        for (worker, cache) in targets {
            let want = c.get(cache).await["block_keys"].as_array().cloned();
            let want = want.unwrap_or_else(|| panic!("{cache} names no block_keys"));
            let index = c.get(&format!("{router}/debug/index?worker={worker}")).await;
            // A worker the router does not know (yet) has not converged,
            // even to an empty engine.
            let Some(got) = index["confirmed"].as_array().cloned() else {
                diffs.push(format!("{worker}: not in the router's index ({index})"));
                continue;
            };
            let speculative = index["speculative"].as_array().map_or(0, Vec::len);
            if got != want || speculative > 0 {
                let missing = want.iter().filter(|k| !got.contains(k)).count();
                let extra = got.iter().filter(|k| !want.contains(k)).count();
                diffs.push(format!(
                    "{worker}: engine {} keys, router {} (+{extra} −{missing}), {speculative} speculative",
                    want.len(),
                    got.len()
                ));
            }
        }
        if diffs.is_empty() {
            return;
        }
        assert!(started.elapsed() < within, "timed out waiting for {what}: {}", diffs.join("; "));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A worker's matched blocks in a `/debug/route` answer.
pub fn matched(debug: &Value, worker: &str) -> u64 {
    debug["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["id"] == worker))
        .and_then(|w| w["matched_blocks"].as_u64())
        .unwrap_or(0)
}
