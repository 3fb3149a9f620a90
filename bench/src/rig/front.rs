//! Routers and sidecars in front of engines the bench did not start through
//! `kvroute_sim::cluster` (real vLLM): the same child processes, flags and
//! readiness rule as that module's `Cluster::start`, which can only start
//! simulated engines itself.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_sim::cluster::{LOCAL_TOKEN, Proc, worker_id};

use crate::error::BenchError;

/// Where one engine listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineEndpoints {
    pub url: String,
    /// KV-event PUB endpoint.
    pub events: String,
    /// Replay (ROUTER) endpoint.
    pub replay: String,
    /// The kvroute_hooks snapshot plugin's endpoint, when the engine has it.
    pub snapshot: Option<String>,
}

/// What to put in front of the engines.
#[derive(Debug, Clone)]
pub struct FrontSpec {
    pub routers: usize,
    /// Without sidecars the routers are given the workers and index approximately.
    pub sidecars: bool,
    pub policy: String,
    pub model: String,
    pub block_size: u32,
    pub tokenizer: Option<PathBuf>,
    pub router_args: Vec<String>,
    pub bin_dir: PathBuf,
}

const GRACE: Duration = Duration::from_secs(5);

/// A router's flags, listening on `listen` (`127.0.0.1:0` for any port).
pub fn router_args(spec: &FrontSpec, engines: &[EngineEndpoints], listen: &str) -> Vec<String> {
    let mut args: Vec<String> = vec!["--listen".into(), listen.into()];
    args.extend(kvroute_sim::cluster::policy_args(&spec.policy));
    args.extend(["--block-size".into(), spec.block_size.to_string(), "--internal-token".into(), LOCAL_TOKEN.into()]);
    if let Some(t) = &spec.tokenizer {
        args.extend(["--tokenizer".into(), t.display().to_string()]);
    }
    if !spec.sidecars {
        for (i, e) in engines.iter().enumerate() {
            args.extend(["--worker".into(), format!("{}={}", worker_id(i), e.url)]);
        }
    }
    args.extend(spec.router_args.iter().cloned());
    args
}

/// Sidecar `i`'s flags, pushing to every router in `routers`.
pub fn sidecar_args(spec: &FrontSpec, i: usize, engine: &EngineEndpoints, routers: &[String]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--worker-id".into(),
        worker_id(i),
        "--engine-url".into(),
        engine.url.clone(),
        "--events".into(),
        engine.events.clone(),
        "--replay".into(),
        engine.replay.clone(),
        "--model".into(),
        spec.model.clone(),
        "--block-size".into(),
        spec.block_size.to_string(),
        "--internal-token".into(),
        LOCAL_TOKEN.into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    if let Some(s) = &engine.snapshot {
        args.extend(["--engine-snapshot".into(), s.clone()]);
    }
    for r in routers {
        args.extend(["--router".into(), r.clone()]);
    }
    args
}

fn bin(dir: &Path, name: &str) -> Result<PathBuf, BenchError> {
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(kvroute_sim::cluster::ClusterError::MissingBinary { name: name.into(), dir: dir.into() }.into())
    }
}

#[derive(Debug)]
struct Router {
    proc: Proc,
    url: String,
    args: Vec<String>,
}

/// Running routers and sidecars.
#[derive(Debug)]
pub struct Front {
    routers: Vec<Router>,
    sidecars: Vec<Proc>,
    workers: usize,
    router_bin: PathBuf,
}

impl Front {
    /// Routers first (sidecars need their URLs), then one sidecar per
    /// engine; ready when every router lists every worker as healthy.
    pub async fn start(spec: &FrontSpec, engines: &[EngineEndpoints]) -> Result<Front, BenchError> {
        let router_bin = bin(&spec.bin_dir, "kvroute-router")?;
        let sidecar_bin = bin(&spec.bin_dir, "kvroute-sidecar")?;
        let mut front = Front { routers: Vec::new(), sidecars: Vec::new(), workers: engines.len(), router_bin };
        for r in 0..spec.routers {
            let args = router_args(spec, engines, "127.0.0.1:0");
            let mut proc = Proc::spawn(&format!("router {}", r + 1), &front.router_bin, &args).await?;
            let url = proc.announced("listening on ").await?;
            front.routers.push(Router { proc, url, args });
        }
        if spec.sidecars {
            let urls: Vec<String> = front.routers.iter().map(|r| r.url.clone()).collect();
            for (i, e) in engines.iter().enumerate() {
                let args = sidecar_args(spec, i, e, &urls);
                let mut proc = Proc::spawn(&format!("sidecar {}", worker_id(i)), &sidecar_bin, &args).await?;
                proc.announced("listening on ").await?;
                front.sidecars.push(proc);
            }
        }
        for r in 0..front.routers.len() {
            front.wait_router_ready(r).await?;
        }
        Ok(front)
    }

