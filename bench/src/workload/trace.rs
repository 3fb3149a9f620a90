//! Mooncake trace replay. Each JSONL line is one request:
//! `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`,
//! where every hash id names one 512-token block of the prompt and equal ids
//! mean equal content. Each id becomes a deterministic run of token ids, so
//! equal id sequences give equal prefixes; the last block is cut so the
//! prompt is exactly `input_length` tokens.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::{Prompt, Request, Workload};
use crate::error::BenchError;
use crate::tokens::{extend_run, seed};

const TAG_BLOCK: u64 = 0x4d4f_4f4e;
/// Mooncake's block size.
pub const BLOCK_TOKENS: usize = 512;

#[derive(Debug, Clone, Deserialize)]
pub struct TraceLine {
    pub timestamp: f64,
    pub input_length: usize,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Divides the trace's timestamps.
    pub speedup: f64,
    /// Start after the first `skip` requests (a later stretch of the trace,
    /// where more prompts share blocks with earlier ones in the stretch).
    pub skip: usize,
    /// Replay only the first `limit` requests (after `skip`).
    pub limit: Option<usize>,
    /// Cap on generated tokens per request (the trace's output lengths reach
    /// hundreds; decode is not what routing changes).
    pub max_output: u32,
    pub time_scale: f64,
}

impl Params {
    pub fn full() -> Self {
        Params { speedup: 20.0, skip: 0, limit: None, max_output: 16, time_scale: 20.0 }
    }

    pub fn quick() -> Self {
        Params { speedup: 15.0, limit: Some(120), ..Params::full() }
    }
}

/// The prompt tokens of a trace request.
pub fn expand(hash_ids: &[u64], block_tokens: usize, len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(hash_ids.len() * block_tokens);
    for &id in hash_ids {
        extend_run(&mut out, seed(TAG_BLOCK, id, 0), block_tokens);
        if out.len() >= len {
            break;
        }
    }
    // A trace whose ids cover fewer tokens than `input_length` is padded with
    // a run unique to this request's ids, so it still matches nothing else.
    if out.len() < len {
        let pad = seed(TAG_BLOCK, hash_ids.iter().fold(0, |a, &b| crate::tokens::mix(a ^ b)), 1);
        let missing = len - out.len();
        extend_run(&mut out, pad, missing);
    }
    out.truncate(len);
    out
}

pub fn parse(text: &str) -> Result<Vec<TraceLine>, BenchError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|source| BenchError::TraceLine { line: i + 1, source }))
        .collect()
}

pub fn from_lines(name: &str, lines: &[TraceLine], p: &Params) -> Workload {
    let lines = &lines[p.skip.min(lines.len())..];
    let lines = &lines[..p.limit.map_or(lines.len(), |n| n.min(lines.len()))];
    let t0 = lines.iter().map(|l| l.timestamp).fold(f64::INFINITY, f64::min);
    let requests = lines
        .iter()
        .map(|l| Request {
            arrival: Duration::from_secs_f64(((l.timestamp - t0) / 1000.0 / p.speedup).max(0.0)),
            after: None,
            prompt: Prompt::Blocks {
                hash_ids: Arc::from(l.hash_ids.as_slice()),
                block_tokens: BLOCK_TOKENS,
                len: l.input_length.max(1),
            },
            max_tokens: l.output_length.clamp(1, p.max_output),
        })
        .collect();
    let mut requests: Vec<Request> = requests;
    requests.sort_by_key(|r| r.arrival);
    Workload {
        name: name.into(),
        description: format!(
            "Mooncake trace replay, {} requests{}, {}× speedup, outputs capped at {} tokens",
            lines.len(),
            if p.skip > 0 { format!(" after the first {}", p.skip) } else { String::new() },
            p.speedup,
            p.max_output
        ),
        requests,
        time_scale: p.time_scale,
    }
}

pub fn load(path: &Path, p: &Params) -> Result<Workload, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Read { path: path.into(), source })?;
    Ok(from_lines("trace", &parse(&text)?, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_ids_give_equal_runs() {
        let a = expand(&[1, 2, 3], 8, 24);
        let b = expand(&[1, 2, 4], 8, 24);
        let c = expand(&[5, 2, 3], 8, 24);
        assert_eq!(a.len(), 24);
        assert_eq!(a[..16], b[..16], "shared ids 1, 2 give a shared 16-token prefix");
        assert_ne!(a[16..], b[16..]);
        assert_ne!(a[0], c[0]);
        // Block 2 is the same run wherever it appears: content is per id.
        assert_eq!(a[8..16], c[8..16]);
    }

    #[test]
    fn the_last_block_is_cut_to_the_input_length() {
        assert_eq!(expand(&[1, 2], 8, 13), expand(&[1, 2], 8, 16)[..13]);
        assert_eq!(expand(&[1], 8, 12).len(), 12);
    }

    #[test]
    fn parses_lines_and_scales_time() {
        let text = "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 3000, \"input_length\": 10, \"output_length\": 900, \"hash_ids\": [0]}\n";
        let lines = parse(text).unwrap();
        let w =
            from_lines("t", &lines, &Params { speedup: 2.0, skip: 0, limit: None, max_output: 16, time_scale: 1.0 });
        assert_eq!(w.requests[0].arrival, Duration::ZERO);
        assert_eq!(w.requests[1].arrival, Duration::from_secs(1));
        assert_eq!(w.requests[0].prompt.len(), 600);
        assert_eq!(w.requests[1].max_tokens, 16);
        assert_eq!(w.requests[1].prompt.tokens()[..], w.requests[0].prompt.tokens()[..10]);
        // Skipping the first line: the second starts the replay, at time 0.
        let w =
            from_lines("t", &lines, &Params { speedup: 2.0, skip: 1, limit: None, max_output: 16, time_scale: 1.0 });
        assert_eq!((w.requests.len(), w.requests[0].arrival, w.requests[0].prompt.len()), (1, Duration::ZERO, 10));
    }
}
