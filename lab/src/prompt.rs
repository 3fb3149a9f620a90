//! Prompts described compactly: a prompt is a list of [`Segment`]s, each a
//! seeded run of token ids. Two prompts share a prefix exactly when they share
//! leading segments, so a workload can describe 12,000 prompts of 15k tokens
//! without holding 700 MB of token ids; tokens are expanded only when a
//! request reaches a router.

/// `len` token ids drawn deterministically from `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    pub seed: u64,
    pub len: u32,
}

/// A prompt: its segments in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt(pub Vec<Segment>);

/// Token ids stay below this (inside every vocabulary the simulator stands in for).
const VOCAB: u64 = 100_000;

impl Prompt {
    pub fn len(&self) -> usize {
        self.0.iter().map(|s| s.len as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The prompt followed by `seg`.
    pub fn with(&self, seg: Segment) -> Prompt {
        let mut p = self.0.clone();
        p.push(seg);
        Prompt(p)
    }

    /// Every token id, in order.
    pub fn tokens(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        for s in &self.0 {
            out.extend((0..u64::from(s.len)).map(|i| (splitmix64(s.seed ^ splitmix64(i)) % VOCAB) as u32 + 1));
        }
        out
    }
}

/// SplitMix64's finaliser: a fixed, well-mixed function of `x`.
pub fn splitmix64(x: u64) -> u64 {
    kvroute_shared::hash::finalize(x.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// A small seeded generator (SplitMix64): the lab's only source of randomness,
/// so results never depend on a crate's version of its algorithms.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(splitmix64(seed ^ 0x6c61_625f_7365_6564))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        splitmix64(self.0)
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Exponentially distributed with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.f64()).ln()
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }
}

/// Zipf(s) over `0..n`: rank 0 is the most popular.
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n.max(1))
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_segments_give_shared_token_prefixes() {
        let sys = Segment { seed: 7, len: 40 };
        let a = Prompt(vec![sys, Segment { seed: 1, len: 10 }]).tokens();
        let b = Prompt(vec![sys, Segment { seed: 2, len: 10 }]).tokens();
        assert_eq!(a[..40], b[..40]);
        assert_ne!(a[40..], b[40..]);
        assert_eq!(a, Prompt(vec![sys, Segment { seed: 1, len: 10 }]).tokens());
    }

    #[test]
    fn zipf_prefers_low_ranks() {
        let z = Zipf::new(100, 1.0);
        let mut rng = Rng::new(1);
        let draws: Vec<usize> = (0..10_000).map(|_| z.sample(&mut rng)).collect();
        let top = draws.iter().filter(|&&d| d == 0).count();
        let tail = draws.iter().filter(|&&d| d == 99).count();
        assert!(top > 10 * tail.max(1), "{top} vs {tail}");
        assert!(draws.iter().all(|&d| d < 100));
    }
}
