//! A workload as the lab replays it (`kvroute-lab crosscheck`): one JSON line
//! per request with its arrival, the request it follows and the think time
//! (closed loop), its output cap, its prompt length, and its prompt's full
//! blocks as small ids. Two prompts share a block id exactly when they share
//! every token up to the end of that block (the ids number the chained block
//! hashes of [`crate::ceiling`] in order of first use), which is all an
//! engine's prefix cache can tell apart. So the lab rebuilds prompts with the
//! same sharing structure, block for block, without the token ids.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::Workload;
use crate::ceiling::block_chain;

/// One request of the export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedRequest {
    /// Earliest start from the beginning of the run (closed loop: 0, the
    /// request waits for `after`).
    pub arrival_ms: f64,
    /// Closed loop: the index of the request whose answer this one waits for.
    pub after: Option<usize>,
    /// Closed loop: how long after that answer it is sent.
    pub think_ms: f64,
    pub max_tokens: u32,
    pub prompt_tokens: usize,
    /// The prompt's full blocks, in order, as ids shared across the workload.
    pub blocks: Vec<u32>,
}

/// The workload's requests, in order, with `block`-token blocks.
pub fn export(w: &Workload, block: usize) -> Vec<ExportedRequest> {
    let mut ids: HashMap<u64, u32> = HashMap::new();
    w.requests
        .iter()
        .map(|r| {
            let tokens = r.prompt.tokens();
            let blocks = block_chain(&tokens, block)
                .map(|h| {
                    let next = ids.len() as u32;
                    *ids.entry(h).or_insert(next)
                })
                .collect();
            ExportedRequest {
                arrival_ms: r.arrival.as_secs_f64() * 1e3,
                after: r.after.map(|a| a.request),
                think_ms: r.after.map_or(0.0, |a| a.think.as_secs_f64() * 1e3),
                max_tokens: r.max_tokens,
                prompt_tokens: tokens.len(),
                blocks,
            }
        })
        .collect()
}

/// The export as JSON lines.
pub fn jsonl(requests: &[ExportedRequest]) -> String {
    let mut text = String::new();
    for r in requests {
        text.push_str(&serde_json::to_string(r).unwrap_or_default());
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::workload::{After, Prompt, Request};

    fn request(tokens: Vec<u32>, after: Option<After>) -> Request {
        Request { arrival: Duration::from_millis(5), after, prompt: Prompt::Tokens(Arc::from(tokens)), max_tokens: 7 }
    }

    #[test]
    fn shared_blocks_get_the_same_id_and_a_divergence_a_new_one() {
        let a: Vec<u32> = (0..10).collect();
        let mut b: Vec<u32> = (0..9).collect();
        b[5] = 99;
        let c: Vec<u32> = (0..13).collect();
        let follow = After { request: 0, think: Duration::from_millis(250) };
        let w = Workload {
            name: "t".into(),
            description: String::new(),
            requests: vec![request(a, None), request(b, None), request(c, Some(follow))],
            time_scale: 1.0,
        };
        let e = export(&w, 4);
        // a: [0..4) [0..8); b diverges in its second block; c repeats a's two and adds [0..12).
        assert_eq!(e[0].blocks, vec![0, 1]);
        assert_eq!(e[1].blocks, vec![0, 2]);
        assert_eq!(e[2].blocks, vec![0, 1, 3]);
        assert_eq!((e[0].prompt_tokens, e[1].prompt_tokens, e[2].prompt_tokens), (10, 9, 13));
        assert_eq!((e[2].after, e[2].think_ms, e[0].after), (Some(0), 250.0, None));
        assert_eq!((e[0].arrival_ms, e[0].max_tokens), (5.0, 7));
        let back: Vec<ExportedRequest> =
            jsonl(&e).lines().map(|l| serde_json::from_str(l).expect("a line of the export")).collect();
        assert_eq!(back, e);
    }
}
