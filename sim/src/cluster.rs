//! A local kvroute cluster as child processes on loopback: N simulated
//! engines, one sidecar per engine, and one or more routers, every port chosen
//! by the OS and read back from the children's `listening on …` lines.
//!
//! Used by `kvroute-sim cluster` (the README's first command), the end-to-end
//! tests and the benchmark suite, so all three run the same topology.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// The internal token the local cluster's routers and sidecars share.
pub const LOCAL_TOKEN: &str = "kvroute-local-cluster-token";

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot find {name} in {dir} (build it: cargo build --release --bins)")]
    MissingBinary { name: String, dir: PathBuf },
    #[error("building {0} failed")]
    Build(String),
    #[error("cannot start {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited before it was ready; its last lines:\n{log}")]
    DiedEarly { name: String, log: String },
    #[error("{name} did not become ready within {secs} s; its last lines:\n{log}")]
    NotReady { name: String, secs: u64, log: String },
    #[error("not supported: {0}")]
    Unsupported(&'static str),
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub workers: usize,
    pub routers: usize,
    /// Router replicas exchange what they have in flight per worker
    /// (`--replica`): each router is given every router started before it,
    /// so every pair has one link.
    pub replica_exchange: bool,
    /// Sidecars push engine events; without them routers index approximately.
    pub sidecars: bool,
    /// Port of the first router (0 = any free port).
    pub port: u16,
    pub policy: String,
    pub model: String,
    pub block_size: u32,
    pub num_blocks: u32,
    pub tokenizer: Option<PathBuf>,
    /// Extra flags for every engine (e.g. `--time-scale 10`, `--instant`).
    pub sim_args: Vec<String>,
    pub router_args: Vec<String>,
    pub sidecar_args: Vec<String>,
    /// Where the three binaries are.
    pub bin_dir: PathBuf,
    /// Data-parallel ranks per engine (vLLM's internal load balancing: one
    /// API for every rank); each rank is a routing target, `wN-dpR`.
    pub data_parallel_size: u32,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        ClusterSpec {
            workers: 3,
            routers: 1,
            replica_exchange: true,
            sidecars: true,
            port: 0,
            policy: "predicted_ttft".into(),
            model: "sim-model".into(),
            block_size: 16,
            num_blocks: 2048,
            tokenizer: None,
            sim_args: Vec::new(),
            router_args: Vec::new(),
            sidecar_args: Vec::new(),
            bin_dir: PathBuf::new(),
            data_parallel_size: 1,
        }
    }
}

/// A running child with the tail of its output.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    bin: PathBuf,
    args: Vec<String>,
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    lines: mpsc::UnboundedReceiver<String>,
}

const TAIL: usize = 40;
const READY_TIMEOUT: Duration = Duration::from_secs(60);

