//! `agent`: tool-calling loops.
//!
//! Every session starts with the same 6,000-token tool prompt (tool schemas
//! and instructions) and a 100–400-token task; each step appends the model's
//! call (its previous output, 20–120 tokens) and a 50–600-token tool result,
//! and asks again. Sessions run 3–15 steps, 1–3 s apart; new sessions start
//! at 2/s at the base rate.

use super::{RequestSpec, Shape, Turn, seg};
use crate::prompt::{Prompt, Rng};
use crate::time::Micros;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0xa9e);
    let tools = seg(shape.seed, 30, 0, 6_000);
    let mut out = Vec::with_capacity(shape.requests + 16);
    let mut start = 0.0;
    let mut session = 0u64;
    while out.len() < shape.requests {
        start += rng.exp(0.5);
        session += 1;
        let mut prompt = Prompt(vec![tools, seg(shape.seed, 31, session, rng.range(100, 400))]);
        let (mut t, mut think) = (start, 0.0);
        for step in 0..rng.range(3, 15) {
            let call = rng.range(20, 120);
            let place = Turn { session, index: step as u32, think: Micros::from_secs_f64(think) };
            out.push(RequestSpec::new(Micros::from_secs_f64(t), prompt.clone(), call as u32).in_session(place));
            prompt = prompt.with(seg(shape.seed, 32, session << 8 | step, call)).with(seg(
                shape.seed,
                33,
                session << 8 | step,
                rng.range(50, 600),
            ));
            think = 1.0 + 2.0 * rng.f64();
            t += think;
        }
    }
    out
}
