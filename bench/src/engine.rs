//! Which engine a benchmark runs on: `kvroute-sim` (the default, fast and
//! modelled) or real vLLM (`--engine vllm`: the CPU build serving a tiny
//! random-weight Qwen3 through `scripts/vllm-serve.sh`). The two differ in
//! the served model name, the KV block size and how a request pins its
//! output length; everything else in a benchmark is the same.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::error::BenchError;
use crate::setup;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// kvroute-sim with the H100-derived timing model.
    #[default]
    Sim,
    /// Real vLLM (CPU build, tiny random-weight Qwen3), at most 2 engines.
    Vllm,
}

/// Served model name of `scripts/vllm-serve.sh`.
pub const VLLM_MODEL: &str = "tiny-qwen3";
/// vLLM's CPU attention backend needs a multiple of 32.
pub const VLLM_BLOCK_SIZE: u32 = 32;
/// Real engines each hold ~3.4 GB and a share of two cores: more than two
/// at once starves the machine (and the other people on it).
pub const VLLM_MAX_ENGINES: usize = 2;
/// vllm-serve.sh caps `--max-model-len` here.
pub const VLLM_MAX_MODEL_LEN: u32 = 4096;

impl EngineKind {
    pub fn model(self) -> &'static str {
        match self {
            EngineKind::Sim => setup::MODEL,
            EngineKind::Vllm => VLLM_MODEL,
        }
    }

    pub fn block_size(self) -> u32 {
        match self {
            EngineKind::Sim => setup::BLOCK_SIZE,
            EngineKind::Vllm => VLLM_BLOCK_SIZE,
        }
    }

    /// Random weights emit EOS whenever they like; `ignore_eos` makes every
    /// request decode exactly `max_tokens`, as the simulator always does.
    pub fn ignore_eos(self) -> bool {
        self == EngineKind::Vllm
    }

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Sim => "sim",
            EngineKind::Vllm => "vllm",
        }
    }

    /// Checks a worker count against what this engine can run here.
    pub fn check_workers(self, workers: usize) -> Result<(), BenchError> {
        if self == EngineKind::Vllm && workers > VLLM_MAX_ENGINES {
            return Err(BenchError::Usage(format!(
                "--engine vllm runs at most {VLLM_MAX_ENGINES} engines (each needs ~3.4 GB and CPU time); got {workers}"
            )));
        }
        Ok(())
    }
}

/// The engine flags every cluster-starting subcommand shares.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Engines to run on: kvroute-sim, or real vLLM through scripts/vllm-serve.sh.
    #[arg(long, value_enum, default_value_t = EngineKind::Sim)]
    pub engine: EngineKind,
    /// The script that starts one vLLM engine (`--engine vllm`).
    #[arg(long, value_name = "FILE", default_value_os_t = default_serve_script())]
    pub vllm_serve: PathBuf,
    /// Seconds to wait for a vLLM engine's /health (startup takes about a
    /// minute on an idle 2-core machine, several when it is busy).
    #[arg(long, default_value_t = 900)]
    pub vllm_start_timeout: u64,
}

impl Default for EngineArgs {
    fn default() -> Self {
        EngineArgs { engine: EngineKind::Sim, vllm_serve: default_serve_script(), vllm_start_timeout: 900 }
    }
}

/// `scripts/vllm-serve.sh` of the repository this crate was built from.
pub fn default_serve_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/vllm-serve.sh")
}

/// The tiny model's folder (config + Qwen3 tokenizer), as printed by
/// `tiny-model.sh` beside the serve script; the router tokenizes with it.
pub fn tiny_model_dir(serve_script: &Path) -> Result<PathBuf, BenchError> {
    let script = serve_script.with_file_name("tiny-model.sh");
    let out = std::process::Command::new(&script)
        .output()
        .map_err(|source| BenchError::Spawn { path: script.clone(), source })?;
    let dir = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_owned();
    if !out.status.success() || dir.is_empty() {
        return Err(BenchError::Usage(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(PathBuf::from(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_differs_from_sim_where_it_must() {
        assert_eq!(EngineKind::Sim.model(), setup::MODEL);
        assert_eq!(EngineKind::Vllm.model(), "tiny-qwen3");
        assert_eq!(EngineKind::Vllm.block_size() % 32, 0);
        assert!(EngineKind::Vllm.ignore_eos() && !EngineKind::Sim.ignore_eos());
        assert!(EngineKind::Vllm.check_workers(2).is_ok());
        assert!(EngineKind::Vllm.check_workers(3).is_err());
        assert!(EngineKind::Sim.check_workers(8).is_ok());
    }
}
