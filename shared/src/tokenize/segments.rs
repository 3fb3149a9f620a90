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
//! `single_word`; and when the tokenizer neither truncates nor pads.
//! [`SegmentCache::new`] returns `None` otherwise and callers encode whole.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

/// Token ids kept, over both generations (~4 bytes each plus the text).
const CAPACITY_TOKENS: usize = 2_000_000;

pub struct SegmentCache {
    /// Added tokens, matched as HF matches non-normalized ones.
    splitter: AhoCorasick,
    ids: Vec<u32>,
    cache: Mutex<Generations>,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache").field("added_tokens", &self.ids.len()).finish()
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
        let splitter =
            AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(pairs.iter().map(|(_, c)| c)).ok()?;
        Some(SegmentCache { splitter, ids: pairs.into_iter().map(|(id, _)| id).collect(), cache: Mutex::default() })
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

    fn gap(
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
                let ids: Arc<[u32]> = tokenizer.encode_fast(segment, false)?.get_ids().into();
                self.cache.lock().unwrap_or_else(|p| p.into_inner()).insert(segment.into(), ids.clone());
                ids
            }
        };
        out.extend_from_slice(&ids);
        Ok(())
    }
}
