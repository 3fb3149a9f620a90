//! Text prompts with a known token count: a workload's token ids written as
//! words that are each one token of an HF tokenizer's vocabulary (byte-level
//! BPE: `Ġword`, a space then lowercase letters), so the router and the
//! engines tokenize real text (the work issue 16 measures) while prefixes,
//! lengths and the cache ceiling stay those of the token-id workload.

use std::path::Path;

use crate::error::BenchError;

/// The vocabulary's whole-word tokens, in id order.
#[derive(Debug, Clone)]
pub struct Words(Vec<String>);

impl Words {
    /// Reads `DIR/tokenizer.json` and keeps the tokens that are a space and
    /// 3 to 10 lowercase ASCII letters (tens of thousands in GPT-2's or
    /// Qwen3's vocabulary).
    pub fn load(dir: &Path) -> Result<Words, BenchError> {
        let path = dir.join("tokenizer.json");
        let bad = |why: String| BenchError::Usage(format!("{}: {why}", path.display()));
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let vocab = json["model"]["vocab"].as_object().ok_or_else(|| bad("no model.vocab map".into()))?;
        let mut words: Vec<(u64, String)> = vocab
            .iter()
            .filter_map(|(tok, id)| {
                let word = tok.strip_prefix('Ġ')?;
                let ok = (3..=10).contains(&word.len()) && word.bytes().all(|b| b.is_ascii_lowercase());
                Some((id.as_u64()?, format!(" {word}"))).filter(|_| ok)
            })
            .collect();
        if words.len() < 1000 {
            return Err(bad(format!("only {} whole-word tokens: not a byte-level BPE vocabulary", words.len())));
        }
        words.sort();
        Ok(Words(words.into_iter().map(|(_, w)| w).collect()))
    }

    /// The prompt: one word per token id (ids map onto the word list).
    pub fn text(&self, tokens: &[u32]) -> String {
        let mut out = String::with_capacity(tokens.len() * 8);
        for &t in tokens {
            out.push_str(&self.0[t as usize % self.0.len()]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use kvroute_shared::tokenize::PromptTokenizer;

    use super::*;

    /// Each word is one token of the tokenizer it came from, so a prompt of n
    /// ids is n tokens, and equal id prefixes are equal token prefixes.
    #[test]
    fn every_word_is_one_token_and_prefixes_survive() {
        let dir = kvroute_shared::testdata::tokenizer_dir("gpt2").unwrap_or_else(|e| panic!("{e}"));
        let words = Words::load(&dir).unwrap();
        let tok = PromptTokenizer::load(&dir).unwrap();
        let ids: Vec<u32> = (0..3000u32).map(|i| i.wrapping_mul(2_654_435_761) >> 7).collect();
        let a = tok.encode(&words.text(&ids), false).unwrap();
        assert_eq!(a.len(), ids.len());
        let mut other = ids[..2000].to_vec();
        other.extend([1, 2, 3]);
        let b = tok.encode(&words.text(&other), false).unwrap();
        assert_eq!(a[..2000], b[..2000]);
    }
}