impl Proc {
    pub async fn spawn(name: &str, bin: &Path, args: &[String]) -> Result<Proc, ClusterError> {
        let mut child = Command::new(bin)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .env("KVROUTE_LOG", std::env::var("KVROUTE_LOG").unwrap_or_else(|_| "info".into()))
            .spawn()
            .map_err(|source| ClusterError::Spawn { name: name.into(), source })?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, lines) = mpsc::unbounded_channel();
        for (stream, is_stdout) in [
            (child.stdout.take().map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>), true),
            (child.stderr.take().map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>), false),
        ] {
            let Some(stream) = stream else { continue };
            let tail = tail.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    {
                        let mut t = tail.lock();
                        if t.len() == TAIL {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    if is_stdout {
                        let _ = tx.send(line);
                    }
                }
            });
        }
        Ok(Proc { name: name.into(), bin: bin.into(), args: args.to_vec(), child, tail, lines })
    }

    /// The child's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The last lines the child printed.
    pub fn log(&self) -> String {
        self.tail.lock().iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Waits for a stdout line starting with `prefix`; returns the rest.
    pub async fn announced(&mut self, prefix: &str) -> Result<String, ClusterError> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Ok(rest.trim().to_owned());
                    }
                }
                Ok(None) => {
                    // Output closed: the child is gone. Give its reader a moment
                    // to store the last lines by waiting for the exit.
                    let _ = self.child.wait().await;
                    return Err(ClusterError::DiedEarly { name: self.name.clone(), log: self.log() });
                }
                Err(_) => {
                    return Err(ClusterError::NotReady {
                        name: self.name.clone(),
                        secs: READY_TIMEOUT.as_secs(),
                        log: self.log(),
                    });
                }
            }
        }
    }

    /// SIGKILL, no goodbye (fault injection).
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Polite stop: SIGTERM, then SIGKILL after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
            if tokio::time::timeout(grace, self.child.wait()).await.is_ok() {
                return;
            }
        }
        self.kill().await;
    }

    /// A fresh child with the same binary and arguments.
    pub async fn respawn(&self) -> Result<Proc, ClusterError> {
        Proc::spawn(&self.name, &self.bin, &self.args).await
    }

    /// `Some(status)` once the child has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// One simulated engine with the endpoints it announced.
#[derive(Debug)]
pub struct Engine {
    pub proc: Proc,
    pub url: String,
    /// Rank 0's event and replay endpoints.
    pub events: String,
    pub replay: String,
    /// Every data-parallel rank's, rank 0 first (ports bound as 0 are not
    /// base + rank, so the sidecar is given the list).
    pub rank_events: Vec<String>,
    pub rank_replays: Vec<String>,
}

impl Engine {
    /// Reads the endpoints a starting `kvroute-sim` announces, rank by rank.
    async fn announced(mut proc: Proc, ranks: u32) -> Result<Engine, ClusterError> {
        let url = proc.announced("listening on ").await?;
        let mut rank_events = vec![proc.announced("kv-events on ").await?];
        let mut rank_replays = vec![proc.announced("kv-replay on ").await?];
        for r in 1..ranks {
            rank_events.push(proc.announced(&format!("kv-events rank {r} on ")).await?);
            rank_replays.push(proc.announced(&format!("kv-replay rank {r} on ")).await?);
        }
        Ok(Engine {
            proc,
            url,
            events: rank_events[0].clone(),
            replay: rank_replays[0].clone(),
            rank_events,
            rank_replays,
        })
    }
}

#[derive(Debug)]
pub struct Sidecar {
    pub proc: Proc,
    pub url: String,
}

#[derive(Debug)]
pub struct RouterProc {
    pub proc: Proc,
    pub url: String,
}

/// A running local cluster; children die with it.
#[derive(Debug)]
pub struct Cluster {
    pub spec: ClusterSpec,
    pub engines: Vec<Engine>,
    pub sidecars: Vec<Sidecar>,
    pub routers: Vec<RouterProc>,
}

pub fn worker_id(i: usize) -> String {
    format!("w{}", i + 1)
}

fn bin(spec: &ClusterSpec, name: &str) -> Result<PathBuf, ClusterError> {
    let path = spec.bin_dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(ClusterError::MissingBinary { name: name.into(), dir: spec.bin_dir.clone() })
    }
}

/// Under `cargo run`, builds the sibling binaries the cluster needs: cargo
/// only rebuilt kvroute-sim, and a router or sidecar left from an older
/// checkout must not run beside it (a no-op when they are current). It builds
/// `--workspace --bins`, exactly as `scripts/test.sh` does, so the two share
/// one set of compiled dependencies. Outside cargo they must already be there.
pub fn ensure_binaries(bin_dir: &Path) -> Result<(), ClusterError> {
    let missing: Vec<&str> =
        ["kvroute-router", "kvroute-sidecar"].into_iter().filter(|n| !bin_dir.join(n).is_file()).collect();
    let Some(cargo) = std::env::var_os("CARGO") else {
        if missing.is_empty() {
            return Ok(());
        }
        return Err(ClusterError::MissingBinary { name: missing.join(", "), dir: bin_dir.into() });
    };
    let release = bin_dir.file_name().is_some_and(|n| n == "release");
    eprintln!("building the workspace's binaries (if out of date) …");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "--workspace", "--bins"]);
    if release {
        cmd.arg("--release");
    }
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        _ => Err(ClusterError::Build("kvroute-router, kvroute-sidecar".into())),
    }
}

