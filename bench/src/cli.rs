//! kvroute-bench's command line: one subcommand per benchmark, each bringing
//! up its own local cluster.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::engine::EngineArgs;

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-bench",
    version,
    about = "Whole-system benchmarks for kvroute on a local cluster of simulated (or real vLLM) engines"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Cold start, stickiness, eviction, recovery and router restart: PASS/FAIL and latencies.
    Lifecycle(LifecycleArgs),
    /// Workloads × policies × worker counts: hit rate vs ceiling, TTFT, throughput, load spread.
    Compare(Box<CompareArgs>),
    /// Latency and throughput the router adds over talking to the engine directly.
    Overhead(OverheadArgs),
    /// Latency from a vLLM KV event to the router's map (engine → sidecar → router).
    Propagation(crate::propagation::PropagationArgs),
    /// Steady mixed traffic for N minutes: memory, index size, errors over time.
    Soak(crate::soak::SoakArgs),
    /// Engine, router and sidecar restarts: how soon the router's map is true again.
    Restarts(crate::restarts::RestartsArgs),
    /// Wire protocol v1 against v2 at scale (in-process synthetic sidecars,
    /// lost pushes): router CPU, bytes, lookup latency during syncs, healing.
    Antientropy(crate::antientropy::AntientropyArgs),
    /// Draw a run's PNG plots again from its OUT/results.json.
    Plot(PlotArgs),
}

/// `plot KIND DIR`: the plots a run of KIND drew, drawn again (after a
/// change to the plots, or for results from another machine).
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    /// The subcommand whose results DIR holds.
    #[arg(value_parser = ["compare", "lifecycle", "overhead"])]
    pub kind: String,
    /// The run's output folder (its --out), holding results.json.
    pub dir: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// One workload: shared_prefix, chat, rag or trace (default: all; vLLM: all but trace).
    #[arg(long, conflicts_with = "trace")]
    pub workload: Option<String>,
    /// Replay a Mooncake-format JSONL trace instead.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Comma-separated policies (default: all; quick and vLLM: the default policy and round_robin);
    /// `NAME:KEY=VALUE+KEY=VALUE` runs a policy with parameters changed, as the lab names them.
    #[arg(long, value_delimiter = ',')]
    pub policies: Option<Vec<String>>,
    /// Worker counts, comma-separated [default: 4 simulated, 2 vLLM].
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<usize>,
    /// Router replicas, comma-separated (1 or 2); clients alternate between replicas.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub routers: Vec<usize>,
    /// Router replicas do not exchange their in-flight work (`--replica`):
    /// each knows the others' only from the engines' reported queues.
    #[arg(long)]
    pub no_replica_exchange: bool,
    /// Divide trace timestamps by this.
    #[arg(long)]
    pub speedup: Option<f64>,
    /// Start the trace replay after its first N requests.
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// Replay only the first N trace requests (after --skip).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Override the engines' --time-scale for every workload.
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// KV blocks per engine [default: the engines hold 1.5 × the workload's
    /// distinct blocks between them, each at least 4 × the longest request +
    /// 256]: fewer makes the engines evict.
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// A router TOML config passed to every router (`--config`), e.g. to try
    /// `[cache_aware]` parameters; its file name is recorded with each run.
    #[arg(long, value_name = "FILE")]
    pub router_config: Option<PathBuf>,
    /// Keep the runs already in OUT/results.json and do only the missing ones
    /// (for resuming an interrupted run of the same command).
    #[arg(long)]
    pub resume: bool,
    /// Run every policy N times, interleaved round by round (A B C, then
    /// C B A, …), and report each figure's median and range over rounds:
    /// on a shared machine, whether policies differ by more than the noise.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Skip the extra runs of the default policy (2 replicas, no sidecars).
    #[arg(long)]
    pub no_variants: bool,
    /// Requests in flight at most (open loop beyond that waits).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Small workloads, two policies: a CI smoke run (vLLM always uses its
    /// own small presets).
    #[arg(long)]
    pub quick: bool,
    /// Send text prompts: each token id becomes a word that is one token of
    /// this HF tokenizer (DIR/tokenizer.json), and engines and routers
    /// tokenize with it, so the router's own tokenizing and queueing are
    /// measured (simulated engines only).
    #[arg(long, value_name = "DIR")]
    pub text_tokenizer: Option<PathBuf>,
    /// Also run these routers from PyPI (`pip install smg vllm-router`) in
    /// front of the same engines, each one more policy of the plan, named
    /// `peer:NAME` in the results: smg_cache_aware, smg_round_robin,
    /// vllm_router_round_robin, vllm_router_kv_aware, or `all`. They route
    /// on prompt text, so every policy of the run gets text prompts: on
    /// simulated engines --text-tokenizer is required; vLLM runs use the
    /// model's own tokenizer. One router each.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    pub peers: Vec<String>,
    #[command(flatten)]
    pub peer_bins: PeerBins,
    /// Make the first N simulated engines slower (`/sim/faults` slowdown):
    /// a mixed fleet, where a router that knows each worker's pace should
    /// send the slow ones less (simulated engines only).
    #[arg(long, default_value_t = 0)]
    pub slow_engines: usize,
    /// How many times slower every step of a `--slow-engines` engine is.
    #[arg(long, default_value_t = 2.0)]
    pub slow_factor: f64,
    #[arg(long, default_value = "bench-out/compare")]
    pub out: PathBuf,
}

