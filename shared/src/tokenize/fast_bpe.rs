//! An exact fast path for encoding text no cache has seen (issue 16).
//!
//! HF `tokenizers` spends most of a cold encode outside BPE itself: the
//! pre-tokenizer regex (Oniguruma), normalization, and allocating a
//! `NormalizedString` with alignments per piece and an `Encoding` with
//! offsets. For ASCII text and the two byte-level BPE pre-tokenizers the
//! router meets (GPT-2's `ByteLevel` regex, and the `Split` regex of Qwen,
//! Llama 3 and cl100k), the split is a few lines of byte matching, NFC is the
//! identity, and a piece seen before needs no BPE at all: this module splits
//! with a hand-written matcher equivalent to the regex on ASCII, looks each
//! piece up in a word cache, and runs BPE only on misses: its own merge
//! loop ([`Merges`]) for byte-level models without HF's options, the
//! tokenizer's own `Model::tokenize` (exactly what HF calls per piece) for
//! anything else or any piece longer than [`Merges::MAX_SYMBOLS`].
//!
//! Anything else — a non-ASCII text, another normalizer, pre-tokenizer or
//! model — returns `None` and the caller encodes with HF. Exactness is
//! checked when the tokenizer loads, on probes covering every ASCII byte in
//! every position class ([`FastBpe::new`] refuses on any difference), and by
//! the completion cache's property tests against whole-text HF encoding.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use tokenizers::models::ModelWrapper;
use tokenizers::{Model, Tokenizer};

/// The `Split` regex of Qwen 2/3 (and, with `\p{N}{1,3}`, Llama 3: not this one).
const QWEN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Word-cache entries kept before the cache is cleared (a few MB).
const WORD_CAPACITY: usize = 200_000;

/// Longest piece the word cache keeps, bytes. Words are short; a piece
/// longer than this (a run of letters or digits with nothing to split it,
/// as a client can send megabytes of) is encoded each time: cached, each
/// such request kept its whole text, and `WORD_CAPACITY` entries of it
/// were gigabytes.
const MAX_CACHED_PIECE: usize = 64;

/// ASCII piece → its token ids.
type Words = HashMap<Box<[u8]>, Box<[u32]>, BuildHasherDefault<Fx>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// GPT-2's `ByteLevel` pre-tokenizer (`use_regex: true`), whose regex is
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// `Split` on [`QWEN`], isolated, then `ByteLevel` without its regex.
    Qwen,
}

pub struct FastBpe {
    split: Split,
    /// GPT-2's `bytes_to_unicode`: the character each byte becomes.
    byte_char: [char; 256],
    /// The model's merges, when this module can apply them itself.
    merges: Option<Merges>,
    words: Mutex<Words>,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe").field("split", &self.split).finish()
    }
}

/// A small multiplicative hasher for short keys (SipHash showed in the
/// profile). The word cache's keys are the client's text, and a client who
/// knew the hash could send a request of words that all land in one bucket:
/// every insert a scan, the cache's lock held while the request's
/// quadratic work runs. So the state starts from a seed drawn once per
/// process and the result is mixed by SplitMix64's finalizer (every output
/// bit depends on every input bit): without the seed, collisions cannot be
/// aimed at.
struct Fx(u64);

impl Default for Fx {
    fn default() -> Self {
        Fx(crate::hash::process_seed())
    }
}

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    /// hashbrown takes its bucket from the low bits, and the product's low
    /// bits depend only on the input's low bits: unmixed, words sharing
    /// their first letters, and merges sharing their right token, landed in
    /// one probe sequence (a third of the cold-word time went to comparing
    /// keys there). SplitMix64's finalizer spreads every bit over all.
    fn finish(&self) -> u64 {
        crate::hash::finalize(self.0)
    }
}