impl Cluster {
    pub async fn start(spec: ClusterSpec) -> Result<Cluster, ClusterError> {
        let sim_bin = bin(&spec, "kvroute-sim")?;
        let router_bin = bin(&spec, "kvroute-router")?;
        let sidecar_bin = bin(&spec, "kvroute-sidecar")?;

        let mut engines = Vec::new();
        for i in 0..spec.workers {
            let mut args: Vec<String> = vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--model".into(),
                spec.model.clone(),
                "--block-size".into(),
                spec.block_size.to_string(),
                "--num-blocks".into(),
                spec.num_blocks.to_string(),
                "--kv-events-endpoint".into(),
                "tcp://127.0.0.1:0".into(),
                "--kv-events-replay-endpoint".into(),
                "tcp://127.0.0.1:0".into(),
            ];
            if let Some(t) = &spec.tokenizer {
                args.extend(["--tokenizer".into(), t.display().to_string()]);
            }
            if spec.data_parallel_size > 1 {
                args.extend(["--data-parallel-size".into(), spec.data_parallel_size.to_string()]);
            }
            args.extend(spec.sim_args.iter().cloned());
            let proc = Proc::spawn(&format!("engine {}", worker_id(i)), &sim_bin, &args).await?;
            engines.push(Engine::announced(proc, spec.data_parallel_size).await?);
        }

        let mut routers: Vec<RouterProc> = Vec::new();
        for r in 0..spec.routers {
            let port = if r == 0 { spec.port } else { 0 };
            let mut args: Vec<String> = vec!["--listen".into(), format!("127.0.0.1:{port}")];
            args.extend(policy_args(&spec.policy));
            args.extend([
                "--block-size".into(),
                spec.block_size.to_string(),
                "--internal-token".into(),
                LOCAL_TOKEN.into(),
            ]);
            if let Some(t) = &spec.tokenizer {
                args.extend(["--tokenizer".into(), t.display().to_string()]);
            }
            if !spec.sidecars {
                for (i, e) in engines.iter().enumerate() {
                    if spec.data_parallel_size > 1 {
                        for r in 0..spec.data_parallel_size {
                            args.extend(["--worker".into(), format!("{}-dp{r}={}#dp-rank={r}", worker_id(i), e.url)]);
                        }
                    } else {
                        args.extend(["--worker".into(), format!("{}={}", worker_id(i), e.url)]);
                    }
                }
            }
            if spec.replica_exchange {
                for earlier in &routers {
                    args.extend(["--replica".into(), earlier.url.clone()]);
                }
            }
            args.extend(spec.router_args.iter().cloned());
            let mut proc = Proc::spawn(&format!("router {}", r + 1), &router_bin, &args).await?;
            let url = proc.announced("listening on ").await?;
            routers.push(RouterProc { proc, url });
        }

        let mut sidecars = Vec::new();
        if spec.sidecars {
            for (i, e) in engines.iter().enumerate() {
                let mut args: Vec<String> = vec![
                    "--worker-id".into(),
                    worker_id(i),
                    "--engine-url".into(),
                    e.url.clone(),
                    "--events".into(),
                    e.rank_events.join(","),
                    "--replay".into(),
                    e.rank_replays.join(","),
                    "--data-parallel-size".into(),
                    spec.data_parallel_size.to_string(),
                    "--model".into(),
                    spec.model.clone(),
                    "--block-size".into(),
                    spec.block_size.to_string(),
                    "--internal-token".into(),
                    LOCAL_TOKEN.into(),
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                ];
                for r in &routers {
                    args.extend(["--router".into(), r.url.clone()]);
                }
                args.extend(spec.sidecar_args.iter().cloned());
                let mut proc = Proc::spawn(&format!("sidecar {}", worker_id(i)), &sidecar_bin, &args).await?;
                let url = proc.announced("listening on ").await?;
                sidecars.push(Sidecar { proc, url });
            }
        }

