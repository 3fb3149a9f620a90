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
    /// Its key in `Table::by_expiry`.
    pinned: u64,
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
    /// Every session by when it expires, soonest first: the expired ones
    /// are taken from its front, a few at a time, never by a scan (a client
    /// pinning new ids with `x-session-ttl: 0` made each pin at the cap scan
    /// the whole table under its lock).
    by_expiry: BTreeMap<(Instant, u64), String>,
    uses: u64,
    pins: u64,
}

impl Table {
    fn insert(&mut self, id: String, worker: WorkerId, expires: Instant) {
        self.remove(&id);
        self.uses += 1;
        self.pins += 1;
        self.by_use.insert(self.uses, id.clone());
        self.by_expiry.insert((expires, self.pins), id.clone());
        self.map.insert(id, Session { worker, expires, used: self.uses, pinned: self.pins });
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
        self.by_expiry.remove(&(s.expires, s.pinned));
        Some(s)
    }

    /// Drops the sessions expired by `now`, soonest first.
    fn sweep(&mut self, now: Instant) {
        while let Some(entry) = self.by_expiry.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let id = entry.remove();
            if let Some(s) = self.map.remove(&id) {
                self.by_use.remove(&s.used);
            }
        }
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
            table.sweep(now);
            while table.map.len() >= self.max {
                let Some(oldest) = table.by_use.first_key_value().map(|(_, id)| id.clone()) else { break };
                table.remove(&oldest);
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

    /// New ids pinned for no time at the cap take the places of expired
    /// ones, not of live sessions: the expired go first, without a scan of
    /// the table each time.
    #[test]
    fn brief_pins_at_the_cap_replace_expired_sessions_not_live_ones() {
        let s = Sessions::new(1_000);
        let t0 = Instant::now();
        let w = WorkerId::new("w1");
        for i in 0..999 {
            s.pin(&format!("long-{i}"), &w, Duration::from_secs(600), t0);
        }
        for i in 0..1_000 {
            s.pin(&format!("brief-{i}"), &w, Duration::ZERO, t0 + Duration::from_millis(i));
        }
        assert_eq!(s.count(), 1_000);
        let at = t0 + Duration::from_secs(2);
        assert!((0..999).all(|i| s.get(&format!("long-{i}"), at).is_some()), "a live session was dropped");
        let table = s.table.lock();
        assert_eq!((table.by_use.len(), table.by_expiry.len()), (1_000, 1_000), "the indexes agree with the map");
    }
}
