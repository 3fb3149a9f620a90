//! `long_conv`: the shape of the public trace kvroute was not tuned on
//! (issue 12): multi-turn conversations whose prompts all share their first
//! 512-token block and average ~14k tokens.
//!
//! Each conversation opens with the shared block and its own 9–15k-token
//! context; 2–6 turns follow, each adding a 200–1,000-token message and the
//! previous answer (100–300 tokens). Conversations start at 1/s at the base
//! rate; turns are 20 s apart on average.

use super::{RequestSpec, Shape, Turn, seg};
use crate::prompt::{Prompt, Rng};
use crate::time::Micros;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0x1c0);
    let shared = seg(shape.seed, 10, 0, 512);
    let mut out = Vec::with_capacity(shape.requests + 8);
    let mut start = 0.0;
    let mut conv = 0u64;
    while out.len() < shape.requests {
        start += rng.exp(1.0);
        conv += 1;
        let mut prompt = Prompt(vec![shared, seg(shape.seed, 11, conv, rng.range(9_000, 15_000))]);
        let turns = rng.range(2, 6);
        let (mut t, mut think) = (start, 0.0);
        for turn in 0..turns {
            prompt = prompt.with(seg(shape.seed, 12, conv << 8 | turn, rng.range(200, 1_000)));
            let answer = rng.range(100, 300);
            let place = Turn { session: conv, index: turn as u32, think: Micros::from_secs_f64(think) };
            out.push(RequestSpec::new(Micros::from_secs_f64(t), prompt.clone(), answer as u32).in_session(place));
            prompt = prompt.with(seg(shape.seed, 13, conv << 8 | turn, answer));
            think = rng.exp(20.0);
            t += think;
        }
    }
    out
}