        let cluster = Cluster { spec, engines, sidecars, routers };
        for r in 0..cluster.routers.len() {
            cluster.wait_router_ready(r).await?;
        }
        Ok(cluster)
    }

    pub fn router_url(&self, i: usize) -> &str {
        &self.routers[i].url
    }

    /// Waits until router `i` lists every worker as healthy (for sidecar
    /// clusters: every sidecar has registered by sync).
    pub async fn wait_router_ready(&self, i: usize) -> Result<(), ClusterError> {
        let targets = self.engines.len() * self.spec.data_parallel_size as usize;
        wait_router_ready(&self.routers[i].proc, &self.routers[i].url, targets).await
    }

    /// Restarts router `i` (after a kill) on the same port; sidecars notice
    /// the new `router_epoch` and resync.
    pub async fn restart_router(&mut self, i: usize) -> Result<(), ClusterError> {
        let url = self.routers[i].url.clone();
        let port = url.rsplit(':').next().unwrap_or("0").to_owned();
        let mut args = self.routers[i].proc.args.clone();
        if let Some(pos) = args.iter().position(|a| a == "--listen") {
            args[pos + 1] = format!("127.0.0.1:{port}");
        }
        let bin = self.routers[i].proc.bin.clone();
        let mut proc = Proc::spawn(&self.routers[i].proc.name, &bin, &args).await?;
        let url = proc.announced("listening on ").await?;
        self.routers[i] = RouterProc { proc, url };
        Ok(())
    }

    /// Restarts engine `i` (after a kill) on the same HTTP and ZMQ ports, as
    /// a restarted vLLM pod would come back: empty cache, event sequence from 0.
    pub async fn restart_engine(&mut self, i: usize) -> Result<(), ClusterError> {
        if self.spec.data_parallel_size > 1 {
            // Its ranks were bound to free ports, not base + rank.
            return Err(ClusterError::Unsupported("restarting a data-parallel engine on the same ports"));
        }
        let e = &self.engines[i];
        let port = e.url.rsplit(':').next().unwrap_or("0").to_owned();
        let mut args = e.proc.args.clone();
        for (flag, value) in [
            ("--listen", format!("127.0.0.1:{port}")),
            ("--kv-events-endpoint", e.events.clone()),
            ("--kv-events-replay-endpoint", e.replay.clone()),
        ] {
            if let Some(pos) = args.iter().position(|a| a == flag) {
                args[pos + 1] = value;
            }
        }
        let bin = e.proc.bin.clone();
        let proc = Proc::spawn(&e.proc.name, &bin, &args).await?;
        self.engines[i] = Engine::announced(proc, 1).await?;
        Ok(())
    }

    /// Restarts sidecar `i` (after a kill) with the same arguments.
    pub async fn restart_sidecar(&mut self, i: usize) -> Result<(), ClusterError> {
        let mut proc = self.sidecars[i].proc.respawn().await?;
        let url = proc.announced("listening on ").await?;
        self.sidecars[i] = Sidecar { proc, url };
        Ok(())
    }

    /// Replaces sidecar `i` with one pushing to `routers` instead (e.g. a
    /// fault-injecting proxy in front of the real router).
    pub async fn repoint_sidecar(&mut self, i: usize, routers: &[String]) -> Result<(), ClusterError> {
        self.sidecars[i].proc.kill().await;
        let old = &self.sidecars[i].proc;
        let mut args = Vec::new();
        let mut it = old.args.iter();
        while let Some(a) = it.next() {
            if a == "--router" {
                it.next();
            } else {
                args.push(a.clone());
            }
        }
        for r in routers {
            args.extend(["--router".to_owned(), r.clone()]);
        }
        let mut proc = Proc::spawn(&old.name, &old.bin.clone(), &args).await?;
        let url = proc.announced("listening on ").await?;
        self.sidecars[i] = Sidecar { proc, url };
        Ok(())
    }

    /// Stops everything: routers first (they drain), then sidecars (they
    /// flush), then engines.
    pub async fn shutdown(mut self) {
        let grace = Duration::from_secs(5);
        for r in &mut self.routers {
            r.proc.stop(grace).await;
        }
        for s in &mut self.sidecars {
            s.proc.stop(grace).await;
        }
        for e in &mut self.engines {
            e.proc.stop(grace).await;
        }
    }

    /// The first child that has exited, with its log.
    pub fn dead_child(&mut self) -> Option<(String, String)> {
        let procs = self
            .engines
            .iter_mut()
            .map(|e| &mut e.proc)
            .chain(self.sidecars.iter_mut().map(|s| &mut s.proc))
            .chain(self.routers.iter_mut().map(|r| &mut r.proc));
        for p in procs {
            if let Some(status) = p.exited() {
                return Some((format!("{} ({status})", p.name), p.log()));
            }
        }
        None
    }
}

