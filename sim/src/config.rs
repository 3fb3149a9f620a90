//! Command-line flags and the validated [`Config`] the simulator runs with.
//!
//! Flags mirror vLLM's where vLLM has one (`--block-size`, `--num-gpu-blocks-override`
//! as `--num-blocks`, `--max-num-seqs`, `--max-num-batched-tokens`,
//! `--kv-events-config` split into `--kv-events-*`). Validation happens once,
//! in [`Args::into_config`]; the rest of the crate trusts `Config`.

use std::path::PathBuf;
use std::time::Duration;

use kvroute_shared::{BlockSize, ModelName};

use crate::engine::hashing::HashMode;
use crate::events::EventFormat;
use crate::faults::Faults;

/// Default step-time model: Llama-3-8B / Qwen3-8B (bf16) on one H100 SXM with
/// vLLM v1. Derivation, so the figures can be challenged:
/// - step overhead 5 ms: a decode step must stream all ~16 GB of weights from
///   HBM (3.35 TB/s ⇒ ~4.8 ms), plus scheduler/sampling overhead; vLLM's
///   published single-stream ITL for 8B on H100 is ~6–7 ms;
/// - prefill 70 µs per uncached token: 2 × 8e9 FLOP/token = 16 GFLOP; at the
///   ~230 TFLOP/s (≈ 25 % of 989 dense bf16 peak) large-chunk prefills reach in
///   practice, that is ~70 µs, i.e. ~14k prefill tokens/s, in line with vLLM
///   benchmark reports of 10–20k tokens/s for 8B models on one H100;
/// - decode 40 µs per running sequence: reading ~1k tokens of KV cache
///   (128 KiB/token for Llama-3-8B's GQA: 32 layers × 8 heads × 128 × 2 × 2 B)
///   is ~128 MiB ⇒ ~40 µs at HBM bandwidth.
pub mod defaults {
    pub const STEP_OVERHEAD_US: f64 = 5_000.0;
    pub const PREFILL_US_PER_TOKEN: f64 = 70.0;
    pub const DECODE_US_PER_SEQ: f64 = 40.0;
    /// ~56 GB of free HBM at 0.9 utilisation / 2 MiB per 16-token block.
    pub const NUM_BLOCKS: u32 = 28_000;
    /// vLLM v1's defaults for the OpenAI server on ≥ 70 GiB GPUs.
    pub const MAX_NUM_SEQS: usize = 1024;
    pub const MAX_NUM_BATCHED_TOKENS: usize = 8192;
    /// vLLM's `buffer_steps` default for the replay buffer.
    pub const REPLAY_BUFFER: usize = 10_000;
}

#[derive(Debug, clap::Parser)]
#[command(name = "kvroute-sim", version, about = "A simulated vLLM engine (OpenAI API, prefix cache, KV events)")]
pub struct Args {
    /// HTTP listen address; port 0 picks a free port (printed as `listening on http://ADDR`).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: String,
    /// Served model name (vLLM's `--served-model-name`).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// LoRA adapters served beside the base model (repeatable).
    #[arg(long = "lora")]
    pub loras: Vec<String>,
    /// A Hugging Face tokenizer directory; without it, one token per UTF-8 byte.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    #[arg(long, default_value_t = defaults::NUM_BLOCKS)]
    pub num_blocks: u32,
    #[arg(long, default_value_t = defaults::MAX_NUM_SEQS)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = defaults::MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 32_768)]
    pub max_model_len: usize,
    /// Tokens generated when a request does not say (vLLM's completions default).
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    #[arg(long, default_value_t = defaults::STEP_OVERHEAD_US)]
    pub step_overhead_us: f64,
    #[arg(long, default_value_t = defaults::PREFILL_US_PER_TOKEN)]
    pub prefill_us_per_token: f64,
    #[arg(long, default_value_t = defaults::DECODE_US_PER_SEQ)]
    pub decode_us_per_seq: f64,
    /// Divides every delay: 10 runs ten times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// No delays at all (overhead benchmarks).
    #[arg(long)]
    pub instant: bool,
    /// Data-parallel ranks, as vLLM's flag: each rank is an engine with its
    /// own KV cache and scheduler, publishing its events on the event and
    /// replay ports + rank (a port of 0 binds each rank anywhere). Without
    /// --data-parallel-rank this process serves every rank behind one API
    /// (vLLM's internal load balancing: X-data-parallel-rank picks the rank,
    /// else the least loaded one serves).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: u32,
    /// Serve only this rank (vLLM's external load balancing: one API server
    /// per rank).
    #[arg(long)]
    pub data_parallel_rank: Option<u32>,
    /// ZMQ PUB endpoint for KV events (e.g. tcp://127.0.0.1:5557; port 0 allowed); off if absent.
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// First frame of each message; vLLM's default is empty.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    #[arg(long, value_enum, default_value_t = EventFormat::Current)]
    pub kv_events_format: EventFormat,
    /// 0: hashes as u64 (vLLM's default); 32: raw 32-byte digests.
    #[arg(long, default_value_t = 0)]
    pub kv_events_hash_bytes: u8,
    /// ZMQ ROUTER endpoint answering replay requests; off if absent.
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[arg(long, default_value_t = defaults::REPLAY_BUFFER)]
    pub kv_events_buffer: usize,
    /// Fault: fraction (0..=1) of event batches not sent (still kept for replay).
    #[arg(long, default_value_t = 0.0)]
    pub fault_drop_events: f64,
    /// Fault: start with event publishing paused (batches are held, sent on resume).
    #[arg(long)]
    pub fault_pause_events: bool,
    /// Fault: fraction (0..=1) of inference requests rejected.
    #[arg(long, default_value_t = 0.0)]
    pub fault_reject: f64,
    /// Fault: HTTP status for rejected requests (503 or 500).
    #[arg(long, default_value_t = 503)]
    pub fault_reject_status: u16,
    /// Fault: multiplies every step time.
    #[arg(long, default_value_t = 1.0)]
    pub fault_slowdown: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--{flag}: {message}")]
    Invalid { flag: &'static str, message: String },
}

fn invalid(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { flag, message: message.into() }
}

/// How long a step takes, before scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    pub overhead_us: f64,
    pub prefill_us_per_token: f64,
    pub decode_us_per_seq: f64,
}

