//! What a run measures, per request and in summary: TTFT percentiles, queueing
//! time, hit rate against the infinite-cache ceiling, and how evenly prefill
//! work spread over workers (in tokens, not requests).

use serde::Serialize;

use kvroute_router::policy::Reason;

use crate::time::Micros;

/// One request's life in the lab.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestRecord {
    pub arrival: Micros,
    pub first_token: Option<Micros>,
    pub done: Option<Micros>,
    pub rejected: bool,
    pub prompt_tokens: u32,
    /// Served from the engine's prefix cache (vLLM's `cached_tokens`).
    pub cached_tokens: u32,
    /// What an infinite cache holding every earlier prompt would have served.
    pub ceiling_tokens: u32,
    pub worker: u32,
    /// The router replica that placed it, why, and how many of its tokens
    /// that router believed the worker held.
    pub router: u32,
    pub reason: Option<Reason>,
    pub matched_tokens: u32,
}

/// The engine's step-time model, to split TTFT into own work and queueing.
#[derive(Clone, Copy, Debug)]
pub struct StepModel {
    pub overhead_us: f64,
    pub prefill_us_per_token: f64,
    pub max_batched_tokens: usize,
}

impl StepModel {
    /// The request's own prefill time on an idle engine: its uncached tokens
    /// in chunks of the step budget, each chunk a step.
    pub fn own_prefill(&self, uncached: u64) -> f64 {
        let chunks = uncached.max(1).div_ceil(self.max_batched_tokens as u64);
        chunks as f64 * self.overhead_us + uncached as f64 * self.prefill_us_per_token
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub requests: usize,
    pub rejected: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    /// TTFT minus the request's own prefill time on an idle engine.
    pub queue_mean_ms: f64,
    pub queue_p90_ms: f64,
    pub hit_rate: f64,
    pub ceiling: f64,
    /// `hit_rate / ceiling` (1 when the ceiling is 0).
    pub hit_of_ceiling: f64,
    /// Max over mean of prefill tokens computed per worker.
    pub prefill_max_over_mean: f64,
    pub requests_max_over_mean: f64,
    pub preemptions: u64,
    /// Virtual seconds from the first arrival to the last answer.
    pub makespan_s: f64,
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn max_over_mean(v: &[u64]) -> f64 {
    let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    if mean == 0.0 { 1.0 } else { *v.iter().max().unwrap_or(&0) as f64 / mean }
}

pub fn summarize(records: &[RequestRecord], prefill_per_worker: &[u64], preemptions: u64, model: StepModel) -> Summary {
    let mut ttft: Vec<f64> = Vec::with_capacity(records.len());
    let mut queue: Vec<f64> = Vec::with_capacity(records.len());
    let (mut prompt, mut cached, mut ceiling) = (0u64, 0u64, 0u64);
    let mut per_worker = vec![0u64; prefill_per_worker.len()];
    let mut last = Micros::ZERO;
    for r in records {
        prompt += u64::from(r.prompt_tokens);
        ceiling += u64::from(r.ceiling_tokens);
        if let Some(w) = per_worker.get_mut(r.worker as usize) {
            *w += 1;
        }
        if let Some(d) = r.done {
            last = last.max(d);
        }
        let Some(ft) = r.first_token else { continue };
        cached += u64::from(r.cached_tokens);
        let t = ft.saturating_sub(r.arrival).0 as f64;
        ttft.push(t / 1e3);
        let own = model.own_prefill(u64::from(r.prompt_tokens - r.cached_tokens));
        queue.push((t - own).max(0.0) / 1e3);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let ttft_mean_ms = mean(&ttft);
    let queue_mean_ms = mean(&queue);
    ttft.sort_by(f64::total_cmp);
    queue.sort_by(f64::total_cmp);
    let hit_rate = cached as f64 / prompt.max(1) as f64;
    let ceiling = ceiling as f64 / prompt.max(1) as f64;
    let first = records.iter().map(|r| r.arrival).min().unwrap_or_default();
    Summary {
        requests: records.len(),
        rejected: records.iter().filter(|r| r.rejected).count(),
        ttft_p50_ms: percentile(&ttft, 0.50),
        ttft_p90_ms: percentile(&ttft, 0.90),
        ttft_p99_ms: percentile(&ttft, 0.99),
        ttft_mean_ms,
        queue_mean_ms,
        queue_p90_ms: percentile(&queue, 0.90),
        hit_rate,
        ceiling,
        hit_of_ceiling: if ceiling > 0.0 { hit_rate / ceiling } else { 1.0 },
        prefill_max_over_mean: max_over_mean(prefill_per_worker),
        requests_max_over_mean: max_over_mean(&per_worker),
        preemptions,
        makespan_s: last.saturating_sub(first).as_secs_f64(),
    }
}

/// One summary for the same case run with several seeds: TTFT, queueing and
/// hit rate over every seed's requests together (a p99 over 3,000 requests,
/// not three p99s over 1,000, each of them its tenth-slowest request); the
/// per-worker balance and the makespan are the mean of each seed's, since
/// worker `i` of one seed has nothing to do with worker `i` of another.
pub fn pool(runs: &[(&Summary, &[RequestRecord])], model: StepModel) -> Summary {
    let records: Vec<RequestRecord> = runs.iter().flat_map(|(_, r)| r.iter().copied()).collect();
    let mut s = summarize(&records, &[], runs.iter().map(|(s, _)| s.preemptions).sum(), model);
    let n = runs.len().max(1) as f64;
    let mean = |f: fn(&Summary) -> f64| runs.iter().map(|(s, _)| f(s)).sum::<f64>() / n;
    s.prefill_max_over_mean = mean(|s| s.prefill_max_over_mean);
    s.requests_max_over_mean = mean(|s| s.requests_max_over_mean);
    s.makespan_s = mean(|s| s.makespan_s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_balance() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 51.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(max_over_mean(&[10, 30]), 1.5);
        let m = StepModel { overhead_us: 5_000.0, prefill_us_per_token: 70.0, max_batched_tokens: 8_192 };
        assert_eq!(m.own_prefill(10_000), 2.0 * 5_000.0 + 700_000.0);
    }

    #[test]
    fn pooled_seeds_are_one_sample() {
        let m = StepModel { overhead_us: 0.0, prefill_us_per_token: 0.0, max_batched_tokens: 8_192 };
        let rec = |ttft_ms: u64, worker: u32| RequestRecord {
            first_token: Some(Micros::from_ms(ttft_ms)),
            done: Some(Micros::from_ms(ttft_ms)),
            prompt_tokens: 100,
            cached_tokens: 50,
            ceiling_tokens: 100,
            worker,
            ..Default::default()
        };
        // Seed a: 1..=50 ms, all on worker 0; seed b: 51..=100 ms, spread.
        let a: Vec<_> = (1..=50).map(|t| rec(t, 0)).collect();
        let b: Vec<_> = (51..=100).map(|t| rec(t, (t % 2) as u32)).collect();
        let (sa, sb) = (summarize(&a, &[100, 0], 0, m), summarize(&b, &[50, 50], 1, m));
        let p = pool(&[(&sa, &a), (&sb, &b)], m);
        assert_eq!((p.requests, p.ttft_p50_ms, p.ttft_p99_ms), (100, 51.0, 99.0));
        assert_eq!((p.hit_rate, p.hit_of_ceiling, p.preemptions), (0.5, 0.5, 1));
        // Balance is each seed's, averaged: 2.0 and 1.0.
        assert_eq!(p.prefill_max_over_mean, 1.5);
        assert_eq!(p.requests_max_over_mean, (2.0 + 1.0) / 2.0);
    }
}
