//! kvroute-shared: the contract between the kvroute router and its sidecars.
//!
//! - [`keys`]: router block keys (DESIGN.md §1), computed identically from request
//!   tokens (router) and from engine `BlockStored` events (sidecar);
//! - [`digest`]: the order-independent digest of a key set (protocol v2);
//! - [`wire`]: the `/internal/eviction` and `/internal/sync` bodies and the
//!   OpenAI-shaped error body;
//! - [`openai`]: the prompt-deciding parts of OpenAI request bodies;
//! - [`resolve`]: a base URL as every address its host resolves to;
//! - [`body`]: an HTTP body read whole up to a cap (any `http_body::Body`);
//! - [`tokenize`]: token ids exactly as vLLM computes them (HF tokenizer + chat
//!   template).
//!
//! No async runtime or HTTP stack here: the simulator, the router, the sidecar
//! and the benchmarks all depend on it.

pub mod body;
pub mod digest;
pub mod engine_metrics;
pub mod hash;
pub mod ids;
pub mod keys;
pub mod logging;
pub mod openai;
pub mod resolve;
#[cfg(feature = "testdata")]
pub mod testdata;
pub mod tokenize;
pub mod wire;

pub use digest::KeyDigest;
pub use ids::{ModelName, WorkerId};
pub use keys::{BlockKey, BlockSize, KeyRoot, block_keys};
