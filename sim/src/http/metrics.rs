//! `GET /metrics`: vLLM's metric names, labels and types, encoded by
//! `prometheus-client`, so scrapers written for vLLM (the sidecar's load
//! reporting among them) work unchanged. As in vLLM (Python's
//! `prometheus_client`), a counter's `# TYPE` names it without `_total`, its
//! sample with it; gauges and counters are floats (`3.0`). Histogram counts
//! are integers here (`2`, vLLM prints `2.0`): the same value to any parser.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use super::AppState;
use crate::metrics::EngineMetrics;

/// `vllm:cache_config_info`'s labels, in vLLM's (alphabetical) order.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheConfigInfo {
    block_size: String,
    cache_dtype: &'static str,
    enable_prefix_caching: &'static str,
    engine: &'static str,
    model_name: String,
    num_gpu_blocks: String,
    prefix_caching_hash_algo: &'static str,
}

/// Every rank's gauges, counters and TTFT histogram, read from its atomics
/// at each scrape: one family per name, one series per data-parallel rank
/// (`engine="R"`, as vLLM labels its engine cores), `model_name` after it
/// (a histogram bucket's `le` comes first: any order is the same series).
/// (`Registry::register` appends the period vLLM's help texts end with; a
/// collector's descriptors are written as given.)
#[derive(Debug)]
struct EngineCollector {
    /// `(labels, metrics)` per rank.
    ranks: Vec<(Labels, Arc<EngineMetrics>)>,
}

/// A rank's series labels, `[("engine", R), ("model_name", M)]`.
type Labels = Vec<(String, String)>;

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        type Read = fn(&EngineMetrics) -> f64;
        let gauges: [(&str, &str, Read); 3] = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", |m| {
                m.running.load(Relaxed) as f64
            }),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", |m| {
                m.waiting.load(Relaxed) as f64
            }),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", EngineMetrics::kv_usage),
        ];
        for (name, help, read) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (labels, m) in &self.ranks {
                ConstGauge::new(read(m)).encode(family.encode_family(labels)?)?;
            }
        }
        let counters: [(&str, &str, Read); 6] = [
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", |m| {
                m.prefix_queries.load(Relaxed) as f64
            }),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", |m| {
                m.prefix_hits.load(Relaxed) as f64
            }),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", |m| m.prompt_tokens.load(Relaxed) as f64),
            ("vllm:generation_tokens", "Number of generation tokens processed.", |m| {
                m.generation_tokens.load(Relaxed) as f64
            }),
            ("vllm:request_success", "Count of successfully processed requests.", |m| m.finished.load(Relaxed) as f64),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", |m| {
                m.preemptions.load(Relaxed) as f64
            }),
        ];
        for (name, help, read) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (labels, m) in &self.ranks {
                ConstCounter::new(read(m)).encode(family.encode_family(labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            None,
            MetricType::Histogram,
        )?;
        for (labels, m) in &self.ranks {
            m.ttft.encode(family.encode_family(labels)?)?;
        }
        Ok(())
    }
}

/// The exposition: `vllm:cache_config_info` with its own labels, then every
/// rank's series (see [`EngineCollector`]).
pub fn encode(s: &AppState) -> String {
    let mut registry = Registry::default();
    let info = Family::<CacheConfigInfo, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    registry.register("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info.clone());
    info.get_or_create(&CacheConfigInfo {
        block_size: s.config.block_size.get().to_string(),
        cache_dtype: "auto",
        enable_prefix_caching: "True",
        engine: "0",
        model_name: s.config.model.to_string(),
        num_gpu_blocks: s.config.num_blocks.to_string(),
        prefix_caching_hash_algo: "sha256",
    })
    .set(1.0);
    let model = s.config.model.to_string();
    let ranks = s
        .ranks
        .iter()
        .map(|r| {
            (
                vec![("engine".to_owned(), r.rank.to_string()), ("model_name".to_owned(), model.clone())],
                r.metrics.clone(),
            )
        })
        .collect();
    registry.register_collector(Box::new(EngineCollector { ranks }));
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail. No `# EOF`: this is the 0.0.4 text
    // format vLLM serves, which has none.
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
    out
}

pub async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], encode(&s))
}
