//! SGLang's "generated shared prefix" benchmark shape: `groups` system
//! prompts, each followed by `prompts_per_group` distinct questions, the
//! requests shuffled and sent as a Poisson stream. A perfect router sends
//! every group to one worker and pays each system prompt once.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::{Prompt, Request, Workload, concat, poisson_arrivals};
use crate::tokens::seed;

const TAG_SYSTEM: u64 = 0x5359_5354;
const TAG_QUESTION: u64 = 0x5155_4553;

#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub groups: usize,
    pub prompts_per_group: usize,
    pub system_len: usize,
    pub question_len: usize,
    pub output_len: u32,
    /// Requests per second (Poisson).
    pub rate: f64,
    pub seed: u64,
    pub time_scale: f64,
}

impl Params {
    pub fn full() -> Self {
        Params {
            groups: 32,
            prompts_per_group: 16,
            system_len: 2048,
            question_len: 128,
            output_len: 16,
            rate: 16.0,
            seed: 1,
            time_scale: 4.0,
        }
    }

    pub fn quick() -> Self {
        Params { groups: 6, prompts_per_group: 8, ..Params::full() }
    }

    /// For 2 real vLLM engines on CPU (`--engine vllm`): prompts that fit the
    /// tiny model's 4096-token context, long enough that prefill shows in
    /// TTFT, at a rate the CPU keeps up with (≈ 30 s per run).
    pub fn vllm() -> Self {
        Params { groups: 12, prompts_per_group: 8, system_len: 3072, output_len: 8, rate: 3.0, ..Params::full() }
    }
}

/// Request `k` of the result is question `order[k]`; the group of a request
/// is recoverable as `index / prompts_per_group` before shuffling, which the
/// tests use.
pub fn generate(p: &Params) -> Workload {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut pairs: Vec<(usize, usize)> =
        (0..p.groups).flat_map(|g| (0..p.prompts_per_group).map(move |q| (g, q))).collect();
    pairs.shuffle(&mut rng);
    let arrivals = poisson_arrivals(&mut rng, pairs.len(), p.rate);
    let requests = pairs
        .iter()
        .zip(arrivals)
        .map(|(&(g, q), arrival)| Request {
            arrival,
            after: None,
            prompt: Prompt::Tokens(concat(&[
                (seed(TAG_SYSTEM, p.seed, g as u64), p.system_len),
                (seed(TAG_QUESTION, p.seed, (g * p.prompts_per_group + q) as u64), p.question_len),
            ])),
            max_tokens: p.output_len,
        })
        .collect();
    Workload {
        name: "shared_prefix".into(),
        description: format!(
            "{} groups × {} prompts, system prompt {} + question {} tokens, {} output tokens, Poisson {} req/s",
            p.groups, p.prompts_per_group, p.system_len, p.question_len, p.output_len, p.rate
        ),
        requests,
        time_scale: p.time_scale,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn small() -> Params {
        Params { groups: 3, prompts_per_group: 4, system_len: 40, question_len: 8, ..Params::full() }
    }

    #[test]
    fn has_the_group_structure() {
        let p = small();
        let w = generate(&p);
        assert_eq!(w.requests.len(), 12);
        let mut groups: HashMap<Vec<u32>, Vec<Vec<u32>>> = HashMap::new();
        for r in &w.requests {
            let t = r.prompt.tokens();
            assert_eq!(t.len(), 48);
            groups.entry(t[..40].to_vec()).or_default().push(t[40..].to_vec());
        }
        assert_eq!(groups.len(), 3, "one distinct system prompt per group");
        for questions in groups.values() {
            assert_eq!(questions.len(), 4);
            let mut q = questions.clone();
            q.sort();
            q.dedup();
            assert_eq!(q.len(), 4, "questions within a group differ");
        }
    }

    #[test]
    fn is_deterministic_and_arrivals_increase() {
        let a = generate(&small());
        let b = generate(&small());
        for (x, y) in a.requests.iter().zip(&b.requests) {
            assert_eq!(x.prompt.tokens(), y.prompt.tokens());
            assert_eq!(x.arrival, y.arrival);
        }
        assert!(a.requests.windows(2).all(|w| w[0].arrival <= w[1].arrival));
    }
}
