//! A fixed-size bitset of worker slots: who holds a key, as the forward map
//! answers it (the map itself stores one 64-slot word per key and word, see
//! `Forward`, so a set of [`MAX_WORKERS`] bits exists only transiently).

/// Words of 64 slots.
pub const WORDS: usize = 4;

/// Workers (routing targets: engines or their data-parallel ranks) one
/// router can index at once.
pub const MAX_WORKERS: usize = WORDS * 64;

/// A dense worker number inside one router, assigned at registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(pub u16);

#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct SlotSet([u64; WORDS]);

impl SlotSet {
    pub const EMPTY: SlotSet = SlotSet([0; WORDS]);

    /// Slots `64 w .. 64 w + 64` from `words[w]`.
    pub fn from_words(words: [u64; WORDS]) -> SlotSet {
        SlotSet(words)
    }

    pub fn insert(&mut self, s: Slot) {
        self.0[s.0 as usize / 64] |= 1 << (s.0 % 64);
    }

    pub fn remove(&mut self, s: Slot) {
        self.0[s.0 as usize / 64] &= !(1 << (s.0 % 64));
    }

    pub fn contains(&self, s: Slot) -> bool {
        self.0[s.0 as usize / 64] & (1 << (s.0 % 64)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.0 == [0; WORDS]
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn and(self, other: SlotSet) -> SlotSet {
        SlotSet(std::array::from_fn(|w| self.0[w] & other.0[w]))
    }

    pub fn union(self, other: SlotSet) -> SlotSet {
        SlotSet(std::array::from_fn(|w| self.0[w] | other.0[w]))
    }

    pub fn minus(self, other: SlotSet) -> SlotSet {
        SlotSet(std::array::from_fn(|w| self.0[w] & !other.0[w]))
    }

    pub fn iter(self) -> impl Iterator<Item = Slot> {
        (0..self.0.len()).flat_map(move |w| {
            let mut bits = self.0[w];
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                Some(Slot((w as u32 * 64 + b) as u16))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operations() {
        let mut a = SlotSet::EMPTY;
        a.insert(Slot(0));
        a.insert(Slot(70));
        a.insert(Slot(127));
        a.insert(Slot(MAX_WORKERS as u16 - 1));
        assert_eq!(a.len(), 4);
        assert!(a.contains(Slot(70)) && !a.contains(Slot(69)));
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![Slot(0), Slot(70), Slot(127), Slot(255)]);
        let mut b = SlotSet::EMPTY;
        b.insert(Slot(70));
        assert_eq!(a.and(b).iter().collect::<Vec<_>>(), vec![Slot(70)]);
        assert_eq!(a.minus(b).len(), 3);
        a.remove(Slot(0));
        assert!(!a.contains(Slot(0)));
    }
}