/// A count of at least one (`--workers`, `--routers`).
fn at_least_one() -> impl clap::builder::TypedValueParser<Value = usize> {
    clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..), usize::from)
}

/// `kvroute-sim cluster`: flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Simulated engines (each with its own sidecar).
    #[arg(long, default_value_t = 3, value_parser = at_least_one())]
    pub workers: usize,
    /// Port of the (first) router; 0 picks a free one.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Router replicas fed by the same sidecars; they exchange what they
    /// have in flight per worker (`--replica`).
    #[arg(long, default_value_t = 1, value_parser = at_least_one())]
    pub routers: usize,
    /// The routers' policy, or a variant named as the lab names one
    /// (`predicted_ttft:room_ratio=0+pull_ratio=0.5`); the router refuses an
    /// unknown one at its start.
    #[arg(long, default_value = "predicted_ttft")]
    pub policy: String,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// HF tokenizer directory for engines and router (default: byte-level keys).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// KV-cache blocks per engine.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: u32,
    /// Divide the engines' modelled latencies by this.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Start no sidecars: routers index approximately.
    #[arg(long)]
    pub no_sidecars: bool,
    /// Data-parallel ranks per engine, each a routing target of its own
    /// (wN-dpR, pinned with X-data-parallel-rank).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: u32,
}