    pub fn router_url(&self, i: usize) -> &str {
        &self.routers[i].url
    }

    /// Waits until router `i` lists every worker as healthy.
    pub async fn wait_router_ready(&self, i: usize) -> Result<(), BenchError> {
        let r = &self.routers[i];
        Ok(kvroute_sim::cluster::wait_router_ready(&r.proc, &r.url, self.workers).await?)
    }

    /// SIGKILL router `i` (fault injection).
    pub async fn kill_router(&mut self, i: usize) {
        self.routers[i].proc.kill().await;
    }

    /// Restarts router `i` (after a kill) on the port it had.
    pub async fn restart_router(&mut self, i: usize) -> Result<(), BenchError> {
        let r = &self.routers[i];
        let port = r.url.rsplit(':').next().unwrap_or("0").to_owned();
        let mut args = r.args.clone();
        if let Some(pos) = args.iter().position(|a| a == "--listen") {
            args[pos + 1] = format!("127.0.0.1:{port}");
        }
        let mut proc = Proc::spawn(&r.proc.name, &self.router_bin, &args).await?;
        let url = proc.announced("listening on ").await?;
        self.routers[i] = Router { proc, url, args };
        Ok(())
    }

    /// Routers first (they drain), then sidecars (they flush).
    pub async fn shutdown(mut self) {
        for r in &mut self.routers {
            r.proc.stop(GRACE).await;
        }
        for s in &mut self.sidecars {
            s.stop(GRACE).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(sidecars: bool) -> FrontSpec {
        FrontSpec {
            routers: 1,
            sidecars,
            policy: kvroute_router::policy::DEFAULT_POLICY.into(),
            model: "tiny-qwen3".into(),
            block_size: 32,
            tokenizer: Some("/m/tiny-qwen3".into()),
            router_args: vec!["--config".into(), "r.toml".into()],
            bin_dir: PathBuf::new(),
        }
    }

    fn engine() -> EngineEndpoints {
        EngineEndpoints {
            url: "http://127.0.0.1:35101".into(),
            events: "tcp://127.0.0.1:35102".into(),
            replay: "tcp://127.0.0.1:35103".into(),
            snapshot: Some("tcp://127.0.0.1:35104".into()),
        }
    }

    fn value<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
    }

    #[test]
    fn router_gets_block_size_tokenizer_and_workers_only_without_sidecars() {
        let with = router_args(&spec(true), &[engine()], "127.0.0.1:0");
        assert_eq!(value(&with, "--block-size"), ["32"]);
        assert_eq!(value(&with, "--tokenizer"), ["/m/tiny-qwen3"]);
        assert!(value(&with, "--worker").is_empty());
        assert_eq!(with[with.len() - 2..], ["--config".to_owned(), "r.toml".to_owned()]);
        let without = router_args(&spec(false), &[engine(), engine()], "127.0.0.1:0");
        assert_eq!(value(&without, "--worker"), ["w1=http://127.0.0.1:35101", "w2=http://127.0.0.1:35101"]);
    }

    #[test]
    fn a_policy_named_with_parameters_sets_them() {
        let tuned = FrontSpec { policy: "predicted_ttft:room_ratio=0+pull_ratio=0.5".into(), ..spec(true) };
        let args = router_args(&tuned, &[engine()], "127.0.0.1:0");
        assert_eq!(value(&args, "--policy"), ["predicted_ttft"]);
        assert_eq!(value(&args, "--set"), ["predicted_ttft.room_ratio=0", "predicted_ttft.pull_ratio=0.5"]);
        assert!(value(&router_args(&spec(true), &[engine()], "127.0.0.1:0"), "--set").is_empty());
    }

    #[test]
    fn sidecar_reads_events_replay_and_snapshot_of_its_engine() {
        let routers = ["http://127.0.0.1:1".to_owned(), "http://127.0.0.1:2".to_owned()];
        let args = sidecar_args(&spec(true), 1, &engine(), &routers);
        assert_eq!(value(&args, "--worker-id"), ["w2"]);
        assert_eq!(value(&args, "--events"), ["tcp://127.0.0.1:35102"]);
        assert_eq!(value(&args, "--replay"), ["tcp://127.0.0.1:35103"]);
        assert_eq!(value(&args, "--engine-snapshot"), ["tcp://127.0.0.1:35104"]);
        assert_eq!(value(&args, "--model"), ["tiny-qwen3"]);
        assert_eq!(value(&args, "--block-size"), ["32"]);
        assert_eq!(value(&args, "--router"), ["http://127.0.0.1:1", "http://127.0.0.1:2"]);
        let mut no_snapshot = engine();
        no_snapshot.snapshot = None;
        assert!(value(&sidecar_args(&spec(true), 0, &no_snapshot, &routers), "--engine-snapshot").is_empty());
    }
}
