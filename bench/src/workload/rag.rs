//! Retrieval-augmented generation: a pool of documents with Zipf popularity;
//! each request is a short shared instruction, one retrieved document and a
//! short question. Popular documents repeat often, the long tail rarely, so
//! where a document's KV lives decides the hit rate.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{Prompt, Request, Workload, concat, poisson_arrivals};
use crate::tokens::seed;

const TAG_SYSTEM: u64 = 0x5241_4753;
const TAG_DOC: u64 = 0x5241_4744;
const TAG_QUESTION: u64 = 0x5241_4751;

#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub documents: usize,
    pub doc_len: usize,
    /// Zipf exponent of document popularity.
    pub zipf_s: f64,
    pub system_len: usize,
    pub question_len: usize,
    pub output_len: u32,
    pub requests: usize,
    pub rate: f64,
    pub seed: u64,
    pub time_scale: f64,
}

impl Params {
    pub fn full() -> Self {
        Params {
            documents: 64,
            doc_len: 1536,
            zipf_s: 1.0,
            system_len: 128,
            question_len: 48,
            output_len: 16,
            requests: 480,
            rate: 16.0,
            seed: 3,
            time_scale: 4.0,
        }
    }

    pub fn quick() -> Self {
        Params { documents: 24, requests: 64, ..Params::full() }
    }

    /// For 2 real vLLM engines on CPU (`--engine vllm`): 2,224-token prompts
    /// at a rate the CPU keeps up with (≈ 30 s per run).
    pub fn vllm() -> Self {
        Params { documents: 24, doc_len: 2048, output_len: 8, requests: 96, rate: 3.0, ..Params::full() }
    }
}

/// Cumulative Zipf weights over ranks 1..=n, normalised to end at 1.
pub fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (1..=n)
        .map(|k| {
            acc += 1.0 / (k as f64).powf(s);
            acc
        })
        .collect();
    for c in &mut cdf {
        *c /= acc;
    }
    cdf
}

/// The document (0-based popularity rank) a uniform draw `u` in [0, 1) picks.
pub fn pick(cdf: &[f64], u: f64) -> usize {
    cdf.partition_point(|&c| c <= u).min(cdf.len() - 1)
}

pub fn generate(p: &Params) -> Workload {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let cdf = zipf_cdf(p.documents, p.zipf_s);
    let arrivals = poisson_arrivals(&mut rng, p.requests, p.rate);
    let requests = arrivals
        .into_iter()
        .enumerate()
        .map(|(i, arrival)| {
            let doc = pick(&cdf, rng.r#gen::<f64>());
            Request {
                arrival,
                after: None,
                prompt: Prompt::Tokens(concat(&[
                    (seed(TAG_SYSTEM, p.seed, 0), p.system_len),
                    (seed(TAG_DOC, p.seed, doc as u64), p.doc_len),
                    (seed(TAG_QUESTION, p.seed, i as u64), p.question_len),
                ])),
                max_tokens: p.output_len,
            }
        })
        .collect();
    Workload {
        name: "rag".into(),
        description: format!(
            "{} documents × {} tokens (Zipf s = {}), instruction {} + question {} tokens, {} output tokens, \
             {} requests at Poisson {} req/s",
            p.documents, p.doc_len, p.zipf_s, p.system_len, p.question_len, p.output_len, p.requests, p.rate
        ),
        requests,
        time_scale: p.time_scale,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn zipf_favours_low_ranks() {
        let cdf = zipf_cdf(4, 1.0);
        assert!((cdf[3] - 1.0).abs() < 1e-12);
        // Weights 1, 1/2, 1/3, 1/4 of 25/12.
        assert!((cdf[0] - 12.0 / 25.0).abs() < 1e-12);
        assert_eq!(pick(&cdf, 0.0), 0);
        assert_eq!(pick(&cdf, 0.5), 1);
        assert_eq!(pick(&cdf, 0.999_999), 3);
    }

    #[test]
    fn popular_documents_repeat() {
        let p = Params { documents: 10, doc_len: 32, system_len: 16, requests: 400, ..Params::full() };
        let w = generate(&p);
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        for r in &w.requests {
            let t = r.prompt.tokens();
            assert_eq!(t.len(), 16 + 32 + 48);
            *counts.entry(t[16..48].to_vec()).or_default() += 1;
        }
        assert_eq!(counts.len(), 10);
        let top = counts.values().max().copied().unwrap_or(0);
        // Rank 1 has ~34 % of the mass with 10 documents at s = 1.
        assert!(top > 100, "top document seen {top} times");
    }
}
