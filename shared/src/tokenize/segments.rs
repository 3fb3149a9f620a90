//! A cache of token ids per text segment between special tokens.
//!
//! Chat prompts repeat: the system prompt, the tools, every earlier turn of a
//! conversation come back with each request. HF tokenizers first split the
//! text on added tokens (leftmost-longest, on the raw text), then normalize,
//! pre-tokenize and BPE each gap on its own — so the ids of a gap do not
//! depend on its neighbours, and a gap seen before need not be encoded again.
//!
//! That independence holds only when every added token matches on the raw
//! text with no side effects: not `normalized`, no `lstrip`/`rstrip`/
//! `single_word`; when the tokenizer neither truncates nor pads; and when no
//! step depends on where a gap sits in the text (SentencePiece's Metaspace
//! with `prepend_scheme: "first"`, Llama 2 and Mistral, prepends `▁` at the
//! text's start only: checked on probes). [`SegmentCache::new`] returns
//! `None` otherwise and callers encode whole, at more CPU per request.
//!
//! Completions have no special tokens to split on, so a long gap is also cut
//! into chunks of at least [`CHUNK_BYTES`] at line starts (after a single
//! newline between non-space characters) and word starts (between an ASCII
//! letter, `.`, `!` or `?` and a space followed by an ASCII letter): the
//! byte-level BPE pre-tokenizers of GPT-2, Llama 3 and Qwen never join across
//! such a point, so a shared document or system prompt is encoded once and
//! each request pays only for what is new. (Sentence starts alone left a
//! 2k-token run of words with no full stop one chunk, encoded whole for every
//! request: the bench's RAG prompts, 14 % of the router's CPU.)
//! Chunks are cut greedily from the start of the gap, so two texts that share
//! a prefix share its chunks. Whether a tokenizer really never joins there is
//! checked when the cache is built, on a corpus of awkward cases (for
//! SentencePiece-style tokenizers that prepend `▁` it fails, and gaps are
//! encoded whole).
//!
//! `add_special_tokens = true` (the completions default) wraps the ids in what
//! the post-processor adds (a BOS for Llama, nothing for GPT-2 or Qwen); that
//! wrapping is measured on probes at build time and applied around the cached
//! ids, or such requests are encoded whole when the probes disagree.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

use super::fast_bpe::FastBpe;

/// Token ids kept, over both generations (~4 bytes each plus the text).
const CAPACITY_TOKENS: usize = 2_000_000;

/// Smallest chunk a gap is cut into at line starts.
pub const CHUNK_BYTES: usize = 512;

pub struct SegmentCache {
    /// Added tokens, matched as HF matches non-normalized ones.
    splitter: AhoCorasick,
    ids: Vec<u32>,
    cache: Mutex<Generations>,
    /// Gaps are cut at line starts (checked exact for this tokenizer).
    line_chunks: bool,
    /// What `add_special_tokens = true` puts before and after the ids.
    special: Option<(Vec<u32>, Vec<u32>)>,
    /// Encodes a cache miss without HF's pipeline when that is exact.
    fast: Option<FastBpe>,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache").field("added_tokens", &self.ids.len()).field("fast", &self.fast).finish()
    }
}

/// A two-generation cache: O(1) lookups and an LRU-ish bound without
/// per-entry bookkeeping. When `current` is full it becomes `previous` and
/// the old `previous` is dropped; hits in `previous` are promoted.
#[derive(Default)]
struct Generations {
    current: HashMap<Box<str>, Arc<[u32]>>,
    previous: HashMap<Box<str>, Arc<[u32]>>,
    current_tokens: usize,
}

impl Generations {
    fn get(&mut self, segment: &str) -> Option<Arc<[u32]>> {
        if let Some(ids) = self.current.get(segment) {
            return Some(ids.clone());
        }
        let (k, ids) = self.previous.remove_entry(segment)?;
        self.insert(k, ids.clone());
        Some(ids)
    }

    fn insert(&mut self, segment: Box<str>, ids: Arc<[u32]>) {
        if self.current_tokens + ids.len() > CAPACITY_TOKENS / 2 {
            self.previous = std::mem::take(&mut self.current);
            self.current_tokens = 0;
        }
        self.current_tokens += ids.len();
        self.current.insert(segment, ids);
    }
}