/// How simulated time maps onto wall-clock time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pace {
    /// No sleeping at all.
    Instant,
    /// Sleep the modelled step time divided by this factor.
    Scaled(f64),
}

#[derive(Clone, Debug)]
pub struct EventsConfig {
    pub endpoint: String,
    pub topic: String,
    pub format: EventFormat,
    pub hash_mode: HashMode,
    pub replay_endpoint: Option<String>,
    pub buffer: usize,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub model: ModelName,
    pub loras: Vec<ModelName>,
    pub tokenizer: Option<PathBuf>,
    pub block_size: BlockSize,
    pub num_blocks: u32,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub default_max_tokens: u32,
    pub cost: StepCost,
    pub pace: Pace,
    /// Hash representation: also decides engine hashes when events are off.
    pub hash_mode: HashMode,
    pub events: Option<EventsConfig>,
    pub faults: Faults,
    /// The data-parallel ranks this process serves, each an engine of its own.
    pub dp_ranks: Vec<u32>,
}

impl Config {
    /// A config for tests and tools: defaults, instant pace, no events.
    pub fn for_model(model: &str) -> Self {
        Config {
            model: ModelName::new(model),
            loras: Vec::new(),
            tokenizer: None,
            block_size: BlockSize::DEFAULT,
            num_blocks: defaults::NUM_BLOCKS,
            max_num_seqs: defaults::MAX_NUM_SEQS,
            max_num_batched_tokens: defaults::MAX_NUM_BATCHED_TOKENS,
            max_model_len: 32_768,
            default_max_tokens: 16,
            cost: StepCost {
                overhead_us: defaults::STEP_OVERHEAD_US,
                prefill_us_per_token: defaults::PREFILL_US_PER_TOKEN,
                decode_us_per_seq: defaults::DECODE_US_PER_SEQ,
            },
            pace: Pace::Instant,
            hash_mode: HashMode::Int,
            events: None,
            faults: Faults::default(),
            dp_ranks: vec![0],
        }
    }

    /// The LoRA id vLLM would report for a requested model name (1-based index
    /// of the adapter), `None` for the base model.
    pub fn lora_id(&self, requested: &str) -> Option<u32> {
        self.loras.iter().position(|l| l.as_str() == requested).map(|i| i as u32 + 1)
    }

    /// Modelled duration of a step, after `--time-scale` and the slowdown fault.
    pub fn step_duration(&self, prefill_tokens: usize, decode_seqs: usize, slowdown: f64) -> Option<Duration> {
        let Pace::Scaled(scale) = self.pace else { return None };
        let us = self.cost.overhead_us
            + prefill_tokens as f64 * self.cost.prefill_us_per_token
            + decode_seqs as f64 * self.cost.decode_us_per_seq;
        Some(Duration::from_secs_f64((us * slowdown / scale / 1e6).max(0.0)))
    }
}

