//! Session affinity (after AIBrix's context-cache design): a session id pins a
//! conversation to one worker for a TTL, while that worker is healthy and not
//! overloaded. Bounded in count: at the cap a new session takes the place of
//! the one used least recently (ids are client-chosen, so a refusal at the cap
//! would let any client shut sessions out for up to `max_session_ttl` with
//! cheap requests; a pin is a routing hint, and a dropped one only costs its
//! conversation the pull towards its worker, which the cache map still gives).
//! Expired sessions are dropped lazily and by the periodic sweep.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvroute_shared::WorkerId;
use parking_lot::Mutex;

#[derive(Debug, Clone)]
struct Session {
    worker: WorkerId,
    expires: Instant,
    /// Its key in `Table::by_use`.
    used: u64,
}

#[derive(Debug)]
pub struct Sessions {
    table: Mutex<Table>,
    max: usize,
}

#[derive(Debug, Default)]
struct Table {
    map: HashMap<String, Session>,
    /// Every session by its last pin or live lookup, least recent first.
    by_use: BTreeMap<u64, String>,
    uses: u64,
    /// No session expires before this: the sweep scans the table only once
    /// one can have expired.
    earliest: Option<Instant>,
    /// The last scan, and how many there were.
    scanned: Option<Instant>,
    scans: u64,
}

/// A pin at the cap scans the table for expired sessions at most this often;
/// between scans it drops the least recently used. A client pinning new ids
/// with `x-session-ttl: 0` made every pin at the cap scan the whole table
/// (100 k sessions, milliseconds) under its lock.
const SCAN_AT_CAP_EVERY: Duration = Duration::from_secs(1);

impl Table {
    fn insert(&mut self, id: String, worker: WorkerId, expires: Instant) {
        self.earliest = Some(self.earliest.map_or(expires, |e| e.min(expires)));
        self.uses += 1;
        if let Some(old) = self.map.insert(id.clone(), Session { worker, expires, used: self.uses }) {
            self.by_use.remove(&old.used);
        }
        self.by_use.insert(self.uses, id);
    }

    fn touch(&mut self, id: &str) {
        if let Some(s) = self.map.get_mut(id) {
            self.uses += 1;
            let id = self.by_use.remove(&s.used).unwrap_or_else(|| id.to_owned());
            s.used = self.uses;
            self.by_use.insert(self.uses, id);
        }
    }

    fn remove(&mut self, id: &str) -> Option<Session> {
        let s = self.map.remove(id)?;
        self.by_use.remove(&s.used);
        Some(s)
    }

    /// Drops the expired sessions, if any can have expired by `now`.
    fn sweep(&mut self, now: Instant) {
        if self.earliest.is_some_and(|e| e > now) {
            return;
        }
        self.scanned = Some(now);
        self.scans += 1;
        self.map.retain(|_, s| s.expires > now);
        let map = &self.map;
        self.by_use.retain(|used, id| map.get(id).is_some_and(|s| s.used == *used));
        self.earliest = self.map.values().map(|s| s.expires).min();
    }
}

/// Session ids are client-chosen strings; keep them short and printable.
pub fn valid_session_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

impl Sessions {
    pub fn new(max: usize) -> Self {
        Sessions { table: Mutex::new(Table::default()), max: max.max(1) }
    }

    /// The worker `id` is pinned to, if the session is live.
    pub fn get(&self, id: &str, now: Instant) -> Option<WorkerId> {
        let mut table = self.table.lock();
        match table.map.get(id) {
            Some(s) if s.expires > now => {
                let worker = s.worker.clone();
                table.touch(id);
                Some(worker)
            }
            Some(_) => {
                table.remove(id);
                None
            }
            None => None,
        }
    }

    /// [`Self::get`] without counting a use (`/debug/route` explains, and
    /// changes nothing).
    pub fn peek(&self, id: &str, now: Instant) -> Option<WorkerId> {
        self.table.lock().map.get(id).filter(|s| s.expires > now).map(|s| s.worker.clone())
    }

