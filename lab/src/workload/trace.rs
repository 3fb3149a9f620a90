//! `trace`: replay of a Mooncake-format trace (one JSON object a line:
//! `timestamp` in ms, `input_length`, `output_length`, `hash_ids`).
//!
//! Each hash id names a 512-token block; it is expanded deterministically into
//! 512 token ids (the last block of a prompt is cut to `input_length`), so two
//! requests sharing leading hash ids share exactly those token prefixes. More
//! requests than the file holds replay it again with fresh ids, each pass
//! after the previous one (`12,000` requests of the 3,993-line synthetic trace
//! are three passes of it, three times as long).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{RequestSpec, Shape, WorkloadError, seg};
use crate::prompt::Prompt;
use crate::time::Micros;

const BLOCK: u64 = 512;
const DOMAIN: u64 = 0x7472_6163_6500;

#[derive(Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u64,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// `../shared/testdata/traces/mooncake_synthetic_trace.jsonl` beside the checkout.
pub fn default_trace_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/testdata/traces/mooncake_synthetic_trace.jsonl")
        .components()
        .collect()
}

fn read(path: &Path) -> Result<Vec<Line>, WorkloadError> {
    if !path.is_file() {
        return Err(WorkloadError::TraceMissing { path: path.to_owned() });
    }
    let text =
        std::fs::read_to_string(path).map_err(|source| WorkloadError::TraceRead { path: path.to_owned(), source })?;
    let mut lines = Vec::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line = serde_json::from_str(l).map_err(|source| WorkloadError::TraceParse {
            path: path.to_owned(),
            line: i + 1,
            source,
        })?;
        lines.push(line);
    }
    if lines.is_empty() {
        return Err(WorkloadError::TraceEmpty { path: path.to_owned() });
    }
    Ok(lines)
}

pub(super) fn generate(shape: &Shape) -> Result<Vec<RequestSpec>, WorkloadError> {
    let lines = read(&shape.trace_path)?;
    let span =
        lines.iter().map(|l| l.timestamp).max().unwrap_or(0) - lines.iter().map(|l| l.timestamp).min().unwrap_or(0);
    let pass_ms = span + span / lines.len() as u64 + 1;
    let out = (0..shape.requests)
        .map(|i| {
            let (pass, l) = ((i / lines.len()) as u64, &lines[i % lines.len()]);
            let n = l.hash_ids.len() as u64;
            let prompt = l
                .hash_ids
                .iter()
                .enumerate()
                .map(|(j, &h)| {
                    let len = if j as u64 + 1 == n {
                        l.input_length.saturating_sub(BLOCK * (n - 1)).clamp(1, BLOCK)
                    } else {
                        BLOCK
                    };
                    seg(shape.seed, DOMAIN + pass, h, len)
                })
                .collect();
            RequestSpec::new(Micros::from_ms(l.timestamp + pass * pass_ms), Prompt(prompt), l.output_length.max(1))
        })
        .collect();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_trace_replays_with_its_shared_blocks() {
        let shape = Shape {
            requests: 4_000,
            seed: 1,
            cluster_kv_tokens: 0,
            trace_path: default_trace_path(),
            closed_loop: false,
        };
        let reqs = match generate(&shape) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(reqs.len(), 4_000);
        // Line 1 of the file: 40,160 tokens in 79 blocks, 6 output tokens.
        assert_eq!((reqs[0].prompt.len(), reqs[0].prompt.0.len(), reqs[0].max_tokens), (40_160, 79, 6));
        // The 3,994th request starts the second pass: same shape, fresh ids.
        assert_eq!(reqs[3_993].prompt.len(), reqs[0].prompt.len());
        assert_ne!(reqs[3_993].prompt, reqs[0].prompt);
        assert!(reqs[3_993].at > reqs[3_992].at);
    }
}
