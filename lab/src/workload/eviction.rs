//! `eviction`: a working set several times what the cluster can cache.
//!
//! Documents of 2,048 tokens, as many as make 4 × the cluster's KV capacity
//! (`Shape::cluster_kv_tokens`), chosen by Zipf(1.0) popularity; each prompt
//! is a document and a 40–120-token question, answers 20–80 tokens. Poisson
//! arrivals. The popular head fits in the cache, the tail keeps evicting it.

use super::{RequestSpec, Shape, seg};
use crate::prompt::{Prompt, Rng, Zipf};
use crate::time::Micros;

const DOC_TOKENS: u64 = 2_048;
const WORKING_SET_OVER_CAPACITY: u64 = 4;

pub(super) fn generate(shape: &Shape) -> Vec<RequestSpec> {
    let mut rng = Rng::new(shape.seed ^ 0xe1c);
    let docs = (WORKING_SET_OVER_CAPACITY * shape.cluster_kv_tokens / DOC_TOKENS).max(8) as usize;
    let zipf = Zipf::new(docs, 1.0);
    let mut t = 0.0;
    (0..shape.requests as u64)
        .map(|q| {
            t += rng.exp(1.0);
            let doc = zipf.sample(&mut rng) as u64;
            let prompt = Prompt(vec![seg(shape.seed, 40, doc, DOC_TOKENS), seg(shape.seed, 41, q, rng.range(40, 120))]);
            RequestSpec::new(Micros::from_secs_f64(t), prompt, rng.range(20, 80) as u32)
        })
        .collect()
}