impl Args {
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let block_size = BlockSize::new(self.block_size).map_err(|e| invalid("block-size", e.to_string()))?;
        if self.num_blocks == 0 || self.num_blocks == u32::MAX {
            return Err(invalid("num-blocks", "must be between 1 and 2^32 - 2"));
        }
        if self.max_num_seqs == 0 {
            return Err(invalid("max-num-seqs", "must be at least 1"));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(invalid("max-num-batched-tokens", "must be at least 1"));
        }
        if self.default_max_tokens == 0 {
            return Err(invalid("default-max-tokens", "must be at least 1"));
        }
        for (flag, v) in [
            ("step-overhead-us", self.step_overhead_us),
            ("prefill-us-per-token", self.prefill_us_per_token),
            ("decode-us-per-seq", self.decode_us_per_seq),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(flag, "must be a finite number ≥ 0"));
            }
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(invalid("time-scale", "must be a finite number > 0"));
        }
        let hash_mode = match self.kv_events_hash_bytes {
            0 => HashMode::Int,
            32 => HashMode::Bytes32,
            n => return Err(invalid("kv-events-hash-bytes", format!("{n} is not 0 (u64) or 32"))),
        };
        if self.kv_events_buffer == 0 {
            return Err(invalid("kv-events-buffer", "must be at least 1"));
        }
        let events = match self.kv_events_endpoint {
            Some(endpoint) => Some(EventsConfig {
                endpoint,
                topic: self.kv_events_topic,
                format: self.kv_events_format,
                hash_mode,
                replay_endpoint: self.kv_events_replay_endpoint,
                buffer: self.kv_events_buffer,
            }),
            None if self.kv_events_replay_endpoint.is_some() => {
                return Err(invalid("kv-events-replay-endpoint", "needs --kv-events-endpoint"));
            }
            None => None,
        };
        let faults = Faults {
            drop_events: self.fault_drop_events,
            pause_events: self.fault_pause_events,
            reject: self.fault_reject,
            reject_status: self.fault_reject_status,
            slowdown: self.fault_slowdown,
        };
        faults.validate().map_err(|e| invalid("fault-*", e.to_string()))?;
        let model = ModelName::new(self.model);
        if model.as_str().is_empty() {
            return Err(invalid("model", "must not be empty"));
        }
        if !(1..=64).contains(&self.data_parallel_size) {
            return Err(invalid("data-parallel-size", "must be 1 to 64"));
        }
        let dp_ranks = match self.data_parallel_rank {
            Some(r) if r >= self.data_parallel_size => {
                return Err(invalid("data-parallel-rank", "must be below --data-parallel-size"));
            }
            Some(r) => vec![r],
            None => (0..self.data_parallel_size).collect(),
        };
        Ok(Config {
            model,
            loras: self.loras.into_iter().map(ModelName::new).collect(),
            tokenizer: self.tokenizer,
            block_size,
            num_blocks: self.num_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            default_max_tokens: self.default_max_tokens,
            cost: StepCost {
                overhead_us: self.step_overhead_us,
                prefill_us_per_token: self.prefill_us_per_token,
                decode_us_per_seq: self.decode_us_per_seq,
            },
            pace: if self.instant { Pace::Instant } else { Pace::Scaled(self.time_scale) },
            hash_mode,
            events,
            faults,
            dp_ranks,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let argv = std::iter::once("kvroute-sim").chain(args.iter().copied());
        Args::try_parse_from(argv).expect("flags parse").into_config()
    }

    #[test]
    fn flags_become_a_typed_config() {
        let c = parse(&[
            "--model",
            "m",
            "--lora",
            "a",
            "--lora",
            "b",
            "--kv-events-endpoint",
            "tcp://*:5557",
            "--kv-events-format",
            "legacy",
            "--kv-events-hash-bytes",
            "32",
            "--time-scale",
            "10",
        ])
        .expect("valid");
        assert_eq!(c.lora_id("b"), Some(2));
        assert_eq!(c.lora_id("m"), None);
        let ev = c.events.as_ref().expect("events on");
        assert_eq!((ev.format, ev.hash_mode, ev.topic.as_str()), (EventFormat::Legacy, HashMode::Bytes32, ""));
        assert_eq!(c.pace, Pace::Scaled(10.0));
        // 5 ms + 100 × 70 µs + 10 × 40 µs = 12.4 ms, ten times faster.
        let d = c.step_duration(100, 10, 1.0).expect("timed");
        assert!((d.as_secs_f64() - 0.00124).abs() < 1e-9, "{d:?}");
        assert!(parse(&["--instant"]).expect("valid").step_duration(100, 10, 1.0).is_none());
    }

    #[test]
    fn bad_flags_name_themselves() {
        for (args, flag) in [
            (&["--kv-events-hash-bytes", "16"][..], "kv-events-hash-bytes"),
            (&["--block-size", "0"][..], "block-size"),
            (&["--time-scale", "0"][..], "time-scale"),
            (&["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"][..], "kv-events-replay-endpoint"),
            (&["--fault-reject", "1.5"][..], "fault-*"),
        ] {
            let ConfigError::Invalid { flag: got, .. } = parse(args).expect_err("invalid");
            assert_eq!(got, flag);
        }
    }
}
