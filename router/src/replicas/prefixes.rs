//! Which prefixes the other replicas have just sent where.
//!
//! Knowing how much prefill another replica has pending on a worker is not
//! enough: when that prefill is a new document, the next question about it
//! should follow it there, yet the replica that did not send it sees only a
//! busy worker holding nothing of the prompt, and sends the question to an
//! idle one, which then prefills a second copy. (In the lab, with the
//! pending figures alone, RAG's p50 was 1.65 × worse with 3 replicas.) The
//! sidecars tell every replica once the blocks are stored, but only after
//! the prefill is done. So each report also names, for every request the
//! replica sent in the last moments, its worker and a sample of the
//! prompt's block keys; the receiving replica counts a worker as holding
//! (speculatively) the deepest sampled block of a request's prompt that it
//! finds there.
//!
//! A block key names its whole prefix (DESIGN.md §1), so one matching key
//! says every block before it matches too. The sample is the keys at fixed
//! block indices, the same for every prompt: every block up to the 8th, then
//! indices growing by a quarter, and the prompt's last full block. A match
//! found this way is at least four fifths of the true shared depth, and a
//! prompt costs about 30 keys (a 9k-token document) to 45 (a 262k-token
//! prompt).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use kvroute_shared::{BlockKey, WorkerId};
use serde::{Deserialize, Serialize};

use crate::index::KeyMap;

/// Keys one sample holds at most (a prompt of 2^32 blocks needs fewer).
pub const MAX_SAMPLED_KEYS: usize = 128;

/// The block indices sampled from a prompt of `blocks` full blocks.
pub fn sampled_indices(blocks: usize) -> impl Iterator<Item = usize> {
    let mut next = Some(0usize);
    let last = blocks.checked_sub(1);
    std::iter::from_fn(move || {
        let i = next?;
        if i >= blocks {
            next = None;
            // The last block, unless the fixed indices already ended on it.
            return last.filter(|&l| l + 1 != i && !is_fixed(l));
        }
        next = Some(if i < 8 { i + 1 } else { i + i / 4 });
        Some(i)
    })
}

fn is_fixed(index: usize) -> bool {
    let mut i = 0usize;
    while i < index {
        i = if i < 8 { i + 1 } else { i + i / 4 };
    }
    i == index
}

/// The sampled keys of a prompt's block keys.
pub fn sample(keys: &[BlockKey]) -> Vec<BlockKey> {
    sampled_indices(keys.len()).map(|i| keys[i]).collect()
}

/// One request another replica sent: where, and its prompt's sampled keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentPrefix {
    pub worker: WorkerId,
    pub keys: Vec<BlockKey>,
}

/// What the other replicas' recent requests say about prefixes: sampled
/// key → the workers they were sent to (indices into `workers`, so a
/// rebuild allocates no id per key).
///
/// Rebuilt when a replica's full report arrives (about 40 times a second
/// on a busy router with 3 replicas; `Replicas::publish` spaces rebuilds),
/// so built without an allocation per key:
/// the index's seeded hash rather than SipHash (a report's keys are the
/// sender's to choose; see `index/hasher.rs`) and the first worker of a key
/// inline, any further ones in a side map (a hot prefix sent to several):
/// rebuilding from two busy peers' reports took 643 µs with SipHash and a
/// vector per key, 121 µs so (`cargo bench -p kvroute-router --bench router
/// -- replicas`).
#[derive(Debug, Default)]
pub struct PrefixHints {
    workers: Vec<WorkerId>,
    first: KeyMap<u32>,
    more: KeyMap<Vec<u32>>,
}

