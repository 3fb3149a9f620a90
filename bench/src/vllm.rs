//! Real vLLM engines for `--engine vllm`: each one is `scripts/vllm-serve.sh`
//! (the CPU build serving the tiny random-weight Qwen3 with prefix caching,
//! KV events on ZMQ and the kvroute_hooks snapshot plugin) run as a child in
//! its own process group, ready when `GET /health` answers 200.
//!
//! `vllm serve` forks an engine-core process (and workers) that killing the
//! PID alone would orphan, so an engine is stopped by signalling its whole
//! group — never by name, since other people's engines run on the same
//! machine. Dropping an engine that was not stopped SIGKILLs its group, so an
//! error or Ctrl-C in the bench does not leave 3 GB processes behind.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::process::{Child, Command};

use crate::engine::{VLLM_MAX_MODEL_LEN, VLLM_MODEL};
use crate::error::BenchError;
use crate::tokens;
use crate::{client, probe};

/// The four ports one engine listens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub http: u16,
    pub events: u16,
    pub replay: u16,
    pub snapshot: u16,
}

/// What every engine of a run is started with.
#[derive(Debug, Clone)]
pub struct ServeSpec {
    pub script: PathBuf,
    pub num_blocks: u32,
    pub block_size: u32,
    pub start_timeout: Duration,
}

/// The context length vllm-serve.sh gives an engine of `num_blocks` blocks:
/// what fits in the KV capacity (vLLM keeps one block back), at most 4096.
pub fn max_model_len(num_blocks: u32, block_size: u32) -> u32 {
    num_blocks.saturating_sub(1).saturating_mul(block_size).min(VLLM_MAX_MODEL_LEN)
}

/// The serve script's arguments for one engine.
pub fn serve_args(spec: &ServeSpec, ports: &Ports) -> Vec<String> {
    [
        ("--port", ports.http.to_string()),
        ("--events-port", ports.events.to_string()),
        ("--replay-port", ports.replay.to_string()),
        ("--snapshot-port", ports.snapshot.to_string()),
        ("--num-blocks", spec.num_blocks.to_string()),
        ("--block-size", spec.block_size.to_string()),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_owned(), value])
    .collect()
}

/// `n` distinct free loopback ports. vLLM cannot choose a port itself and
/// report it (unlike kvroute's binaries, which announce `listening on …`),
/// so the bench asks the OS for free ones — bind 127.0.0.1:0, read the
/// port, close — and hands them to the engine. All `n` are held at once so
/// they differ. Another process may take one before the engine binds it;
/// the engine then fails to start and says so in its log.
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let held: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    held.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}

/// Signals every process of group `pgid` (`kill -SIG -- -PGID`).
fn signal_group(pgid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The last `n` lines of a log file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One running vLLM engine.
#[derive(Debug)]
pub struct VllmEngine {
    pub name: String,
    pub url: String,
    pub events: String,
    pub replay: String,
    pub snapshot: String,
    child: Child,
    /// The engine's own process group (its PID); `None` once stopped.
    pgid: Option<u32>,
    log: PathBuf,
    spawned: Instant,
}

impl VllmEngine {
    /// Starts the serve script in a new process group, output to `log`.
    pub fn spawn(name: &str, spec: &ServeSpec, ports: Ports, log: PathBuf) -> Result<VllmEngine, BenchError> {
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir).map_err(|source| BenchError::Write { path: dir.into(), source })?;
        }
        let file = std::fs::File::create(&log).map_err(|source| BenchError::Write { path: log.clone(), source })?;
        let err = file.try_clone().map_err(|source| BenchError::Write { path: log.clone(), source })?;
        let child = Command::new(&spec.script)
            .args(serve_args(spec, &ports))
            // Registers /reset_prefix_cache: lifecycle evicts with it and
            // compare empties the caches between runs.
            .env("VLLM_SERVER_DEV_MODE", "1")
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| BenchError::Spawn { path: spec.script.clone(), source })?;
        let pgid = child.id();
        Ok(VllmEngine {
            name: name.into(),
            url: format!("http://127.0.0.1:{}", ports.http),
            events: format!("tcp://127.0.0.1:{}", ports.events),
            replay: format!("tcp://127.0.0.1:{}", ports.replay),
            snapshot: format!("tcp://127.0.0.1:{}", ports.snapshot),
            child,
            pgid,
            log,
            spawned: Instant::now(),
        })
    }

    /// Waits until `GET /health` answers 200, the engine exits, or `timeout`
    /// (counted from now); returns the time since the engine was spawned.
    pub async fn wait_ready(&mut self, http: &reqwest::Client, timeout: Duration) -> Result<Duration, BenchError> {
        let started = Instant::now();
        let url = format!("{}/health", self.url);
        let mut pause = Duration::from_millis(250);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(BenchError::Engine {
                    name: self.name.clone(),
                    message: format!(
                        "exited ({status}) before it was ready; {}:\n{}",
                        self.log.display(),
                        tail(&self.log, 30)
                    ),
                });
            }
            if let Ok(resp) = http.get(&url).timeout(Duration::from_secs(5)).send().await
                && resp.status().is_success()
            {
                return Ok(self.spawned.elapsed());
            }
            if started.elapsed() > timeout {
                return Err(BenchError::Engine {
                    name: self.name.clone(),
                    message: format!(
                        "not healthy after {} s; {}:\n{}",
                        timeout.as_secs(),
                        self.log.display(),
                        tail(&self.log, 30)
                    ),
                });
            }
            // Polling the readiness endpoint with backoff, not a fixed sleep.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// SIGTERM to the group, SIGKILL to what is left after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        let Some(pgid) = self.pgid.take() else { return };
        signal_group(pgid, "TERM");
        let _ = tokio::time::timeout(grace, self.child.wait()).await;
        // The engine core may outlive the API server by a moment.
        signal_group(pgid, "KILL");
        let _ = self.child.wait().await;
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid.take() {
            signal_group(pgid, "KILL");
        }
    }
}

