//! `GET /metrics`: Prometheus text with vLLM's metric names, labels and number
//! formatting (Python's `prometheus_client`: floats always carry a decimal
//! point, counters' `# TYPE` drops `_total`), so scrapers written for vLLM
//! (the sidecar's load reporting among them) work unchanged.

use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use super::AppState;

/// Python's `repr(float)` for the values we print.
fn num(v: f64) -> String {
    format!("{v:?}")
}

pub async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    let m = &s.metrics;
    let labels = format!("engine=\"0\",model_name=\"{}\"", s.config.model);
    let mut out = String::with_capacity(4096);
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {}\n", num(v));
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        m.running.load(Relaxed) as f64,
    );
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.waiting.load(Relaxed) as f64);
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage());
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = write!(
            out,
            "# HELP {name}_total {help}\n# TYPE {name} counter\n{name}_total{{{labels}}} {}\n",
            num(v as f64)
        );
    };
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        m.prefix_queries.load(Relaxed),
    );
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        m.prefix_hits.load(Relaxed),
    );
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens.load(Relaxed));
    counter("vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens.load(Relaxed));
    counter("vllm:request_success", "Count of successfully processed requests.", m.finished.load(Relaxed));
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", m.preemptions.load(Relaxed));

    let h = m.ttft.lock().clone();
    let name = "vllm:time_to_first_token_seconds";
    let _ = write!(out, "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram\n");
    for (le, c) in h.cumulative() {
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{}\"}} {}", num(le), num(c as f64));
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", num(h.count as f64));
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", num(h.count as f64));
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", num(h.sum));

    let info = "vllm:cache_config_info";
    let _ = write!(
        out,
        "# HELP {info} Information of the LLMEngine CacheConfig\n# TYPE {info} gauge\n\
         {info}{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
         model_name=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"}} 1.0\n",
        s.config.block_size.get(),
        s.config.model,
        s.config.num_blocks,
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out)
}
