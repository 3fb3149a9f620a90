//! Finding the binaries a cluster needs and describing clusters: the three
//! kvroute binaries live beside kvroute-bench in cargo's target directory.

use std::path::{Path, PathBuf};

use kvroute_sim::cluster::{ClusterError, ClusterSpec, ensure_binaries};

use crate::error::BenchError;

/// The directory of the running executable (`target/release` under
/// `cargo run --release`).
pub fn bin_dir() -> PathBuf {
    std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or_default()
}

/// Makes sure router, sidecar and sim are built. `ensure_binaries` covers
/// the first two; the simulator is built here the same way (through the
/// `CARGO` that `cargo run` sets) when it is missing.
pub fn ensure_all(dir: &Path) -> Result<(), BenchError> {
    ensure_binaries(dir)?;
    if dir.join("kvroute-sim").is_file() {
        return Ok(());
    }
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Err(ClusterError::MissingBinary { name: "kvroute-sim".into(), dir: dir.into() }.into());
    };
    eprintln!("building kvroute-sim …");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "-p", "kvroute-sim"]);
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        _ => Err(ClusterError::Build("kvroute-sim".into()).into()),
    }
}

/// What one benchmark cluster looks like.
#[derive(Debug, Clone)]
pub struct Shape {
    pub workers: usize,
    pub routers: usize,
    /// Router replicas exchange their in-flight work (`--replica`).
    pub replica_exchange: bool,
    pub sidecars: bool,
    pub policy: String,
    pub num_blocks: u32,
    pub sim_args: Vec<String>,
    pub router_args: Vec<String>,
    /// HF tokenizer for engines and routers (text prompts); `None`: token ids.
    pub tokenizer: Option<PathBuf>,
}

pub const MODEL: &str = "sim-model";
pub const BLOCK_SIZE: u32 = 16;

pub fn spec(shape: &Shape, bin_dir: &Path) -> ClusterSpec {
    ClusterSpec {
        workers: shape.workers,
        routers: shape.routers,
        replica_exchange: shape.replica_exchange,
        sidecars: shape.sidecars,
        port: 0,
        policy: shape.policy.clone(),
        model: MODEL.into(),
        block_size: BLOCK_SIZE,
        num_blocks: shape.num_blocks,
        tokenizer: shape.tokenizer.clone(),
        sim_args: shape.sim_args.clone(),
        router_args: shape.router_args.clone(),
        sidecar_args: Vec::new(),
        bin_dir: bin_dir.into(),
        data_parallel_size: 1,
    }
}