impl SegmentCache {
    /// A cache for `tokenizer`, or `None` when its added tokens or settings
    /// make segment-wise encoding differ from whole-text encoding.
    pub fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return None;
        }
        let added = tokenizer.get_added_tokens_decoder();
        if added.is_empty() || added.values().any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word) {
            return None;
        }
        let mut pairs: Vec<(u32, String)> = added.into_iter().map(|(id, t)| (id, t.content)).collect();
        pairs.sort();
        if !gaps_are_independent(tokenizer, &pairs[0]) {
            return None;
        }
        let splitter =
            AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(pairs.iter().map(|(_, c)| c)).ok()?;
        let mut cache = SegmentCache {
            splitter,
            ids: pairs.into_iter().map(|(id, _)| id).collect(),
            cache: Mutex::default(),
            line_chunks: false,
            special: special_wrapping(tokenizer),
            fast: FastBpe::new(tokenizer),
        };
        cache.line_chunks = line_chunks_are_exact(tokenizer);
        Some(cache)
    }

    /// True when cold ASCII text skips HF's pipeline ([`FastBpe`]).
    pub fn fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// True when long gaps are cut at line starts (see the module doc).
    pub fn chunks_lines(&self) -> bool {
        self.line_chunks
    }

    /// `tokenizer.encode(text, add_special_tokens = true)` from the cache, or
    /// `None` when this tokenizer's special-token wrapping is not known.
    pub fn encode_with_special(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
    ) -> Option<Result<Vec<u32>, tokenizers::Error>> {
        let (before, after) = self.special.as_ref()?;
        Some(self.encode(tokenizer, text).map(|ids| [before.as_slice(), &ids, after.as_slice()].concat()))
    }

    /// `tokenizer.encode(text, add_special_tokens = false)`, segment by segment.
    pub fn encode(&self, tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, tokenizers::Error> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for m in self.splitter.find_iter(text) {
            if m.start() > at {
                self.gap(tokenizer, &text[at..m.start()], &mut out)?;
            }
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        if at < text.len() {
            self.gap(tokenizer, &text[at..], &mut out)?;
        }
        Ok(out)
    }

    fn gap(&self, tokenizer: &tokenizers::Tokenizer, gap: &str, out: &mut Vec<u32>) -> Result<(), tokenizers::Error> {
        if !self.line_chunks || gap.len() < 2 * CHUNK_BYTES {
            return self.chunk(tokenizer, gap, out);
        }
        line_chunks(gap, CHUNK_BYTES).try_for_each(|c| self.chunk(tokenizer, c, out))
    }

    fn chunk(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        segment: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        // A poisoned lock only means another thread panicked mid-insert; the
        // maps are still valid, so keep using them.
        let hit = self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(segment);
        let ids = match hit {
            Some(ids) => ids,
            None => {
                let mut fast = Vec::new();
                let ids: Arc<[u32]> = match self.fast.as_ref().and_then(|f| f.encode(tokenizer, segment, &mut fast)) {
                    Some(done) => done.map(|()| fast.into())?,
                    None => tokenizer.encode_fast(segment, false)?.get_ids().into(),
                };
                self.cache.lock().unwrap_or_else(|p| p.into_inner()).insert(segment.into(), ids.clone());
                ids
            }
        };
        out.extend_from_slice(&ids);
        Ok(())
    }
}

/// `text` cut at line starts (just after a single `\n` between non-space
/// characters) and word starts (before the space of `w X`, `. X`, `! X`,
/// `? X`, w and X ASCII letters) into pieces of at least `min` bytes (the
/// last may be shorter). Greedy from the start: the cuts inside a prefix do
/// not depend on what follows it.
pub fn line_chunks(text: &str, min: usize) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        let mut i = start + min.max(1);
        while i < text.len() {
            // `\n` and ` ` are one byte each, so `i` is a char boundary.
            // One newline between non-space characters: GPT-2's regex splits a
            // run of several (`\n\n`) differently at the end of a string.
            let line_start = bytes[i - 1] == b'\n'
                && text[..i - 1].chars().next_back().is_some_and(|c| !c.is_whitespace())
                && text[i..].chars().next().is_some_and(|c| !c.is_whitespace());
            // A word start: the space before a word that follows a word or
            // a sentence's end (`abc def`, `abc. Def`), ASCII letters only.
            let word_start = bytes[i] == b' '
                && (bytes[i - 1].is_ascii_alphabetic() || matches!(bytes[i - 1], b'.' | b'!' | b'?'))
                && bytes.get(i + 1).is_some_and(u8::is_ascii_alphabetic);
            if line_start || word_start {
                break;
            }
            i += 1;
        }
        let end = i.min(text.len());
        // `start + min` may fall inside a character; the loop only stops on a
        // boundary or at the end, and the end is always one.
        let piece = &text[start..end];
        start = end;
        Some(piece)
    })
}

