//! What vLLM's Prometheus `/metrics` text says of the engine (DESIGN.md §4):
//! requests running and waiting (summed over label sets, e.g. one per engine
//! of a data-parallel deployment) and KV-cache usage, for the sidecar; the
//! engine's cache configuration (`vllm:cache_config_info`: block size,
//! prefix caching, KV blocks), for the sidecar and for a router's workers
//! without one.
//!
//! Hand-written on purpose (issue 15 asked for a library): `prometheus-parse`
//! 0.2.5 matches metric names with `\w+` and reads none of vLLM's `vllm:…`
//! samples (0 of 4 on the test page below, checked 2026-11-23); the one crate
//! found that reads them, `prom_text_format_parser` 0.1.0 (a single release,
//! on winnow 0.5, strum 0.25 and derive_more 0.99), rejects a whole page for
//! one line it cannot parse and took 0.64-0.97 ms per 65 kB page (40
//! histogram families) against 0.09 ms for this scan of the five families
//! needed, release build on this project's 2-core machine. The scrape runs
//! once a second, so speed alone would not decide it; fitting vLLM's names and
//! surviving a stray line do.

use std::collections::BTreeMap;

use crate::wire::Load;

const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
const CACHE_CONFIG: &str = "vllm:cache_config_info";
const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";

/// Samples of one metric family: `(labels text, value)` per series.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let (labels, rest) = match rest.strip_prefix('{') {
            Some(r) => {
                let end = r.rfind('}')?;
                (&r[..end], &r[end + 1..])
            }
            None if rest.starts_with([' ', '\t']) => ("", rest),
            None => return None,
        };
        // "value [timestamp]"
        let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
        value.is_finite().then_some((labels, value))
    })
}

/// The `engine="N"` label of a series (vLLM numbers its data-parallel
/// engines so), if it has one.
fn engine_label(labels: &str) -> Option<u32> {
    let at = labels.split(',').find_map(|l| l.trim_start().strip_prefix("engine=\""))?;
    at.split('"').next()?.parse().ok()
}

/// The three families' samples of one engine (or of all), added up.
#[derive(Default)]
struct Sums {
    running: Option<f64>,
    waiting: Option<f64>,
    usage: f64,
    usages: usize,
}

impl Sums {
    fn add(&mut self, family: &str, v: f64) {
        match family {
            RUNNING => self.running = Some(self.running.unwrap_or(0.0) + v),
            WAITING => self.waiting = Some(self.waiting.unwrap_or(0.0) + v),
            _ => {
                self.usage += v;
                self.usages += 1;
            }
        }
    }

    fn load(&self) -> Option<Load> {
        if self.running.is_none() && self.waiting.is_none() && self.usages == 0 {
            return None;
        }
        // A fraction per engine: the mean (not the sum) stays within 0..=1,
        // which is what it means and what routers accept.
        let kv_usage = if self.usages == 0 { 0.0 } else { self.usage / self.usages as f64 };
        Some(Load {
            running: self.running.unwrap_or(0.0).max(0.0) as u32,
            waiting: self.waiting.unwrap_or(0.0).max(0.0) as u32,
            kv_usage: kv_usage.clamp(0.0, 1.0),
        })
    }
}

/// The load from a `/metrics` body (`None` when none of the three families
/// is present: not a vLLM, or not up yet), and every data-parallel
/// engine's own (its `engine="N"` series), in one pass over the page: asked
/// rank by rank, a page of 8 MiB was read three times per rank each second
/// (1,024 ranks: gigabytes a second).
pub fn parse_loads(text: &str) -> (Option<Load>, BTreeMap<u32, Load>) {
    let mut whole = Sums::default();
    let mut by: BTreeMap<u32, Sums> = BTreeMap::new();
    for family in [RUNNING, WAITING, KV_USAGE] {
        for (labels, v) in samples(text, family) {
            whole.add(family, v);
            if let Some(e) = engine_label(labels) {
                by.entry(e).or_default().add(family, v);
            }
        }
    }
    (whole.load(), by.into_iter().filter_map(|(e, sums)| Some((e, sums.load()?))).collect())
}

/// `vllm:prompt_tokens_total` summed over engines: rises whenever the engine
/// prefills, which is when it should be publishing `BlockStored` events.
pub fn parse_prompt_tokens(text: &str) -> Option<f64> {
    samples(text, PROMPT_TOKENS).map(|(_, v)| v).fold(None, |acc, v| Some(acc.unwrap_or(0.0) + v))
}

/// The `block_size` label of `vllm:cache_config_info`.
pub fn parse_block_size(text: &str) -> Option<u32> {
    cache_config_label(text, "block_size").and_then(|v| v.parse().ok())
}

/// The `enable_prefix_caching` label of `vllm:cache_config_info` (Python's
/// `True` / `False`).
pub fn parse_prefix_caching(text: &str) -> Option<bool> {
    match cache_config_label(text, "enable_prefix_caching")? {
        "True" | "true" => Some(true),
        "False" | "false" => Some(false),
        _ => None,
    }
}

/// A label of `vllm:cache_config_info` (`block_size`, `num_gpu_blocks`, …).
pub fn cache_config_label<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    samples(text, CACHE_CONFIG).find_map(|(labels, _)| {
        // The label itself, not one ending in its name.
        let at = labels.match_indices(&key).find(|(i, _)| *i == 0 || labels[..*i].ends_with([',', ' ']))?.0;
        let at = at + key.len();
        let end = labels[at..].find('"')?;
        Some(&labels[at..at + end])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3-8b"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen3-8b"} 2.0
vllm:num_requests_waiting{engine="0",model_name="qwen3-8b"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen3-8b"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="qwen3-8b"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True"} 1.0
"#;

    #[test]
    fn sums_counts_and_averages_usage() {
        let load = parse_loads(TEXT).0.unwrap();
        assert_eq!((load.running, load.waiting), (5, 1));
        assert!((load.kv_usage - 0.375).abs() < 1e-9);
        assert_eq!(parse_block_size(TEXT), Some(32));
        assert_eq!(parse_prefix_caching(TEXT), Some(true));
        let off = "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"False\",kv_block_size=\"8\"} 1.0\n";
        assert_eq!((parse_block_size(off), parse_prefix_caching(off)), (Some(16), Some(false)));
        assert_eq!(parse_prefix_caching("vllm:num_requests_running 1\n"), None);
    }

    #[test]
    fn one_data_parallel_engines_load() {
        let (_, all) = parse_loads(TEXT);
        let one = all[&1];
        assert_eq!((one.running, one.waiting, one.kv_usage), (2, 0, 0.25));
        let zero = all[&0];
        assert_eq!((zero.running, zero.waiting, zero.kv_usage), (3, 1, 0.5));
        assert_eq!(all.get(&7), None);
        assert_eq!(all.keys().copied().collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn a_line_it_cannot_read_costs_only_that_line() {
        let text = format!(
            "{TEXT}vllm:num_requests_running{{engine=\"2\" oops\nvllm:num_requests_waiting NaN\nnot a sample\n"
        );
        let load = parse_loads(&text).0.unwrap();
        assert_eq!((load.running, load.waiting), (5, 1));
        assert_eq!(parse_block_size(&text), Some(32));
    }

    #[test]
    fn absent_metrics_are_none() {
        assert_eq!(parse_loads("# nothing\nother_metric 1\n").0, None);
        assert_eq!(parse_block_size("vllm:num_requests_running 1\n"), None);
        assert_eq!(parse_loads("vllm:num_requests_running 4 1700000000000\n").0.unwrap().running, 4);
    }
}
