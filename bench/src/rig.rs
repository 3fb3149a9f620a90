//! The cluster a benchmark talks to, whichever engine it runs on: a
//! `kvroute_sim::cluster::Cluster` (simulated engines, sidecars and routers
//! started together), or routers and sidecars in front of real vLLM engines
//! the caller started and keeps ([`crate::vllm::VllmEngines`]), so several
//! runs can share engines that take a minute each to start.

pub mod front;

use std::path::{Path, PathBuf};

use kvroute_sim::cluster::Cluster;

use crate::error::BenchError;
use crate::setup::{self, Shape};
use crate::vllm::VllmEngines;
use front::{EngineEndpoints, Front, FrontSpec};

#[derive(Debug)]
pub enum Rig {
    Sim(Cluster),
    Vllm { engines: Vec<String>, front: Front },
}

impl Rig {
    pub async fn start_sim(shape: &Shape, bin_dir: &Path) -> Result<Rig, BenchError> {
        Ok(Rig::Sim(Cluster::start(setup::spec(shape, bin_dir)).await?))
    }

    /// Routers and sidecars shaped by `shape` in front of `pool` (the
    /// shape's worker count and KV size are the pool's).
    pub async fn start_vllm(
        pool: &VllmEngines,
        shape: &Shape,
        tokenizer: PathBuf,
        bin_dir: &Path,
    ) -> Result<Rig, BenchError> {
        let endpoints: Vec<EngineEndpoints> = pool
            .engines
            .iter()
            .map(|e| EngineEndpoints {
                url: e.url.clone(),
                events: e.events.clone(),
                replay: e.replay.clone(),
                snapshot: Some(e.snapshot.clone()),
            })
            .collect();
        let spec = FrontSpec {
            routers: shape.routers,
            sidecars: shape.sidecars,
            policy: shape.policy.clone(),
            model: crate::engine::VLLM_MODEL.into(),
            block_size: pool.spec.block_size,
            tokenizer: Some(tokenizer),
            router_args: shape.router_args.clone(),
            bin_dir: bin_dir.into(),
        };
        let front = Front::start(&spec, &endpoints).await?;
        Ok(Rig::Vllm { engines: pool.urls(), front })
    }

    pub fn engine_urls(&self) -> Vec<String> {
        match self {
            Rig::Sim(c) => c.engines.iter().map(|e| e.url.clone()).collect(),
            Rig::Vllm { engines, .. } => engines.clone(),
        }
    }

    pub fn router_url(&self, i: usize) -> &str {
        match self {
            Rig::Sim(c) => c.router_url(i),
            Rig::Vllm { front, .. } => front.router_url(i),
        }
    }

    /// SIGKILL router `i`.
    pub async fn kill_router(&mut self, i: usize) {
        match self {
            Rig::Sim(c) => c.routers[i].proc.kill().await,
            Rig::Vllm { front, .. } => front.kill_router(i).await,
        }
    }

    /// Restarts router `i` (after a kill) on its port.
    pub async fn restart_router(&mut self, i: usize) -> Result<(), BenchError> {
        match self {
            Rig::Sim(c) => Ok(c.restart_router(i).await?),
            Rig::Vllm { front, .. } => front.restart_router(i).await,
        }
    }

    /// Stops what this rig started (real engines stay with their owner).
    pub async fn shutdown(self) {
        match self {
            Rig::Sim(c) => c.shutdown().await,
            Rig::Vllm { front, .. } => front.shutdown().await,
        }
    }
}
