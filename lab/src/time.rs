//! Virtual time and the event queue that drives the lab.
//!
//! Nothing in the lab reads a wall clock: every engine step, sidecar flush and
//! arrival is an [`Event`] at a [`Micros`] instant, popped in (time, insertion)
//! order, so one seed always replays the same history.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A virtual instant or duration in microseconds since the run started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Micros(pub u64);

impl Micros {
    pub const ZERO: Micros = Micros(0);

    pub fn from_ms(ms: u64) -> Micros {
        Micros(ms * 1_000)
    }

    pub fn from_secs_f64(s: f64) -> Micros {
        Micros((s * 1e6).round().max(0.0) as u64)
    }

    pub fn as_ms(self) -> u64 {
        self.0 / 1_000
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    pub fn saturating_sub(self, other: Micros) -> Micros {
        Micros(self.0.saturating_sub(other.0))
    }
}

impl std::ops::Add for Micros {
    type Output = Micros;
    fn add(self, rhs: Micros) -> Micros {
        Micros(self.0 + rhs.0)
    }
}

/// What happens at an instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Event {
    /// Request `n` of the workload reaches a router.
    Arrival(u32),
    /// Request `n` reaches the engine it was routed to, after the request
    /// path's delay (only when the scenario models one).
    Submit(u32),
    /// Engine `n`'s running step ends (its output is applied, its KV events leave).
    StepEnd(u32),
    /// Engine `n`'s sidecar samples the engine's load (vLLM metrics scrape).
    LoadScrape(u32),
    /// Engine `n`'s sidecar pushes its batch of deltas to every router.
    SidecarFlush(u32),
    /// Engine `n`'s sidecar pushes a full sync.
    SidecarSync(u32),
    /// Router `n` expires speculative entries.
    Housekeeping(u32),
    /// Router `n` tells the other replicas its pending prefill, in-flight
    /// requests and recent prefixes per worker
    /// ([`crate::cluster::Scenario::peer_exchange`]).
    PeerExchange(u32),
    /// Router `n` tells the other replicas its new per-worker figures
    /// between full reports ([`crate::cluster::Scenario::peer_news`]).
    PeerNews(u32),
}

/// A min-queue of events; ties keep insertion order.
#[derive(Debug, Default)]
pub struct Queue {
    heap: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    next: u64,
}

impl Queue {
    pub fn push(&mut self, at: Micros, ev: Event) {
        self.heap.push(Reverse((at, self.next, ev)));
        self.next += 1;
    }

    pub fn pop(&mut self) -> Option<(Micros, Event)> {
        self.heap.pop().map(|Reverse((t, _, e))| (t, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_pop_in_time_then_insertion_order() {
        let mut q = Queue::default();
        q.push(Micros(5), Event::StepEnd(1));
        q.push(Micros(3), Event::Arrival(9));
        q.push(Micros(5), Event::Arrival(0));
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            vec![(Micros(3), Event::Arrival(9)), (Micros(5), Event::StepEnd(1)), (Micros(5), Event::Arrival(0))]
        );
    }
}