/// Where the peer routers' executables are, when not found by themselves.
#[derive(Debug, Clone, Args)]
pub struct PeerBins {
    /// SMG's `smg` executable (default: on PATH, else target/peers-venv/bin).
    #[arg(long, value_name = "BIN")]
    pub smg: Option<PathBuf>,
    /// vllm-router's executable (default: on PATH, else target/peers-venv/bin).
    #[arg(long, value_name = "BIN")]
    pub vllm_router: Option<PathBuf>,
}

impl PeerBins {
    /// The executable given for `exe` (`smg` or `vllm-router`), if any.
    pub fn given(&self, exe: &str) -> Option<&std::path::Path> {
        if exe == "smg" { self.smg.as_deref() } else { self.vllm_router.as_deref() }
    }
}

#[derive(Debug, Clone, Args)]
pub struct LifecycleArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Engines in the cluster [default: 3 simulated, 2 vLLM].
    #[arg(long)]
    pub workers: Option<usize>,
    /// KV blocks per engine [default: 4096 simulated (16 tokens), 1024 vLLM (32 tokens)].
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// Engines' --time-scale (1 = the modelled H100 timings; simulator only).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Tokens of the prefix whose life is followed.
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: usize,
    /// Requests in the cold-start burst.
    #[arg(long, default_value_t = 8)]
    pub burst: usize,
    /// Long requests that keep the holder busy during the stickiness check.
    #[arg(long, default_value_t = 4)]
    pub busy: usize,
    /// Distinct prefixes in the map before the router is restarted.
    #[arg(long, default_value_t = 24)]
    pub restart_prefixes: usize,
    /// A router TOML config (`--config`), e.g. to try `[cache_aware]` parameters.
    #[arg(long, value_name = "FILE")]
    pub router_config: Option<PathBuf>,
    /// Accepted for symmetry with the other subcommands (lifecycle is always short).
    #[arg(long)]
    pub quick: bool,
    #[arg(long, default_value = "bench-out/lifecycle")]
    pub out: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct OverheadArgs {
    /// Requests per path at concurrency 1.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Seconds per path at concurrency 64.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// 400 requests and 4 s per path.
    #[arg(long)]
    pub quick: bool,
    /// Send text prompts, tokenized by the router and the engine with this
    /// HF tokenizer directory (e.g. ../shared/testdata/tokenizers/gpt2),
    /// instead of token-id prompts.
    #[arg(long, value_name = "DIR")]
    pub text_tokenizer: Option<PathBuf>,
    /// Prompt lengths in tokens (about, for text), comma-separated, all in
    /// one run: half shared, half one of 256 distinct suffixes.
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    pub prompt_tokens: Vec<usize>,
    #[command(flatten)]
    pub peer_bins: PeerBins,
    /// Measure kvroute alone, without SMG and vllm-router.
    #[arg(long)]
    pub no_peers: bool,
    /// Another kvroute-router build measured in the same run ("kvroute
    /// baseline"), e.g. a copy of the binary before a change.
    #[arg(long, value_name = "BIN")]
    pub baseline_router: Option<PathBuf>,
    #[arg(long, default_value = "bench-out/overhead")]
    pub out: PathBuf,
}