impl Fx {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl FastBpe {
    /// The fast path for `tokenizer`, or `None` when its normalizer,
    /// pre-tokenizer or model is not one this module reproduces exactly.
    pub fn new(tokenizer: &Tokenizer) -> Option<Self> {
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else { return None };
        if bpe.dropout.is_some() {
            return None;
        }
        let normalizer = tokenizer.get_normalizer().map(serde_json::to_value).transpose().ok()?;
        match &normalizer {
            None => {}
            // NFC leaves ASCII unchanged.
            Some(n) if n.get("type").and_then(|t| t.as_str()) == Some("NFC") => {}
            Some(_) => return None,
        }
        let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
        let split = split_kind(&pre)?;
        let byte_char = bytes_to_unicode();
        let merges = Merges::new(bpe, &byte_char);
        let fast = FastBpe { split, byte_char, merges, words: Mutex::default() };
        fast.agrees_with(tokenizer).then_some(fast)
    }

    /// `tokenizer.encode(text, false)` appended to `out`, or `None` (nothing
    /// appended) when `text` is not ASCII.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Option<Result<(), tokenizers::Error>> {
        if !text.is_ascii() {
            return None;
        }
        let bytes = text.as_bytes();
        let mut pieces = Vec::with_capacity(bytes.len() / 4 + 1);
        let mut at = 0;
        while at < bytes.len() {
            let end = match self.split {
                Split::Gpt2 => gpt2_piece(bytes, at),
                Split::Qwen => qwen_piece(bytes, at),
            };
            pieces.push((at, end));
            at = end;
        }
        // Hits are copied under one short lock; misses are encoded outside
        // it (the tokenize pool runs one encode per core) and inserted after.
        let mut misses: Vec<(usize, usize)> = Vec::new();
        let start = out.len();
        {
            let words = self.words.lock().unwrap_or_else(|p| p.into_inner());
            for (k, &(s, e)) in pieces.iter().enumerate() {
                match words.get(&bytes[s..e]) {
                    Some(ids) => out.extend_from_slice(ids),
                    None => misses.push((k, out.len())),
                }
            }
        }
        if misses.is_empty() {
            return Some(Ok(()));
        }
        let mut encoded: Vec<Box<[u32]>> = Vec::with_capacity(misses.len());
        let mut mapped = String::new();
        let mut scratch = Scratch::default();
        for &(k, _) in &misses {
            let (s, e) = pieces[k];
            if let Some(merges) = &self.merges
                && let Some(ids) = merges.encode(&bytes[s..e], &mut scratch)
            {
                encoded.push(ids.into());
                continue;
            }
            mapped.clear();
            mapped.extend(bytes[s..e].iter().map(|&b| self.byte_char[usize::from(b)]));
            match tokenizer.get_model().tokenize(&mapped) {
                Ok(tokens) => encoded.push(tokens.iter().map(|t| t.id).collect()),
                Err(e) => {
                    out.truncate(start);
                    return Some(Err(e));
                }
            }
        }
        // Splice the misses' ids in at their positions.
        let hits = out.split_off(start);
        let mut from = 0;
        for (&(_, pos), ids) in misses.iter().zip(&encoded) {
            out.extend_from_slice(&hits[from..pos - start]);
            out.extend_from_slice(ids);
            from = pos - start;
        }
        out.extend_from_slice(&hits[from..]);
        let mut words = self.words.lock().unwrap_or_else(|p| p.into_inner());
        if words.len() + misses.len() > WORD_CAPACITY {
            words.clear();
        }
        for (&(k, _), ids) in misses.iter().zip(encoded) {
            let (s, e) = pieces[k];
            if e - s <= MAX_CACHED_PIECE {
                words.insert(bytes[s..e].into(), ids);
            }
        }
        Some(Ok(()))
    }

    /// True when this path encodes every probe exactly as HF does.
    fn agrees_with(&self, tokenizer: &Tokenizer) -> bool {
        probes().iter().all(|p| {
            let Ok(whole) = tokenizer.encode_fast(p.as_str(), false) else { return false };
            let mut ours = Vec::new();
            matches!(self.encode(tokenizer, p, &mut ours), Some(Ok(()))) && ours == whole.get_ids()
        })
    }
}

