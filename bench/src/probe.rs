//! Read-only looks into the cluster: the engines' prefix-cache counters and
//! the router's debug endpoints. compare takes hit rates from the engines
//! (the source of truth), lifecycle watches the router's map through these.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::BenchError;

/// The engines' token-level prefix cache counters (vLLM metric names),
/// summed, and each engine's count of requests served
/// (`vllm:request_success_total`), in the order the engines were given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheCounters {
    pub queries: f64,
    pub hits: f64,
    pub served: Vec<f64>,
}

impl CacheCounters {
    /// Hit rate of what happened between `before` and `self`.
    pub fn rate_since(&self, before: &CacheCounters) -> f64 {
        let q = self.queries - before.queries;
        if q <= 0.0 { 0.0 } else { (self.hits - before.hits) / q }
    }
}

/// Sums a counter's samples (any labels) in Prometheus text.
pub fn sum_metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            // `name{labels} v` or `name v`, not `name_suffix v`.
            let rest = match rest.as_bytes().first() {
                Some(b'{') => &rest[rest.find('}')? + 1..],
                Some(b' ') => rest,
                _ => return None,
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

pub async fn get_text(client: &reqwest::Client, url: &str) -> Result<String, BenchError> {
    let http = |source| BenchError::Http { url: url.to_owned(), source };
    client.get(url).send().await.map_err(http)?.error_for_status().map_err(http)?.text().await.map_err(http)
}

pub async fn get_json(client: &reqwest::Client, url: &str) -> Result<Value, BenchError> {
    let text = get_text(client, url).await?;
    serde_json::from_str(&text).map_err(|e| BenchError::Unexpected { url: url.to_owned(), message: e.to_string() })
}

pub async fn post_json(client: &reqwest::Client, url: &str, body: &Value) -> Result<Value, BenchError> {
    let http = |source| BenchError::Http { url: url.to_owned(), source };
    let resp = client.post(url).json(body).send().await.map_err(http)?.error_for_status().map_err(http)?;
    let text = resp.text().await.map_err(http)?;
    Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `POST /reset_prefix_cache` until the engine reports success. vLLM answers
/// `{"success": false}` while running requests still hold blocks (e.g.
/// streams the client just dropped); kvroute-sim answers 200 with no body.
pub async fn reset_prefix_cache(client: &reqwest::Client, engine: &str, wait: Duration) -> Result<(), BenchError> {
    let url = format!("{engine}/reset_prefix_cache");
    let started = Instant::now();
    loop {
        let answer = post_json(client, &url, &Value::Null).await?;
        if answer["success"] != Value::Bool(false) {
            return Ok(());
        }
        if started.elapsed() > wait {
            return Err(BenchError::Timeout(format!("{url} still refused after {} s", wait.as_secs())));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Every engine's counters, one `/metrics` read each.
pub async fn cache_counters(client: &reqwest::Client, engines: &[String]) -> Result<CacheCounters, BenchError> {
    let mut total = CacheCounters { served: Vec::with_capacity(engines.len()), ..CacheCounters::default() };
    for e in engines {
        let text = get_text(client, &format!("{e}/metrics")).await?;
        total.queries += sum_metric(&text, "vllm:prefix_cache_queries_total");
        total.hits += sum_metric(&text, "vllm:prefix_cache_hits_total");
        total.served.push(sum_metric(&text, "vllm:request_success_total"));
    }
    Ok(total)
}

/// The routers' `kvroute_dispatch_delay_seconds` histogram, summed over
/// `routers`: (p50, p99) in ms, each the upper bound of the bucket it falls
/// in. `None` when no router answers or none has dispatched anything.
pub async fn dispatch_delay_ms(client: &reqwest::Client, routers: &[String]) -> Option<(f64, f64)> {
    let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
    for r in routers {
        let text = get_text(client, &format!("{r}/metrics")).await.ok()?;
        for (le, count) in histogram_buckets(&text, "kvroute_dispatch_delay_seconds") {
            *buckets.entry(le.to_bits()).or_default() += count;
        }
    }
    // Bucket bounds are positive, whose bit patterns order as their values:
    // the map is already in `le` order.
    let cumulative: Vec<(f64, f64)> = buckets.into_iter().map(|(le, n)| (f64::from_bits(le), n)).collect();
    let total = cumulative.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let quantile = |q: f64| cumulative.iter().find(|(_, n)| *n >= q * total).map(|(le, _)| le * 1e3);
    Some((quantile(0.5)?, quantile(0.99)?))
}

/// `(le, cumulative count)` of a Prometheus histogram's `_bucket` series
/// (`+Inf` as infinity).
pub fn histogram_buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let at = rest.find("le=\"")? + 4;
            let le = &rest[at..at + rest[at..].find('"')?];
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            let count = rest[rest.find('}')? + 1..].split_whitespace().next()?.parse().ok()?;
            Some((le, count))
        })
        .collect()
}

/// `POST /debug/route` for a token-id prompt: the router's would-be decision
/// and each worker's matched blocks.
#[derive(Debug, Clone)]
pub struct RouteView {
    pub worker: Option<String>,
    pub reason: String,
    pub matched: Vec<(String, u64)>,
}

impl RouteView {
    pub fn matched_blocks(&self, worker: &str) -> u64 {
        self.matched.iter().find(|(w, _)| w == worker).map_or(0, |m| m.1)
    }
}

pub async fn debug_route(
    client: &reqwest::Client,
    router: &str,
    model: &str,
    prompt: &[u32],
) -> Result<RouteView, BenchError> {
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1});
    let v = post_json(client, &format!("{router}/debug/route"), &body).await?;
    let matched = v["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .map(|w| (w["id"].as_str().unwrap_or_default().to_owned(), w["matched_blocks"].as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    Ok(RouteView {
        worker: v["decision"]["worker"].as_str().map(str::to_owned),
        reason: v["decision"]["reason"].as_str().map_or_else(|| v["decision"]["reason"].to_string(), str::to_owned),
        matched,
    })
}

/// Confirmed index entries per worker from `GET /debug/index`.
pub async fn index_confirmed(client: &reqwest::Client, router: &str) -> Result<Vec<(String, u64)>, BenchError> {
    let v = get_json(client, &format!("{router}/debug/index")).await?;
    let mut out: Vec<(String, u64)> = v["workers"]
        .as_object()
        .map(|m| m.iter().map(|(k, w)| (k.clone(), w["confirmed"].as_u64().unwrap_or(0))).collect())
        .unwrap_or_default();
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_labelled_samples_and_skips_lookalikes() {
        let text = "# HELP x\nvllm:prefix_cache_hits_total{model_name=\"m\"} 12\n\
                    vllm:prefix_cache_hits_total{model_name=\"n\"} 3.0\n\
                    vllm:prefix_cache_hits_total_created 99\nvllm:prefix_cache_hits 5\n";
        assert_eq!(sum_metric(text, "vllm:prefix_cache_hits_total"), 15.0);
    }

    #[test]
    fn reads_histogram_buckets() {
        let text = "kvroute_dispatch_delay_seconds_bucket{le=\"0.001\"} 90\n\
                    kvroute_dispatch_delay_seconds_bucket{le=\"0.002\"} 99\n\
                    kvroute_dispatch_delay_seconds_bucket{le=\"+Inf\"} 100\n\
                    kvroute_dispatch_delay_seconds_count 100\n";
        let b = histogram_buckets(text, "kvroute_dispatch_delay_seconds");
        assert_eq!(b, [(0.001, 90.0), (0.002, 99.0), (f64::INFINITY, 100.0)]);
    }
}