/// The engines of one run, started together and stopped together.
#[derive(Debug)]
pub struct VllmEngines {
    pub engines: Vec<VllmEngine>,
    pub spec: ServeSpec,
}

impl VllmEngines {
    /// Starts `n` engines (named by `name(i)`) and waits until all are
    /// healthy; their logs go to `log_dir/<name>.log`.
    pub async fn start(
        n: usize,
        spec: ServeSpec,
        log_dir: &Path,
        name: impl Fn(usize) -> String,
        http: &reqwest::Client,
    ) -> Result<VllmEngines, BenchError> {
        let ports = free_ports(4 * n).map_err(BenchError::Ports)?;
        let mut pool = VllmEngines { engines: Vec::with_capacity(n), spec };
        for (i, p) in ports.chunks_exact(4).enumerate() {
            let ports = Ports { http: p[0], events: p[1], replay: p[2], snapshot: p[3] };
            let name = name(i);
            let log = log_dir.join(format!("vllm-{name}.log"));
            eprintln!(
                "starting vLLM engine {name} on {} ({} KV blocks; log {})",
                ports.http,
                pool.spec.num_blocks,
                log.display()
            );
            pool.engines.push(VllmEngine::spawn(&name, &pool.spec, ports, log)?);
        }
        let timeout = pool.spec.start_timeout;
        for e in &mut pool.engines {
            let took = e.wait_ready(http, timeout).await?;
            eprintln!("vLLM engine {} healthy {:.0} s after its start", e.name, took.as_secs_f64());
        }
        Ok(pool)
    }

    pub fn urls(&self) -> Vec<String> {
        self.engines.iter().map(|e| e.url.clone()).collect()
    }

    /// One request of `prompt_len` tokens per engine, then empty caches: the
    /// first request an engine serves pays one-off costs that would
    /// otherwise land on whichever benchmark run comes first.
    pub async fn warm_up(&self, http: &reqwest::Client, prompt_len: usize) -> Result<(), BenchError> {
        for (i, e) in self.engines.iter().enumerate() {
            let prompt = tokens::run(tokens::seed(0x5741_524d, i as u64, 0), prompt_len.max(1));
            let body = serde_json::to_vec(&json!({
                "model": VLLM_MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": true,
            }))
            .unwrap_or_default();
            client::complete(http, &e.url, body, Duration::from_secs(120)).await?;
        }
        self.reset_caches(http).await
    }

    /// Empties every engine's prefix cache (retrying while requests still
    /// hold blocks): a cold start for the next run without a restart.
    pub async fn reset_caches(&self, http: &reqwest::Client) -> Result<(), BenchError> {
        for e in &self.engines {
            probe::reset_prefix_cache(http, &e.url, Duration::from_secs(120)).await?;
        }
        Ok(())
    }

    pub async fn shutdown(mut self) {
        for e in &mut self.engines {
            e.stop(Duration::from_secs(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(num_blocks: u32) -> ServeSpec {
        ServeSpec {
            script: "scripts/vllm-serve.sh".into(),
            num_blocks,
            block_size: 32,
            start_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn serve_command_names_every_port_and_the_kv_size() {
        let ports = Ports { http: 35101, events: 35102, replay: 35103, snapshot: 35104 };
        assert_eq!(
            serve_args(&spec(512), &ports).join(" "),
            "--port 35101 --events-port 35102 --replay-port 35103 --snapshot-port 35104 --num-blocks 512 --block-size 32"
        );
    }

    #[test]
    fn context_length_fits_the_cache_and_the_cap() {
        assert_eq!(max_model_len(64, 32), 63 * 32);
        assert_eq!(max_model_len(1024, 32), 4096);
        assert_eq!(max_model_len(0, 32), 0);
    }

    #[test]
    fn free_ports_are_distinct() {
        let mut ports = free_ports(8).unwrap_or_default();
        assert_eq!(ports.len(), 8);
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 8);
    }
}
