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
    map: Mutex<HashMap<String, Session>>,
    max: usize,
}

/// Session ids are client-chosen strings; keep them short and printable.
pub fn valid_session_id(id: &str) -> bool {
    (1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

impl Sessions {
    pub fn new(max: usize) -> Self {
        Sessions { map: Mutex::new(HashMap::new()), max }
    }

    /// The worker `id` is pinned to, if the session is live.
    pub fn get(&self, id: &str, now: Instant) -> Option<WorkerId> {
        let mut map = self.map.lock();
        match map.get(id) {
            Some(s) if s.expires > now => Some(s.worker.clone()),
            Some(_) => {
                map.remove(id);
                None
            }
            None => None,
        }
    }

    /// Pins (or re-pins) `id` to `worker` until `now + ttl`. Returns false when
    /// the table is full of live sessions.
    pub fn pin(&self, id: &str, worker: &WorkerId, ttl: Duration, now: Instant) -> bool {
        let mut map = self.map.lock();
        if map.len() >= self.max && !map.contains_key(id) {
            map.retain(|_, s| s.expires > now);
            if map.len() >= self.max {
                return false;
            }
        }
        map.insert(id.to_owned(), Session { worker: worker.clone(), expires: now + ttl });
        true
    }

    /// Whether a new session could be stored now.
    pub fn has_room(&self, now: Instant) -> bool {
        let mut map = self.map.lock();
        if map.len() < self.max {
            return true;
        }
        map.retain(|_, s| s.expires > now);
        map.len() < self.max
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Ends a session; false when it was unknown or already expired.
    pub fn remove(&self, id: &str, now: Instant) -> bool {
        self.map.lock().remove(id).is_some_and(|s| s.expires > now)
    }

    pub fn sweep(&self, now: Instant) {
        self.map.lock().retain(|_, s| s.expires > now);
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
