//! Other routers measured beside kvroute by `kvroute-bench overhead` and
//! `kvroute-bench compare --peers`: SMG (`pip install smg`) and vllm-router
//! (`pip install vllm-router`), started as child processes in front of the
//! same engines, so their figures come from the same run, machine and load
//! as kvroute's. A peer whose binary is not found is reported absent (by
//! `overhead`) or refused (by `compare`), never silently skipped.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_sim::cluster::Proc;

use crate::error::BenchError;

/// One peer router configuration to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    SmgCacheAware,
    SmgRoundRobin,
    VllmRouterRoundRobin,
    /// vllm-router's KV-event index: it subscribes to the engine's ZMQ
    /// events and asks the engine to tokenize each prompt.
    VllmRouterKvAware,
}

pub const ALL: [Peer; 4] =
    [Peer::SmgCacheAware, Peer::SmgRoundRobin, Peer::VllmRouterRoundRobin, Peer::VllmRouterKvAware];

impl Peer {
    /// The name `compare --peers` takes, and its runs' policy after `peer:`.
    pub fn slug(self) -> &'static str {
        match self {
            Peer::SmgCacheAware => "smg_cache_aware",
            Peer::SmgRoundRobin => "smg_round_robin",
            Peer::VllmRouterRoundRobin => "vllm_router_round_robin",
            Peer::VllmRouterKvAware => "vllm_router_kv_aware",
        }
    }

    /// The peer a [`Self::slug`] names.
    pub fn from_slug(slug: &str) -> Result<Peer, String> {
        ALL.into_iter()
            .find(|p| p.slug() == slug)
            .ok_or_else(|| format!("unknown peer {slug:?}; known: {}", ALL.map(Peer::slug).join(", ")))
    }

    pub fn name(self) -> &'static str {
        match self {
            Peer::SmgCacheAware => "SMG cache_aware",
            Peer::SmgRoundRobin => "SMG round_robin",
            Peer::VllmRouterRoundRobin => "vllm-router round_robin",
            Peer::VllmRouterKvAware => "vllm-router kv_aware",
        }
    }

    /// The executable's name (as pip installs it).
    pub fn exe(self) -> &'static str {
        match self {
            Peer::SmgCacheAware | Peer::SmgRoundRobin => "smg",
            Peer::VllmRouterRoundRobin | Peer::VllmRouterKvAware => "vllm-router",
        }
    }

    /// Command-line arguments for a router on `port` in front of `fleet`.
    /// Logging is lowered to warnings: at their default level both log two
    /// lines per request, which kvroute does not.
    fn args(self, port: u16, metrics_port: u16, fleet: &Fleet) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        let policy = match self {
            Peer::SmgCacheAware => "cache_aware",
            Peer::SmgRoundRobin | Peer::VllmRouterRoundRobin => "round_robin",
            Peer::VllmRouterKvAware => "kv_aware",
        };
        if self.exe() == "smg" {
            args.push("launch".into());
        }
        for (flag, value) in [
            ("--host", "127.0.0.1".to_owned()),
            ("--port", port.to_string()),
            ("--prometheus-port", metrics_port.to_string()),
            ("--policy", policy.to_owned()),
            ("--log-level", if self.exe() == "smg" { "warn" } else { "warning" }.to_owned()),
        ] {
            args.extend([flag.to_owned(), value]);
        }
        args.push("--worker-urls".into());
        args.extend(fleet.engines.iter().map(|e| e.url.clone()));
        if self == Peer::VllmRouterKvAware {
            for e in &fleet.engines {
                args.extend(["--kv-event-source".into(), format!("{}={}", e.url, e.events)]);
            }
            args.extend([
                "--kv-event-block-size".into(),
                fleet.block_size.to_string(),
                "--kv-event-model".into(),
                fleet.model.clone(),
            ]);
        }
        args
    }
}

/// The binary for `exe`: `flag` when given, else the first found on `PATH`,
/// else in `target/peers-venv/bin` beside the benchmark's own target folder.
pub fn find(flag: Option<&Path>, exe: &str, bin_dir: &Path) -> Option<PathBuf> {
    if let Some(p) = flag {
        return p.is_file().then(|| p.to_owned());
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join(exe)).collect::<Vec<_>>())
        .unwrap_or_default();
    let venv = bin_dir.parent().map(|t| t.join("peers-venv").join("bin").join(exe));
    on_path.into_iter().chain(venv).find(|p| p.is_file())
}