/// Runs the cluster until Ctrl-C / SIGTERM or until a child dies.
pub async fn run_cluster(args: ClusterArgs) -> Result<(), ClusterError> {
    let bin_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default();
    ensure_binaries(&bin_dir)?;
    let spec = ClusterSpec {
        workers: args.workers,
        routers: args.routers,
        sidecars: !args.no_sidecars,
        port: args.port,
        policy: args.policy.clone(),
        model: args.model.clone(),
        num_blocks: args.num_blocks,
        tokenizer: args.tokenizer.clone(),
        sim_args: vec!["--time-scale".into(), args.time_scale.to_string()],
        bin_dir,
        data_parallel_size: args.data_parallel_size,
        ..ClusterSpec::default()
    };
    let mut cluster = Cluster::start(spec).await?;
    let url = cluster.router_url(0).to_owned();
    println!(
        "kvroute local cluster: {} simulated engines, {} sidecars, {} router(s), policy {}",
        cluster.engines.len(),
        cluster.sidecars.len(),
        cluster.routers.len(),
        args.policy
    );
    // Every process, with where its Prometheus metrics are.
    for (i, r) in cluster.routers.iter().enumerate() {
        println!("router {:<3} {:<24} metrics {}/metrics", i + 1, r.url, r.url);
    }
    for (i, e) in cluster.engines.iter().enumerate() {
        println!(
            "engine {:<3} {:<24} metrics {}/metrics  KV events {}  replay {}",
            worker_id(i),
            e.url,
            e.url,
            e.rank_events.join(","),
            e.rank_replays.join(",")
        );
    }
    for (i, s) in cluster.sidecars.iter().enumerate() {
        println!("sidecar {:<2} {:<24} metrics {}/metrics", worker_id(i), s.url, s.url);
    }
    println!("try:");
    println!(
        "  curl -s {url}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"prompt\":\"You are a helpful assistant. Hello!\",\"max_tokens\":8}}' -i",
        args.model
    );
    println!("  curl -s {url}/admin/workers");
    println!("Ctrl-C stops everything.");
    let mut check = tokio::time::interval(Duration::from_millis(500));
    let died = loop {
        tokio::select! {
            _ = shutdown_signal() => break None,
            _ = check.tick() => {
                if let Some(dead) = cluster.dead_child() {
                    break Some(dead);
                }
            }
        }
    };
    if let Some((name, log)) = &died {
        eprintln!("{name} exited; its last lines:\n{log}");
    }
    eprintln!("stopping the cluster …");
    cluster.shutdown().await;
    match died {
        Some((name, log)) => Err(ClusterError::DiedEarly { name, log }),
        None => Ok(()),
    }
}

/// Waits until the router at `url` (process `proc`) lists `workers` healthy
/// workers, polling with backoff; used by the cluster and the benchmark rigs.
pub async fn wait_router_ready(proc: &Proc, url: &str, workers: usize) -> Result<(), ClusterError> {
    let client = reqwest::Client::new();
    let url = format!("{url}/admin/workers");
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        if let Ok(resp) = client.get(&url).send().await
            && let Ok(v) = resp.json::<serde_json::Value>().await
        {
            let healthy = v["workers"]
                .as_array()
                .map_or(0, |ws| ws.iter().filter(|w| w["healthy"] == serde_json::Value::Bool(true)).count());
            if healthy >= workers {
                return Ok(());
            }
        }
        if started.elapsed() > READY_TIMEOUT {
            return Err(ClusterError::NotReady {
                name: proc.name.clone(),
                secs: READY_TIMEOUT.as_secs(),
                log: proc.log(),
            });
        }
        // Polling a readiness endpoint with backoff, not a fixed sleep.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Ctrl-C or SIGTERM (the cluster command and the benchmarks stop on either).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The router's policy flags for `policy`, named as the lab names a policy
/// with parameters (`predicted_ttft:room_ratio=0+pull_ratio=0.5`): that
/// policy, with `--set predicted_ttft.room_ratio=0 --set
/// predicted_ttft.pull_ratio=0.5`.
pub fn policy_args(policy: &str) -> Vec<String> {
    let (name, params) = policy.split_once(':').unwrap_or((policy, ""));
    let mut args = vec!["--policy".to_owned(), name.to_owned()];
    for param in params.split('+').filter(|p| !p.is_empty()) {
        args.extend(["--set".to_owned(), format!("{name}.{param}")]);
    }
    args
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::ClusterArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ClusterArgs,
    }

    /// A cluster of no router (its sidecars refuse to start without one) or
    /// no worker is refused as the flags are read, not at start-up.
    #[test]
    fn a_cluster_has_at_least_one_router_and_one_worker() {
        for bad in [["x", "--routers", "0"], ["x", "--workers", "0"]] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
        let ok = Cli::try_parse_from(["x", "--routers", "2", "--workers", "4"]).unwrap();
        assert_eq!((ok.args.routers, ok.args.workers), (2, 4));
    }
}
