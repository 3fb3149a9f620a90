//! `chat`: multi-turn chat behind one shared system prompt.
//!
//! Users arrive as a Poisson process; each holds a conversation of a
//! geometric number of turns (mean 6) and leaves. Turn k's prompt is the
//! 1,200-token system prompt, then every earlier user message (60–400 tokens)
//! and assistant answer (the previous turn's output length), then the new
//! message; think time between turns is exponential (mean 8 s at the base
//! rate). Answers are 50–400 tokens. About 200 users are active at once.

use super::{RequestSpec, Shape, Turn, seg};
use crate::prompt::{Prompt, Rng};
use crate::time::Micros;

const SYSTEM_TOKENS: u64 = 1_200;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0xc4a7);
    let system = seg(shape.seed, 1, 0, SYSTEM_TOKENS);
    let mut out = Vec::with_capacity(shape.requests + 16);
    let mut start = 0.0;
    let mut user = 0u64;
    // Users arrive at 4/s; with ~6 turns 8 s apart, ~200 are active at once.
    while out.len() < shape.requests {
        start += rng.exp(0.25);
        user += 1;
        let mut prompt = Prompt(vec![system]);
        let (mut t, mut think) = (start, 0.0);
        for turn in 0.. {
            prompt = prompt.with(seg(shape.seed, 2, user << 16 | turn, rng.range(60, 400)));
            let answer = rng.range(50, 400) as u32;
            let place = Turn { session: user, index: turn as u32, think: Micros::from_secs_f64(think) };
            out.push(RequestSpec::new(Micros::from_secs_f64(t), prompt.clone(), answer).in_session(place));
            if rng.chance(1.0 / 6.0) {
                break;
            }
            prompt = prompt.with(seg(shape.seed, 3, user << 16 | turn, u64::from(answer)));
            think = rng.exp(8.0);
            t += think;
        }
    }
    out
}
