//! `burst`: bursts of related requests over light background traffic.
//!
//! Every 10 s (base rate) a burst of 24–64 requests arrives within 300 ms, all
//! sharing a fresh 3,000–5,000-token prefix (a batch job, a fan-out agent)
//! and each adding a 50–200-token suffix. Between bursts, independent
//! 500–2,000-token requests arrive at 2/s. Answers are 30–200 tokens.

use super::{RequestSpec, Shape, seg};
use crate::prompt::{Prompt, Rng};
use crate::time::Micros;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0xb57);
    let mut out = Vec::with_capacity(shape.requests + 64);
    let mut id = 0u64;
    let mut window = 0u64;
    while out.len() < shape.requests {
        let base = window as f64 * 10.0;
        let prefix = seg(shape.seed, 50, window, rng.range(3_000, 5_000));
        for _ in 0..rng.range(24, 64) {
            id += 1;
            let at = base + 0.3 * rng.f64();
            let prompt = Prompt(vec![prefix, seg(shape.seed, 51, id, rng.range(50, 200))]);
            out.push(RequestSpec::new(Micros::from_secs_f64(at), prompt, rng.range(30, 200) as u32));
        }
        let mut t = base;
        loop {
            t += rng.exp(0.5);
            if t >= base + 10.0 {
                break;
            }
            id += 1;
            let prompt = Prompt(vec![seg(shape.seed, 52, id, rng.range(500, 2_000))]);
            out.push(RequestSpec::new(Micros::from_secs_f64(t), prompt, rng.range(30, 200) as u32));
        }
        window += 1;
    }
    out
}
