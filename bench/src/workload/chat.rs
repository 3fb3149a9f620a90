//! Multi-turn chat in the shape of LMCache's multi-round QA benchmark: every
//! user shares one system prompt, has a private context, and asks `rounds`
//! questions; each turn's prompt is the whole conversation so far (system +
//! context + earlier questions and answers + the new question). Sessions are
//! closed-loop: a user's next turn starts after the previous answer plus a
//! think time. Users start staggered.
//!
//! The answers in the history are synthetic tokens, not the engine's output.
//! Engines (vLLM and kvroute-sim alike) also cache the blocks they generate,
//! but those hold the engine's own answer, which the next turn does not
//! repeat here: what it reuses is turn k-1's prompt, which turn k extends by
//! construction.

use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;

use super::{After, Prompt, Request, Workload, exp_sample};
use crate::tokens::{extend_run, seed};

const TAG_SYSTEM: u64 = 0x4348_5359;
const TAG_CONTEXT: u64 = 0x4348_4354;
const TAG_QUESTION: u64 = 0x4348_5155;
const TAG_ANSWER: u64 = 0x4348_414e;

#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub users: usize,
    pub rounds: usize,
    pub system_len: usize,
    pub context_len: usize,
    pub question_len: usize,
    /// Tokens of (synthetic) answer appended to the history after each turn.
    pub answer_len: usize,
    pub output_len: u32,
    /// Seconds between two users' first turns.
    pub stagger: f64,
    /// Mean think time in seconds (exponential).
    pub think: f64,
    pub seed: u64,
    pub time_scale: f64,
}

impl Params {
    pub fn full() -> Self {
        Params {
            users: 24,
            rounds: 6,
            system_len: 1024,
            context_len: 512,
            question_len: 64,
            answer_len: 64,
            output_len: 16,
            stagger: 0.25,
            think: 1.0,
            seed: 2,
            time_scale: 4.0,
        }
    }

    pub fn quick() -> Self {
        Params { users: 8, rounds: 3, think: 0.3, ..Params::full() }
    }

    /// For 2 real vLLM engines on CPU (`--engine vllm`): the last turn is
    /// 2,624 tokens, inside the tiny model's 4096-token context.
    pub fn vllm() -> Self {
        Params { users: 12, rounds: 5, system_len: 1536, stagger: 0.5, ..Params::full() }
    }
}

/// Requests are listed round by round (every user's turn 0, then turn 1, …),
/// which is close to the order they run in; turn k > 0 follows turn k-1.
pub fn generate(p: &Params) -> Workload {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut history: Vec<Vec<u32>> = (0..p.users)
        .map(|u| {
            let mut h = Vec::new();
            extend_run(&mut h, seed(TAG_SYSTEM, p.seed, 0), p.system_len);
            extend_run(&mut h, seed(TAG_CONTEXT, p.seed, u as u64), p.context_len);
            h
        })
        .collect();
    let mut requests = Vec::with_capacity(p.users * p.rounds);
    for round in 0..p.rounds {
        for (u, h) in history.iter_mut().enumerate() {
            let turn = (u * p.rounds + round) as u64;
            extend_run(h, seed(TAG_QUESTION, p.seed, turn), p.question_len);
            let (arrival, after) = if round == 0 {
                (Duration::from_secs_f64(u as f64 * p.stagger), None)
            } else {
                let think = Duration::from_secs_f64(exp_sample(&mut rng, p.think));
                (Duration::ZERO, Some(After { request: requests.len() - p.users, think }))
            };
            requests.push(Request {
                arrival,
                after,
                prompt: Prompt::Tokens(Arc::from(h.as_slice())),
                max_tokens: p.output_len,
            });
            extend_run(h, seed(TAG_ANSWER, p.seed, turn), p.answer_len);
        }
    }
    Workload {
        name: "chat".into(),
        description: format!(
            "{} users × {} rounds, shared system prompt {} + user context {}, question {} + answer {} tokens per round, \
             {} output tokens, closed loop with {} s mean think time",
            p.users, p.rounds, p.system_len, p.context_len, p.question_len, p.answer_len, p.output_len, p.think
        ),
        requests,
        time_scale: p.time_scale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_turn_extends_the_previous_one() {
        let p = Params { users: 3, rounds: 4, system_len: 32, context_len: 16, ..Params::full() };
        let w = generate(&p);
        assert_eq!(w.requests.len(), 12);
        for (i, r) in w.requests.iter().enumerate() {
            let Some(after) = r.after else {
                assert!(i < p.users);
                continue;
            };
            assert_eq!(after.request, i - p.users);
            let prev = w.requests[after.request].prompt.tokens();
            let cur = r.prompt.tokens();
            assert_eq!(cur.len(), prev.len() + p.answer_len + p.question_len);
            assert_eq!(cur[..prev.len()], prev[..]);
        }
    }

    #[test]
    fn users_share_only_the_system_prompt() {
        let p = Params { users: 2, rounds: 1, system_len: 32, context_len: 16, ..Params::full() };
        let w = generate(&p);
        let (a, b) = (w.requests[0].prompt.tokens(), w.requests[1].prompt.tokens());
        assert_eq!(a[..32], b[..32]);
        assert_ne!(a[32], b[32]);
    }
}
