//! A fixed-size bitset of worker slots: the forward map's value.
//!
//! 16 bytes for up to [`MAX_WORKERS`] workers keeps a forward entry at 24
//! bytes of payload, where a `Vec<WorkerId>` would cost 24 bytes before its
//! heap allocation.

/// Workers one router can index at once. Raise the array length to go beyond.
pub const MAX_WORKERS: usize = 128;

/// A dense worker number inside one router, assigned at registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(pub u16);

#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct SlotSet([u64; 2]);

impl SlotSet {
    pub const EMPTY: SlotSet = SlotSet([0; 2]);

    /// Slots 0..64 from `low`, 64..128 from `high`.
    pub fn from_words(low: u64, high: u64) -> SlotSet {
        SlotSet([low, high])
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
        self.0 == [0; 2]
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn and(self, other: SlotSet) -> SlotSet {
        SlotSet([self.0[0] & other.0[0], self.0[1] & other.0[1]])
    }

    pub fn union(self, other: SlotSet) -> SlotSet {
        SlotSet([self.0[0] | other.0[0], self.0[1] | other.0[1]])
    }

    pub fn minus(self, other: SlotSet) -> SlotSet {
        SlotSet([self.0[0] & !other.0[0], self.0[1] & !other.0[1]])
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
        assert_eq!(a.len(), 3);
        assert!(a.contains(Slot(70)) && !a.contains(Slot(69)));
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![Slot(0), Slot(70), Slot(127)]);
        let mut b = SlotSet::EMPTY;
        b.insert(Slot(70));
        assert_eq!(a.and(b).iter().collect::<Vec<_>>(), vec![Slot(70)]);
        assert_eq!(a.minus(b).len(), 2);
        a.remove(Slot(0));
        assert!(!a.contains(Slot(0)));
    }
}