impl PrefixHints {
    /// The hints `sent` gives, from its first requests holding at most
    /// `max_keys` sampled keys between them (the rest are left out).
    pub fn build<'a>(sent: impl IntoIterator<Item = &'a SentPrefix>, max_keys: usize) -> PrefixHints {
        let mut hints = PrefixHints::default();
        let mut index_of: HashMap<&WorkerId, u32> = HashMap::new();
        let mut taken = 0usize;
        for s in sent {
            taken += s.keys.len();
            if taken > max_keys {
                break;
            }
            let w = *index_of.entry(&s.worker).or_insert_with(|| {
                hints.workers.push(s.worker.clone());
                (hints.workers.len() - 1) as u32
            });
            for key in &s.keys {
                match hints.first.entry(*key) {
                    Entry::Vacant(e) => {
                        e.insert(w);
                    }
                    Entry::Occupied(e) if *e.get() == w => {}
                    Entry::Occupied(_) => {
                        let more = hints.more.entry(*key).or_default();
                        if !more.contains(&w) {
                            more.push(w);
                        }
                    }
                }
            }
        }
        hints
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Distinct sampled keys held.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// For each worker the hints name, the deepest prefix of `keys` (in
    /// blocks) another replica sent there.
    pub fn depths(&self, keys: &[BlockKey]) -> Vec<(&WorkerId, usize)> {
        let mut found: Vec<(&WorkerId, usize)> = Vec::new();
        if self.first.is_empty() {
            return found;
        }
        let indices: Vec<usize> = sampled_indices(keys.len()).collect();
        for &i in indices.iter().rev() {
            let key = &keys[i];
            let more = self.more.get(key).into_iter().flatten();
            for &w in self.first.get(key).into_iter().chain(more) {
                let id = &self.workers[w as usize];
                if !found.iter().any(|(f, _)| *f == id) {
                    found.push((id, i + 1));
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(from: u64, n: usize) -> Vec<BlockKey> {
        (0..n as u64).map(|i| BlockKey(from + i)).collect()
    }

    #[test]
    fn the_sample_is_the_same_fixed_indices_for_every_prompt_and_its_last_block() {
        let all: Vec<usize> = sampled_indices(600).collect();
        assert_eq!(&all[..12], [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15]);
        assert_eq!(all.last(), Some(&599));
        assert!(all.windows(2).all(|w| w[0] < w[1]), "{all:?}");
        // Each index after the 8th is at most a quarter past the one before.
        assert!(all.windows(2).all(|w| w[1] <= 8 || (w[1] as f64) <= w[0] as f64 * 1.25 + 1.0), "{all:?}");
        assert!(all.len() <= 35, "{}", all.len());
        let short: Vec<usize> = sampled_indices(600).filter(|&i| i < 300).collect();
        let prefix_of_short: Vec<usize> = sampled_indices(300).filter(|&i| i < 299).collect();
        assert_eq!(short[..prefix_of_short.len()], prefix_of_short[..]);
        assert_eq!(sampled_indices(0).count(), 0);
        assert_eq!(sampled_indices(1).collect::<Vec<_>>(), [0]);
        // A last block that is a fixed index is not listed twice.
        assert_eq!(sampled_indices(11).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]);
        assert!(sampled_indices(u32::MAX as usize).count() <= MAX_SAMPLED_KEYS);
    }

    #[test]
    fn a_shared_prefix_is_found_to_at_least_four_fifths_of_its_depth() {
        // Another replica sent a 560-block document + question to w1.
        let mut sent = keys(0, 560);
        sent.extend(keys(10_000, 12));
        let hints = PrefixHints::build(&[SentPrefix { worker: WorkerId::new("w1"), keys: sample(&sent) }], usize::MAX);
        // Another question about the same document.
        let mut mine = keys(0, 560);
        mine.extend(keys(20_000, 9));
        let depths = hints.depths(&mine);
        assert_eq!(depths.len(), 1);
        let (w, depth) = depths[0];
        assert_eq!(w.as_str(), "w1");
        assert!((448..=560).contains(&depth), "{depth}");
        // The very same prompt: all of it.
        assert_eq!(hints.depths(&sent)[0].1, 572);
        // Nothing shared: nothing found.
        assert!(hints.depths(&keys(50_000, 100)).is_empty());
    }

    #[test]
    fn each_worker_gets_its_deepest_hint() {
        let doc = keys(0, 100);
        let hints = PrefixHints::build(
            &[
                SentPrefix { worker: WorkerId::new("a"), keys: sample(&doc[..20]) },
                SentPrefix { worker: WorkerId::new("b"), keys: sample(&doc) },
                SentPrefix { worker: WorkerId::new("a"), keys: sample(&doc[..5]) },
            ],
            usize::MAX,
        );
        let mut depths: Vec<(String, usize)> =
            hints.depths(&doc).into_iter().map(|(w, d)| (w.to_string(), d)).collect();
        depths.sort();
        // a's 20 blocks are found at the deepest fixed index below them (18):
        // the sender's last block (19) is not one this prompt samples.
        assert_eq!(depths, [("a".to_string(), 19), ("b".to_string(), 100)]);
    }

    #[test]
    fn the_hints_hold_no_more_than_their_cap_of_keys() {
        // Four requests of 30 distinct sampled keys each; room for 100 keys.
        let sent: Vec<SentPrefix> =
            (0..4).map(|r| SentPrefix { worker: WorkerId::new("a"), keys: keys(r * 1_000, 30) }).collect();
        assert_eq!(PrefixHints::build(&sent, usize::MAX).len(), 120);
        let capped = PrefixHints::build(&sent, 100);
        assert_eq!(capped.len(), 90, "the first three requests, whole");
        assert_eq!(capped.depths(&keys(2_000, 30)).len(), 1);
        assert!(capped.depths(&keys(3_000, 30)).is_empty(), "the fourth is left out");
    }
}
