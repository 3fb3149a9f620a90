//! The approximate index of a worker no sidecar reports for: the router's own
//! routing history, evicted least-recently-used first once it exceeds the
//! worker's KV-cache capacity in blocks (the Gateway API Inference Extension's
//! approximate prefix index works the same way).

use std::collections::VecDeque;

use kvroute_shared::BlockKey;

/// LRU order as a queue of (stamp, key) with lazy deletion: touching a key
/// pushes a new item; older items for that key are skipped when popped because
/// the index entry's stamp no longer matches. The queue is compacted when it
/// grows past twice the live entries, so memory stays O(capacity).
#[derive(Debug)]
pub struct ApproxLru {
    capacity: usize,
    order: VecDeque<(u64, BlockKey)>,
    /// Stamps must be unique per touch, or a re-touch within one millisecond
    /// would make the older queue item look current.
    last_stamp: u64,
}

impl ApproxLru {
    pub fn new(capacity: usize) -> Self {
        ApproxLru { capacity: capacity.max(1), order: VecDeque::new(), last_stamp: 0 }
    }

    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    pub fn clear(&mut self) {
        self.order.clear();
    }

    /// A unique, increasing stamp at or after `now_ms`.
    pub fn next_stamp(&mut self, now_ms: u64) -> u64 {
        self.last_stamp = now_ms.max(self.last_stamp + 1);
        self.last_stamp
    }

    pub fn touch(&mut self, key: BlockKey, stamp: u64) {
        self.order.push_back((stamp, key));
    }

    /// The least recently used live key while `live` entries exceed capacity.
    /// `is_current(key, stamp)` tells whether a queue item is still the
    /// entry's latest touch.
    pub fn pop_over_capacity(&mut self, live: usize, is_current: impl Fn(BlockKey, u64) -> bool) -> Option<BlockKey> {
        if self.order.len() > 2 * live.max(16) {
            self.order.retain(|&(s, k)| is_current(k, s));
        }
        if live <= self.capacity {
            return None;
        }
        while let Some((stamp, key)) = self.order.pop_front() {
            if is_current(key, stamp) {
                return Some(key);
            }
        }
        None
    }
}