    /// Pins (or re-pins) `id` to `worker` until `now + ttl`. At the cap the
    /// expired sessions go first, then the least recently used one.
    pub fn pin(&self, id: &str, worker: &WorkerId, ttl: Duration, now: Instant) {
        let mut table = self.table.lock();
        if table.map.len() >= self.max && !table.map.contains_key(id) {
            if table.scanned.is_none_or(|t| now.saturating_duration_since(t) >= SCAN_AT_CAP_EVERY) {
                table.sweep(now);
            }
            while table.map.len() >= self.max {
                let Some((_, oldest)) = table.by_use.pop_first() else { break };
                table.map.remove(&oldest);
            }
        }
        table.insert(id.to_owned(), worker.clone(), now + ttl);
    }

    /// Sessions held now (expired ones not yet swept included).
    pub fn count(&self) -> usize {
        self.table.lock().map.len()
    }

    /// Ends a session; false when it was unknown or already expired.
    pub fn remove(&self, id: &str, now: Instant) -> bool {
        self.table.lock().remove(id).is_some_and(|s| s.expires > now)
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
        s.pin("a", &w, Duration::from_secs(10), t0);
        assert_eq!(s.get("a", t0 + Duration::from_secs(5)), Some(w.clone()));
        assert_eq!(s.get("a", t0 + Duration::from_secs(11)), None);
        s.pin("b", &w, Duration::from_secs(10), t0);
        assert!(!s.remove("b", t0 + Duration::from_secs(20)), "expired sessions are unknown");
        assert!(!s.remove("zzz", t0));
    }

    /// At the cap a new session takes the place of the least recently used
    /// one (a lookup counts as a use), expired ones first; re-pinning a live
    /// session never drops another.
    #[test]
    fn a_full_table_drops_the_least_recently_used_session() {
        let s = Sessions::new(2);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        let at = |secs| t0 + Duration::from_secs(secs);
        s.pin("a", &w, Duration::from_secs(100), t0);
        s.pin("b", &w, Duration::from_secs(100), at(1));
        assert_eq!(s.get("a", at(2)), Some(w.clone()), "a is now the most recent");
        s.pin("c", &w, Duration::from_secs(100), at(3));
        assert_eq!((s.get("b", at(3)), s.count()), (None, 2), "b, the least recently used, made room");
        s.pin("a", &w, Duration::from_secs(5), at(4));
        assert!(s.get("c", at(4)).is_some(), "a re-pin drops nothing");
        // a expires at 9: it goes before c, however recent its use.
        s.pin("d", &w, Duration::from_secs(100), at(10));
        assert!(s.get("c", at(10)).is_some() && s.get("d", at(10)).is_some());
        assert!(!s.remove("a", at(10)));
    }

    /// A client that floods the table with new ids leaves it at its cap,
    /// and a conversation in use keeps its pin throughout.
    #[test]
    fn a_flood_of_new_sessions_keeps_the_one_in_use() {
        let s = Sessions::new(100);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        s.pin("mine", &w, Duration::from_secs(600), t0);
        for i in 0..10_000 {
            s.pin(&format!("flood-{i}"), &w, Duration::from_secs(86_400), t0);
            if i % 50 == 0 {
                assert_eq!(s.get("mine", t0), Some(w.clone()), "after {i}");
            }
        }
        assert_eq!(s.count(), 100);
        s.sweep(t0 + Duration::from_secs(601));
        assert_eq!((s.count(), s.get("mine", t0 + Duration::from_secs(601))), (99, None));
        assert!(!valid_session_id("") && !valid_session_id("a b") && valid_session_id("conv-42"));
    }

    /// New ids pinned for no time at the cap do not each scan the table.
    #[test]
    fn pins_at_the_cap_scan_the_table_at_most_once_a_second() {
        let s = Sessions::new(1_000);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        for i in 0..1_000 {
            s.pin(&format!("long-{i}"), &w, Duration::from_secs(600), t0);
        }
        for i in 0..1_000 {
            s.pin(&format!("brief-{i}"), &w, Duration::ZERO, t0 + Duration::from_millis(i));
        }
        assert_eq!(s.count(), 1_000);
        assert!(s.table.lock().scans <= 1, "{} scans", s.table.lock().scans);
    }
}