/// An engine a peer routes to: its HTTP URL and its ZMQ KV-event endpoint.
#[derive(Debug, Clone)]
pub struct EngineAt {
    pub url: String,
    pub events: String,
}

/// The engines a peer routes to, the model they serve and their KV block
/// size (what vllm-router's KV-event index hashes by).
#[derive(Debug, Clone)]
pub struct Fleet {
    pub engines: Vec<EngineAt>,
    pub model: String,
    pub block_size: u32,
}

/// A peer router running in front of the engines.
#[derive(Debug)]
pub struct Running {
    pub peer: Peer,
    pub url: String,
    pub proc: Proc,
}

/// A free loopback port. Peers take a port number, not a listener, so the
/// port is released before the peer binds it; a clash shows up as a peer
/// that never becomes ready, which is reported.
fn free_port() -> Result<u16, BenchError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(BenchError::Ports)?;
    Ok(l.local_addr().map_err(BenchError::Ports)?.port())
}

/// Starts `peer` in front of `fleet` and waits until it answers a
/// completion (up to 90 s).
pub async fn start(peer: Peer, bin: &Path, fleet: &Fleet, http: &reqwest::Client) -> Result<Running, BenchError> {
    let (port, metrics_port) = (free_port()?, free_port()?);
    let args = peer.args(port, metrics_port, fleet);
    let mut proc = Proc::spawn(peer.name(), bin, &args).await?;
    let url = format!("http://127.0.0.1:{port}");
    let body = serde_json::to_vec(&serde_json::json!({"model": fleet.model, "prompt": "Hello", "max_tokens": 1}))
        .unwrap_or_default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let ok = http
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .timeout(Duration::from_secs(5))
            .body(body.clone())
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return Ok(Running { peer, url, proc });
        }
        if let Some(status) = proc.exited() {
            return Err(BenchError::Unexpected {
                url,
                message: format!("{} exited ({status}); its last lines:\n{}", peer.name(), proc.log()),
            });
        }
        if tokio::time::Instant::now() > deadline {
            let log = proc.log();
            proc.kill().await;
            return Err(BenchError::Timeout(format!("{} not ready in 90 s; its last lines:\n{log}", peer.name())));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_peer_has_a_slug_and_routes_to_every_engine() {
        for peer in ALL {
            assert_eq!(Peer::from_slug(peer.slug()), Ok(peer));
        }
        assert!(Peer::from_slug("nginx").unwrap_err().contains("smg_cache_aware"));
        let engines: Vec<EngineAt> = (0..3)
            .map(|i| EngineAt {
                url: format!("http://127.0.0.1:{}", 8000 + i),
                events: format!("tcp://127.0.0.1:{}", 9000 + i),
            })
            .collect();
        let fleet = Fleet { engines: engines.clone(), model: "m".into(), block_size: 32 };
        let args = Peer::VllmRouterKvAware.args(1, 2, &fleet);
        assert_eq!(args.windows(2).find(|w| w[0] == "--kv-event-block-size").map(|w| w[1].as_str()), Some("32"));
        let at = args.iter().position(|a| a == "--worker-urls").unwrap();
        assert_eq!(args[at + 1..at + 4], engines.iter().map(|e| e.url.clone()).collect::<Vec<_>>()[..]);
        let sources: Vec<&String> = args.windows(2).filter(|w| w[0] == "--kv-event-source").map(|w| &w[1]).collect();
        assert_eq!(
            sources,
            [
                "http://127.0.0.1:8000=tcp://127.0.0.1:9000",
                "http://127.0.0.1:8001=tcp://127.0.0.1:9001",
                "http://127.0.0.1:8002=tcp://127.0.0.1:9002"
            ]
        );
        let smg = Peer::SmgCacheAware.args(1, 2, &fleet);
        assert_eq!(smg[0], "launch");
        assert!(!smg.iter().any(|a| a == "--kv-event-source"));
        assert_eq!(smg.windows(2).find(|w| w[0] == "--policy").map(|w| w[1].as_str()), Some("cache_aware"));
    }
}
