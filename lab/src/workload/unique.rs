//! `unique`: nothing shared. Held out: written after every routing default
//! was tuned (2026-11-27), the case where a cache-aware router has nothing to
//! gain and must not lose to a plain balancer.
//!
//! Every prompt is its own (no two share a token), its length drawn from a
//! long tail: 70 % 100–1,000 tokens, 25 % 1,000–4,000, 5 % 4,000–16,000;
//! answers too: 50 % 16–128 tokens, 40 % 128–512, 10 % 512–2,048, so decode
//! batches, not prefill, fill most of the engines' time. Poisson arrivals.

use super::{RequestSpec, Shape, seg};
use crate::prompt::{Prompt, Rng};
use crate::time::Micros;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0x0417);
    let mut t = 0.0;
    (0..shape.requests as u64)
        .map(|q| {
            t += rng.exp(1.0);
            let len = match rng.f64() {
                x if x < 0.70 => rng.range(100, 1_000),
                x if x < 0.95 => rng.range(1_000, 4_000),
                _ => rng.range(4_000, 16_000),
            };
            let out = match rng.f64() {
                x if x < 0.50 => rng.range(16, 128),
                x if x < 0.90 => rng.range(128, 512),
                _ => rng.range(512, 2_048),
            };
            RequestSpec::new(Micros::from_secs_f64(t), Prompt(vec![seg(shape.seed, 50, q, len)]), out as u32)
        })
        .collect()
}