/// Awkward cases for cutting at line starts: every one must encode the same
/// cut at every line start as whole.
const CHUNK_PROBES: &[&str] = &[
    "The first line.\nThe second line, with a comma.\nAnd a third!\n",
    "fn main() {\n    let x = 1;\n}\nfn next() {}\n",
    "trailing spaces  \nnext\ttab\n\n\nthree newlines\r\nCRLF line\r\nend",
    "numbers\n12345 and 3.14\n42\n'quoted' and it's\n's contraction\n",
    "unicode: naïve café\n東京タワー\n🚀 rocket\n\u{301}combining\nÅngström\n",
    "punctuation...\n(parenthesis)\n[brackets]\n-dash\n—em dash\n#hash\n@at\n",
    "mixed  \n  indented\nx\ny\nz\n<|not special|>\n</tag>\n",
    "One. Two! Three? four. e.g. this. 3. Item. (paren). 'quote'. \"dq\". x.y z. Mr. Smith.  Two spaces.",
    "nbsp\u{a0}\nafter. ideographic\u{3000}\nafter. Tab.\t\nx",
    "para one.\n\nPara two.\n\n\nthree\n \nfour \nfive\n\tsix\nseven",
    "End.\nNext. Then... dots. What?! Both. Ünïcode. É accent. a. b. c. I. A.",
];

/// Does a gap encode alone as it does between added tokens? Not for a
/// SentencePiece-style tokenizer that prepends `▁` at the start of the text
/// only (Metaspace's `prepend_scheme: "first"`, Llama 2, Mistral): alone,
/// every gap after a special token got a `▁` the whole text does not have,
/// and no key from the first special token on matched the engine's.
fn gaps_are_independent(tokenizer: &tokenizers::Tokenizer, (id, content): &(u32, String)) -> bool {
    let encode = |t: &str| tokenizer.encode_fast(t, false).map(|e| e.get_ids().to_vec()).ok();
    ["Hello world", " Hello", "\nHello"].iter().all(|gap| {
        let whole = encode(&format!("{gap}{content}{gap}"));
        let parts = encode(gap).map(|g| [g.as_slice(), &[*id], g.as_slice()].concat());
        whole.is_some() && whole == parts
    })
}

fn line_chunks_are_exact(tokenizer: &tokenizers::Tokenizer) -> bool {
    let encode = |t: &str| tokenizer.encode_fast(t, false).map(|e| e.get_ids().to_vec());
    CHUNK_PROBES.iter().all(|probe| {
        let Ok(whole) = encode(probe) else { return false };
        let mut cut = Vec::with_capacity(whole.len());
        for piece in line_chunks(probe, 1) {
            match encode(piece) {
                Ok(ids) => cut.extend(ids),
                Err(_) => return false,
            }
        }
        cut == whole
    })
}

/// The ids `add_special_tokens = true` adds before and after a text's own, if
/// they are the same on every probe.
fn special_wrapping(tokenizer: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in ["a", "Hello world", "x\ny z", "1 2 3"] {
        let with = tokenizer.encode_fast(probe, true).ok()?.get_ids().to_vec();
        let without = tokenizer.encode_fast(probe, false).ok()?.get_ids().to_vec();
        if without.is_empty() || with.len() < without.len() {
            return None;
        }
        let at = (0..=with.len() - without.len()).find(|&k| with[k..k + without.len()] == without[..])?;
        let wrap = (with[..at].to_vec(), with[at + without.len()..].to_vec());
        match &found {
            Some(f) if *f != wrap => return None,
            _ => found = Some(wrap),
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-style tokenizer (Metaspace, `▁` prepended at the start
    /// of the text only) with one added token, `<s>`.
    fn metaspace_first() -> tokenizers::Tokenizer {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                              "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"<unk>": 0, "<s>": 1, "▁": 2, "H": 3, "e": 4, "l": 5, "o": 6, "w": 7, "r": 8, "d": 9},
                      "merges": []}
        });
        json.to_string().parse().expect("a valid tokenizer")
    }

    #[test]
    fn a_tokenizer_whose_gaps_depend_on_their_place_is_encoded_whole() {
        let t = metaspace_first();
        let text = "<s>Hello<s> world";
        let whole = t.encode_fast(text, false).unwrap().get_ids().to_vec();
        // Alone, the gap after `<s>` would get the `▁` only the text's start gets.
        let alone = t.encode_fast("Hello", false).unwrap().get_ids().to_vec();
        assert_ne!(whole[1..6], alone[..], "the fixture shows the dependence");
        assert!(SegmentCache::new(&t).is_none(), "encoded whole");
    }
}