/// A byte-level BPE model's merges, applied as HF's `Word::merge_all`
/// applies them: each byte starts as its own token, and while any adjacent
/// pair has a merge, the pair of lowest rank (the leftmost of equals)
/// becomes the merged token. HF's per-piece path allocates a `Token` with
/// its text and offsets for every id and keeps a heap; the router meets
/// cold words on every new document (half its tokenizing time in the bench's
/// chat profile), and a piece is a few bytes, so a scan over a small array
/// does it with no allocation but the result.
struct Merges {
    /// Each byte's token (its `bytes_to_unicode` character's id).
    byte_id: [u32; 256],
    /// (left << 32 | right) → (rank, merged id).
    pairs: HashMap<u64, (u32, u32), BuildHasherDefault<Fx>>,
}

/// Reused buffers for [`Merges::encode`].
#[derive(Default)]
struct Scratch {
    ids: Vec<u32>,
    ranks: Vec<u32>,
}

impl Merges {
    /// Pieces longer than this (a long run of spaces or punctuation) go to
    /// HF's heap: the scan is quadratic in the piece's length.
    const MAX_SYMBOLS: usize = 64;

    /// The merges of `bpe`, or `None` when it has an option this loop does
    /// not reproduce (dropout, unknown-token handling, byte fallback,
    /// subword prefixes or suffixes, `ignore_merges`) or a byte without a
    /// token.
    fn new(bpe: &tokenizers::models::bpe::BPE, byte_char: &[char; 256]) -> Option<Self> {
        let empty = |o: &Option<String>| o.as_deref().is_none_or(str::is_empty);
        if bpe.dropout.is_some_and(|d| d > 0.0)
            || bpe.unk_token.is_some()
            || bpe.byte_fallback
            || bpe.ignore_merges
            || !empty(&bpe.continuing_subword_prefix)
            || !empty(&bpe.end_of_word_suffix)
        {
            return None;
        }
        let id = |token: &str| bpe.token_to_id(token);
        let mut byte_id = [0u32; 256];
        for (b, c) in byte_char.iter().enumerate() {
            byte_id[b] = id(c.encode_utf8(&mut [0; 4]))?;
        }
        // The model keeps its merges private; its serialized form lists them
        // in rank order (read back borrowed, the vocabulary skipped: a
        // `serde_json::Value` of Qwen3's model took 280 ms).
        #[derive(serde::Deserialize)]
        struct Listed<'a> {
            #[serde(borrow)]
            merges: Vec<(std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>)>,
        }
        let json = serde_json::to_vec(bpe).ok()?;
        let listed: Listed = serde_json::from_slice(&json).ok()?;
        let mut pairs = HashMap::with_capacity_and_hasher(listed.merges.len(), BuildHasherDefault::<Fx>::default());
        let mut joined = String::new();
        for (rank, (a, b)) in listed.merges.iter().enumerate() {
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let key = (u64::from(id(a)?) << 32) | u64::from(id(b)?);
            pairs.entry(key).or_insert((u32::try_from(rank).ok()?, id(&joined)?));
        }
        Some(Merges { byte_id, pairs })
    }

    fn rank(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        self.pairs.get(&((u64::from(left) << 32) | u64::from(right))).copied()
    }

    /// `piece`'s token ids, or `None` when it is longer than
    /// [`Self::MAX_SYMBOLS`].
    fn encode<'s>(&self, piece: &[u8], scratch: &'s mut Scratch) -> Option<&'s [u32]> {
        if piece.len() > Self::MAX_SYMBOLS {
            return None;
        }
        let Scratch { ids, ranks } = scratch;
        ids.clear();
        ids.extend(piece.iter().map(|&b| self.byte_id[usize::from(b)]));
        ranks.clear();
        ranks.extend(ids.windows(2).map(|w| self.rank(w[0], w[1]).map_or(u32::MAX, |(r, _)| r)));
        // The lowest rank, leftmost of equals, while any pair merges.
        while let Some((at, _)) =
            ranks.iter().enumerate().filter(|&(_, &r)| r != u32::MAX).min_by_key(|&(i, &r)| (r, i))
        {
            let (_, merged) = self.rank(ids[at], ids[at + 1])?;
            ids[at] = merged;
            ids.remove(at + 1);
            ranks.remove(at);
            if at < ranks.len() {
                ranks[at] = self.rank(ids[at], ids[at + 1]).map_or(u32::MAX, |(r, _)| r);
            }
            if at > 0 {
                ranks[at - 1] = self.rank(ids[at - 1], ids[at]).map_or(u32::MAX, |(r, _)| r);
            }
        }
        Some(ids)
    }
}

