//! Session affinity (after AIBrix's context-cache design): a session id pins a
//! conversation to one worker for a TTL, while that worker is healthy and not
//! overloaded. Bounded in count; expired sessions are dropped lazily and by
//! the periodic sweep.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_shared::WorkerId;
use parking_lot::Mutex;

#[derive(Debug, Clone)]
struct Session {
    worker: WorkerId,
    expires: Instant,
}

#[derive(Debug)]
pub struct Sessions {
    table: Mutex<Table>,
    max: usize,
}

#[derive(Debug, Default)]
struct Table {
    map: HashMap<String, Session>,
    /// No session expires before this: a full table of live sessions is
    /// known full without a scan. Without it every new session refused at
    /// the cap scanned the whole table (100,000 entries) under the lock.
    earliest: Option<Instant>,
}

impl Table {
    fn insert(&mut self, id: String, session: Session) {
        self.earliest = Some(self.earliest.map_or(session.expires, |e| e.min(session.expires)));
        self.map.insert(id, session);
    }

    /// Drops the expired sessions, if any can have expired by `now`.
    fn sweep(&mut self, now: Instant) {
        if self.earliest.is_some_and(|e| e > now) {
            return;
        }
        self.map.retain(|_, s| s.expires > now);
        self.earliest = self.map.values().map(|s| s.expires).min();
    }
}

/// Session ids are client-chosen strings; keep them short and printable.
pub fn valid_session_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

impl Sessions {
    pub fn new(max: usize) -> Self {
        Sessions { table: Mutex::new(Table::default()), max }
    }

    /// The worker `id` is pinned to, if the session is live.
    pub fn get(&self, id: &str, now: Instant) -> Option<WorkerId> {
        let mut table = self.table.lock();
        match table.map.get(id) {
            Some(s) if s.expires > now => Some(s.worker.clone()),
            Some(_) => {
                table.map.remove(id);
                None
            }
            None => None,
        }
    }

    /// Pins (or re-pins) `id` to `worker` until `now + ttl`. Returns false when
    /// the table is full of live sessions.
    pub fn pin(&self, id: &str, worker: &WorkerId, ttl: Duration, now: Instant) -> bool {
        let mut table = self.table.lock();
        if table.map.len() >= self.max && !table.map.contains_key(id) {
            table.sweep(now);
            if table.map.len() >= self.max {
                return false;
            }
        }
        table.insert(id.to_owned(), Session { worker: worker.clone(), expires: now + ttl });
        true
    }

    /// Whether a new session could be stored now.
    pub fn has_room(&self, now: Instant) -> bool {
        let mut table = self.table.lock();
        if table.map.len() < self.max {
            return true;
        }
        table.sweep(now);
        table.map.len() < self.max
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Ends a session; false when it was unknown or already expired.
    pub fn remove(&self, id: &str, now: Instant) -> bool {
        self.table.lock().map.remove(id).is_some_and(|s| s.expires > now)
    }

    pub fn sweep(&self, now: Instant) {
        self.table.lock().sweep(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_expire_remove() {
        let s = Sessions::new(2);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        assert!(s.pin("a", &w, Duration::from_secs(10), t0));
        assert_eq!(s.get("a", t0 + Duration::from_secs(5)), Some(w.clone()));
        assert_eq!(s.get("a", t0 + Duration::from_secs(11)), None);
        assert!(s.pin("b", &w, Duration::from_secs(10), t0));
        assert!(!s.remove("b", t0 + Duration::from_secs(20)), "expired sessions are unknown");
        assert!(!s.remove("zzz", t0));
    }

    /// A full table is swept only once a session can have expired, and a
    /// session re-pinned with a shorter TTL counts from its new expiry.
    #[test]
    fn a_full_table_makes_room_as_soon_as_a_session_expires() {
        let s = Sessions::new(2);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        let at = |secs| t0 + Duration::from_secs(secs);
        assert!(s.pin("a", &w, Duration::from_secs(100), t0));
        assert!(s.pin("b", &w, Duration::from_secs(100), t0));
        assert!(!s.has_room(at(50)) && !s.pin("c", &w, Duration::from_secs(100), at(50)));
        assert!(s.pin("a", &w, Duration::from_secs(5), at(50)), "a live session re-pins at the cap");
        assert!(s.pin("c", &w, Duration::from_secs(100), at(56)), "a expired at 55");
        assert_eq!(s.get("b", at(56)), Some(w.clone()));
        assert!(!s.pin("d", &w, Duration::from_secs(100), at(57)));
        assert!(s.pin("d", &w, Duration::from_secs(100), at(101)), "b expired at 100");
    }

    #[test]
    fn bounded() {
        let s = Sessions::new(1);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        assert!(s.pin("a", &w, Duration::from_secs(10), t0));
        assert!(!s.pin("b", &w, Duration::from_secs(10), t0));
        assert!(s.pin("b", &w, Duration::from_secs(10), t0 + Duration::from_secs(11)));
        assert!(!valid_session_id("") && !valid_session_id("a b") && valid_session_id("conv-42"));
    }
}
