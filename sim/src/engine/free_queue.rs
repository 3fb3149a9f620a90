//! The LRU queue of free blocks: vLLM v1's `FreeKVCacheBlockQueue`.
//!
//! An intrusive doubly linked list over block indices, so removing a block from
//! the middle (a prefix hit on a free, still-cached block) is O(1), like vLLM's.
//! Allocation pops the head; freed cached blocks are appended at the tail (LRU),
//! freed uncached blocks are put back at the head (reused first), as vLLM's
//! `BlockPool.free_blocks` does with `append_n` / `prepend_n`.

use super::block_pool::BlockId;

const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Links {
    prev: u32,
    next: u32,
    queued: bool,
}

#[derive(Debug)]
pub struct FreeQueue {
    links: Vec<Links>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every block `0..n`, in index order (vLLM's start state).
    pub fn full(n: u32) -> Self {
        let mut q = FreeQueue {
            links: vec![Links { prev: NONE, next: NONE, queued: false }; n as usize],
            head: NONE,
            tail: NONE,
            len: 0,
        };
        for i in 0..n {
            q.push_back(BlockId(i));
        }
        q
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, id: BlockId) -> bool {
        self.links[id.index()].queued
    }

    pub fn push_back(&mut self, id: BlockId) {
        let i = id.0;
        debug_assert!(!self.links[id.index()].queued, "block {i} freed twice");
        self.links[id.index()] = Links { prev: self.tail, next: NONE, queued: true };
        if self.tail == NONE {
            self.head = i;
        } else {
            self.links[self.tail as usize].next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Puts `ids` at the head, in the given order (`ids[0]` becomes the head).
    pub fn push_front_n(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let i = id.0;
            debug_assert!(!self.links[id.index()].queued, "block {i} freed twice");
            self.links[id.index()] = Links { prev: NONE, next: self.head, queued: true };
            if self.head == NONE {
                self.tail = i;
            } else {
                self.links[self.head as usize].prev = i;
            }
            self.head = i;
            self.len += 1;
        }
    }

    pub fn pop_front(&mut self) -> Option<BlockId> {
        if self.head == NONE {
            return None;
        }
        let id = BlockId(self.head);
        self.remove(id);
        Some(id)
    }

    /// Takes a block out of the queue wherever it is; no-op if it is not queued.
    pub fn remove(&mut self, id: BlockId) {
        let Links { prev, next, queued } = self.links[id.index()];
        if !queued {
            return;
        }
        if prev == NONE {
            self.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        self.links[id.index()] = Links { prev: NONE, next: NONE, queued: false };
        self.len -= 1;
    }

    /// Queue order, head first (tests and debugging).
    pub fn order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        let mut cur = self.head;
        while cur != NONE {
            out.push(BlockId(cur));
            cur = self.links[cur as usize].next;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_removal_from_the_middle() {
        let mut q = FreeQueue::full(4);
        q.remove(BlockId(1));
        assert_eq!(q.order(), vec![BlockId(0), BlockId(2), BlockId(3)]);
        assert_eq!(q.pop_front(), Some(BlockId(0)));
        q.push_back(BlockId(1));
        q.push_back(BlockId(0));
        assert_eq!(q.order(), vec![BlockId(2), BlockId(3), BlockId(1), BlockId(0)]);
        assert_eq!(q.len(), 4);
        q.remove(BlockId(0));
        q.remove(BlockId(2));
        assert_eq!(q.order(), vec![BlockId(3), BlockId(1)]);
        assert!(!q.contains(BlockId(2)));
        q.push_front_n(&[BlockId(0), BlockId(2)]);
        assert_eq!(q.order(), vec![BlockId(0), BlockId(2), BlockId(3), BlockId(1)]);
        assert_eq!(q.len(), 4);
        q.remove(BlockId(1));
        assert_eq!(q.pop_front(), Some(BlockId(0)));
        q.push_back(BlockId(1));
        assert_eq!(q.order(), vec![BlockId(2), BlockId(3), BlockId(1)]);
    }
}