/// Which of the known pre-tokenizers `pre` (its JSON form) is.
fn split_kind(pre: &serde_json::Value) -> Option<Split> {
    let s = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    let b = |v: &serde_json::Value, k: &str| v.get(k).and_then(serde_json::Value::as_bool);
    let byte_level = |v: &serde_json::Value, regex: bool| {
        s(v, "type").as_deref() == Some("ByteLevel")
            && b(v, "add_prefix_space") == Some(false)
            && b(v, "use_regex") == Some(regex)
    };
    if byte_level(pre, true) {
        return Some(Split::Gpt2);
    }
    if s(pre, "type").as_deref() != Some("Sequence") {
        return None;
    }
    let [split, bl] = pre.get("pretokenizers")?.as_array()?.as_slice() else { return None };
    let pattern = split.get("pattern").and_then(|p| p.get("Regex")).and_then(|r| r.as_str());
    let ok = s(split, "type").as_deref() == Some("Split")
        && pattern == Some(QWEN)
        && s(split, "behavior").as_deref() == Some("Isolated")
        && b(split, "invert") == Some(false)
        && byte_level(bl, false);
    ok.then_some(Split::Qwen)
}

fn bytes_to_unicode() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[usize::from(b)] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

// ASCII classes as Oniguruma's Unicode classes see them: `\s` is White_Space
// (tab, LF, VT, FF, CR, space; not 0x1C-0x1F), `\p{L}` letters, `\p{N}` digits.
fn space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
}
fn letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}
fn digit(b: u8) -> bool {
    b.is_ascii_digit()
}
fn other(b: u8) -> bool {
    !space(b) && !letter(b) && !digit(b)
}

/// End of the run of bytes from `i` for which `class` holds.
fn run(t: &[u8], mut i: usize, class: fn(u8) -> bool) -> usize {
    while i < t.len() && class(t[i]) {
        i += 1;
    }
    i
}

/// `'s|'t|'re|'ve|'m|'ll|'d` at `i` (case-insensitively when `fold`).
fn contraction(t: &[u8], i: usize, fold: bool) -> Option<usize> {
    if t[i] != b'\'' {
        return None;
    }
    let lower = |k: usize| t.get(k).map(|&b| if fold { b.to_ascii_lowercase() } else { b });
    match lower(i + 1)? {
        b's' | b't' | b'm' | b'd' => Some(i + 2),
        b'r' if lower(i + 2) == Some(b'e') => Some(i + 3),
        b'v' if lower(i + 2) == Some(b'e') => Some(i + 3),
        b'l' if lower(i + 2) == Some(b'l') => Some(i + 3),
        _ => None,
    }
}

/// `\s+(?!\S)|\s+` at `i` (a space byte): the whole run at the end of the
/// text, else the run but its last space, which goes with what follows.
fn trailing_space(t: &[u8], i: usize) -> usize {
    let j = run(t, i, space);
    if j == t.len() || j - i < 2 { j } else { j - 1 }
}

/// The end of the GPT-2 regex's match at `i`.
fn gpt2_piece(t: &[u8], i: usize) -> usize {
    if let Some(e) = contraction(t, i, false) {
        return e;
    }
    let c = t[i];
    let (lead, k) = if c == b' ' && i + 1 < t.len() && !space(t[i + 1]) { (true, i + 1) } else { (false, i) };
    let d = t[k];
    if lead || !space(c) {
        let class: fn(u8) -> bool = if letter(d) {
            letter
        } else if digit(d) {
            digit
        } else {
            other
        };
        return run(t, k, class);
    }
    trailing_space(t, i)
}

