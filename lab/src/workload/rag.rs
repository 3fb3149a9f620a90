//! `rag`: retrieval-augmented questions over a few long documents.
//!
//! Twelve documents of 4–10k tokens, chosen by Zipf(0.8) popularity; each
//! prompt is a 300-token instruction, one document and a 30–150-token
//! question; answers are 50–250 tokens. Poisson arrivals.

use super::{RequestSpec, Shape, seg};
use crate::prompt::{Prompt, Rng, Zipf};
use crate::time::Micros;

const DOCS: usize = 12;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0x4a6);
    let instruction = seg(shape.seed, 20, 0, 300);
    let docs: Vec<_> = (0..DOCS as u64).map(|d| seg(shape.seed, 21, d, rng.range(4_000, 10_000))).collect();
    let zipf = Zipf::new(DOCS, 0.8);
    let mut t = 0.0;
    (0..shape.requests as u64)
        .map(|q| {
            t += rng.exp(1.0);
            let doc = docs[zipf.sample(&mut rng)];
            let prompt = Prompt(vec![instruction, doc, seg(shape.seed, 22, q, rng.range(30, 150))]);
            RequestSpec::new(Micros::from_secs_f64(t), prompt, rng.range(50, 250) as u32)
        })
        .collect()
}
