//! Progress lines for long runs, on stderr, whatever stderr is: a bar
//! (indicatif) draws nothing when stderr is a file or a pipe, so a run under
//! CI, `nohup` or `tee` would say nothing until it ends. One line per step,
//! at most one per `every` for steps that come fast, with the time elapsed.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Progress {
    what: &'static str,
    total: usize,
    started: Instant,
    last: Option<Instant>,
    every: Duration,
}

impl Progress {
    /// Progress of `total` steps of `what` (0: unknown), a line at most every `every`.
    pub fn new(what: &'static str, total: usize, every: Duration) -> Progress {
        Progress { what, total, started: Instant::now(), last: None, every }
    }

    /// A line saying what happens now, always printed.
    pub fn note(&self, message: impl std::fmt::Display) {
        eprintln!("{}", self.line(None, &message));
    }

    /// Step `done` of the total is over: a line, unless one was printed less
    /// than `every` ago (the last step always prints).
    pub fn step(&mut self, done: usize, message: impl std::fmt::Display) {
        let now = Instant::now();
        if done < self.total && self.last.is_some_and(|t| now.duration_since(t) < self.every) {
            return;
        }
        self.last = Some(now);
        eprintln!("{}", self.line(Some(done), &message));
    }

    fn line(&self, done: Option<usize>, message: &dyn std::fmt::Display) -> String {
        let t = self.started.elapsed().as_secs_f64();
        match done {
            Some(d) if self.total > 0 => format!("[{t:>7.1} s] {} {d}/{}: {message}", self.what, self.total),
            _ => format!("[{t:>7.1} s] {}: {message}", self.what),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_the_step_and_the_total() {
        let p = Progress::new("propagation", 200, Duration::from_secs(5));
        let line = p.line(Some(40), &"last 104 ms");
        assert!(line.ends_with("propagation 40/200: last 104 ms"), "{line}");
        assert!(line.starts_with("[    0.0 s]"), "{line}");
        assert!(p.line(None, &"cluster up").ends_with("propagation: cluster up"));
    }
}