/// The end of the Qwen regex's match at `i`.
fn qwen_piece(t: &[u8], i: usize) -> usize {
    if let Some(e) = contraction(t, i, true) {
        return e;
    }
    let c = t[i];
    let next = t.get(i + 1).copied();
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if letter(c) {
        return run(t, i, letter);
    }
    if c != b'\r' && c != b'\n' && !digit(c) && next.is_some_and(letter) {
        return run(t, i + 1, letter);
    }
    // \p{N}
    if digit(c) {
        return i + 1;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let k = if c == b' ' && next.is_some_and(other) { i + 1 } else { i };
    if other(t[k]) {
        let e = run(t, k, other);
        return run(t, e, |b| b == b'\r' || b == b'\n');
    }
    // `\s*[\r\n]+`: through the run's last line break.
    let j = run(t, i, space);
    if let Some(p) = t[i..j].iter().rposition(|&b| b == b'\r' || b == b'\n') {
        return i + p + 1;
    }
    trailing_space(t, i)
}

/// Texts on which the fast path must equal HF's encoding: every ASCII byte
/// alone, after and before each class, in runs, and real prose and code.
fn probes() -> Vec<String> {
    let mut out: Vec<String> = [
        "Hello world, it's a test. Don't stop; we'll see! They've 2 cats and I'm here, you'd know.",
        "IT'S LOUD. WE'LL GO. 'S 'T 'RE 'VE 'M 'LL 'D 'x 'see 's",
        "fn main() {\n    let x = 1;\r\n\tprintln!(\"{x}\");\n}\n\n\n  \n",
        "numbers 12345 and 3.14159, 1,000,000 and -42 +7 0x1F 1e9 v1.2.3",
        "   leading spaces and trailing spaces   ",
        "tabs\t\tand\t spaces \t mixed\x0b\x0cvt ff\r\rcr\n\r\nend \n",
        "punct... !!! ??? ?! (a) [b] {c} <d> \"e\" 'f' `g` ~h ^i |j \\k /l @m #n $o %p &q *r _s -t =u +v",
        "a.b,c;d:e!f?g'h\"i(j)k[l]m{n}o<p>q",
        "..a ..1 .. a '' 's's 'll'll x'y x's",
        " \n \n\n  \r\n  x\n\ny \t\n\t z",
        "emails a@b.com and urls https://example.com/path?q=1&r=2#frag",
        "\x00\x01\x02\x1b[0m\x1c\x1d\x1e\x1f\x7f control",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let classes = ["a", "Z", "7", " ", "  ", "\n", "\r\n", "\t", ".", "'", "'s", "!!", "\x0b"];
    for b in 0u8..128 {
        let c = char::from(b);
        out.push(format!("{c}"));
        for k in classes {
            out.push(format!("{k}{c}{k}"));
            out.push(format!("{c}{k}{c}{c}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_made_to_share_a_bucket_spread_over_buckets() {
        use std::hash::BuildHasher;
        // 4,096 eight-letter words that differ only in their last two
        // letters: unseeded and unmixed, the bucket bits of the product came
        // from the first six letters alone, so all shared one bucket.
        let fx = BuildHasherDefault::<Fx>::default();
        let buckets: std::collections::HashSet<u64> = (0..4_096u32)
            .map(|i| {
                let word = [b'a', b'b', b'c', b'd', b'e', b'f', b'a' + (i / 64) as u8, b'a' + (i % 64) as u8];
                fx.hash_one(&word[..]) & 1_023
            })
            .collect();
        assert!(buckets.len() > 900, "{} of 1,024 buckets", buckets.len());
    }

    #[test]
    fn gpt2_pieces_follow_the_regex() {
        let t = b"Hello  world's 123!! \n\n x";
        let mut at = 0;
        let mut pieces = Vec::new();
        while at < t.len() {
            let e = gpt2_piece(t, at);
            pieces.push(std::str::from_utf8(&t[at..e]).unwrap());
            at = e;
        }
        assert_eq!(pieces, ["Hello", " ", " world", "'s", " 123", "!!", " \n\n", " x"]);
    }

    #[test]
    fn qwen_pieces_follow_the_regex() {
        let t = b"Hello  world'S 123.x !! \n\n x";
        let mut at = 0;
        let mut pieces = Vec::new();
        while at < t.len() {
            let e = qwen_piece(t, at);
            pieces.push(std::str::from_utf8(&t[at..e]).unwrap());
            at = e;
        }
        assert_eq!(pieces, ["Hello", " ", " world", "'S", " ", "1", "2", "3", ".x", " !!", " \n\n", " x"]);
    }

    /// Every token of GPT-2's and Qwen3's vocabularies, and random byte
    /// strings up to [`Merges::MAX_SYMBOLS`] long, merge to HF's ids.
    #[test]
    fn merges_equal_hfs_bpe_on_every_vocabulary_token_and_random_bytes() {
        use tokenizers::Model;
        let byte_char = bytes_to_unicode();
        let byte_of: HashMap<char, u8> = (0..=255u8).map(|b| (byte_char[usize::from(b)], b)).collect();
        for name in ["gpt2", "qwen3"] {
            let dir = crate::testdata::tokenizer_dir(name).unwrap_or_else(|why| panic!("no {name} tokenizer: {why}"));
            let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
            let ModelWrapper::BPE(bpe) = tok.get_model() else { panic!("{name}: not BPE") };
            let merges = Merges::new(bpe, &byte_char).unwrap_or_else(|| panic!("{name}: merges refused"));
            let mut scratch = Scratch::default();
            let mut check = |bytes: &[u8]| {
                let mapped: String = bytes.iter().map(|&b| byte_char[usize::from(b)]).collect();
                let hf: Vec<u32> = bpe.tokenize(&mapped).unwrap().iter().map(|t| t.id).collect();
                assert_eq!(merges.encode(bytes, &mut scratch).unwrap(), hf.as_slice(), "{name}: {bytes:?}");
            };
            let mut tokens = 0;
            for piece in bpe.get_vocab().keys() {
                let bytes: Option<Vec<u8>> = piece.chars().map(|c| byte_of.get(&c).copied()).collect();
                if let Some(bytes) = bytes.filter(|b| b.len() <= Merges::MAX_SYMBOLS) {
                    check(&bytes);
                    tokens += 1;
                }
            }
            assert!(tokens > 40_000, "{name}: only {tokens} tokens checked");
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for _ in 0..20_000 {
                let len = 1 + (next() % Merges::MAX_SYMBOLS as u64) as usize;
                // Mostly letters and spaces (long merges), some of any byte.
                let bytes: Vec<u8> = (0..len)
                    .map(|_| match next() % 8 {
                        0 => (next() % 256) as u8,
                        1 => b' ',
                        _ => b'a' + (next() % 26) as u8,
                    })
                    .collect();
                check(&bytes);
            }
            assert!(merges.encode(&[b' '; Merges::MAX_SYMBOLS + 1], &mut scratch).is_none());
        }
    }

    /// A long run of letters is one piece: it is encoded as HF does, and
    /// the word cache keeps none of it (kept, a client's megabytes of
    /// letters, one new run per request, filled the router's memory).
    #[test]
    fn a_long_piece_is_encoded_but_not_cached() {
        let dir = crate::testdata::tokenizer_dir("gpt2").unwrap_or_else(|why| panic!("no gpt2 tokenizer: {why}"));
        let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let fast = FastBpe::new(&tok).expect("GPT-2 takes the fast path");
        let long: String = (0..10_000u32).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
        let text = format!("hello {long} world");
        let mut ids = Vec::new();
        fast.encode(&tok, &text, &mut ids).unwrap().unwrap();
        assert_eq!(ids, tok.encode_fast(text.as_str(), false).unwrap().get_ids());
        let words = fast.words.lock().unwrap();
        assert!(words.contains_key(&b"hello"[..]) && words.contains_key(&b" world"[..]));
        let longest = words.keys().map(|k| k.len()).max().unwrap();
        assert!(longest <= MAX_CACHED_PIECE, "a {longest}-byte piece was cached");
    }

    #[test]
    fn bytes_map_as_gpt2() {
        let m = bytes_to_unicode();
        assert_eq!(m[usize::from(b' ')], 'Ġ');
        assert_eq!(m[usize::from(b'\n')], 'Ċ');
        assert_eq!(m[usize::from(b'a')], 'a');
        assert_eq!(m[0x7f], '\u{121}');
    }
}
