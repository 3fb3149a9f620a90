//! Noticing an engine that serves requests but publishes no KV events.
//!
//! A sidecar whose subscription matches nothing (a wrong `--topic`, an event
//! endpoint vLLM did not bind because it lacks `*`, events disabled) would
//! otherwise sit silent forever while routing degrades to guesswork. The
//! engine's `vllm:prompt_tokens_total` rises whenever it prefills, which is
//! exactly when vLLM publishes `BlockStored`; if it rose over a whole
//! [`SILENT_AFTER`] window in which not one batch arrived, the sidecar says so
//! (a warning, `kvroute_sidecar_events_silent` = 1) until events flow again.

use std::time::Duration;

use tokio::time::Instant;

/// How long the engine must prefill without any event batch before it counts.
pub const SILENT_AFTER: Duration = Duration::from_secs(10);

/// A change worth logging.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Transition {
    /// The engine prefilled `prompt_tokens` over `for_secs` and published nothing.
    WentSilent { prompt_tokens: u64, for_secs: u64 },
    /// Batches arrive again.
    Recovered,
}

/// The watcher's memory between two scrapes.
#[derive(Debug, Default)]
pub struct SilenceWatch {
    /// Since when no batch arrived, with the engine's prompt-token counter then.
    quiet: Option<(Instant, f64)>,
    batches: u64,
    silent: bool,
}

impl SilenceWatch {
    pub fn is_silent(&self) -> bool {
        self.silent
    }

    /// One observation: the engine's prompt-token counter (`None` if the scrape
    /// failed) and the number of event batches received so far.
    pub fn observe(&mut self, now: Instant, prompt_tokens: Option<f64>, batches: u64) -> Option<Transition> {
        if batches != self.batches {
            self.batches = batches;
            self.quiet = prompt_tokens.map(|p| (now, p));
            if self.silent {
                self.silent = false;
                return Some(Transition::Recovered);
            }
            return None;
        }
        let p = prompt_tokens?;
        let (since, base) = *self.quiet.get_or_insert((now, p));
        if p < base {
            // The engine restarted: its counters start again.
            self.quiet = Some((now, p));
            return None;
        }
        let quiet_for = now.saturating_duration_since(since);
        if !self.silent && p > base && quiet_for >= SILENT_AFTER {
            self.silent = true;
            return Some(Transition::WentSilent { prompt_tokens: (p - base) as u64, for_secs: quiet_for.as_secs() });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_engine_without_events_goes_silent_then_recovers() {
        let t0 = Instant::now();
        let mut w = SilenceWatch::default();
        assert_eq!(w.observe(t0, Some(0.0), 0), None);
        assert_eq!(w.observe(t0 + Duration::from_secs(5), Some(500.0), 0), None, "not long enough yet");
        let went = w.observe(t0 + SILENT_AFTER, Some(900.0), 0);
        assert_eq!(went, Some(Transition::WentSilent { prompt_tokens: 900, for_secs: 10 }));
        assert!(w.is_silent());
        assert_eq!(w.observe(t0 + SILENT_AFTER * 2, Some(2000.0), 0), None, "said once");
        assert_eq!(w.observe(t0 + SILENT_AFTER * 3, Some(2100.0), 1), Some(Transition::Recovered));
        assert!(!w.is_silent());
    }

    #[test]
    fn an_idle_engine_is_not_silent() {
        let t0 = Instant::now();
        let mut w = SilenceWatch::default();
        for i in 0..10 {
            assert_eq!(w.observe(t0 + SILENT_AFTER * i, Some(42.0), 3), None);
        }
        assert!(!w.is_silent());
    }

    #[test]
    fn events_keep_a_busy_engine_quiet_and_a_restart_resets_the_base() {
        let t0 = Instant::now();
        let mut w = SilenceWatch::default();
        for i in 0..10u32 {
            let now = t0 + SILENT_AFTER * i;
            assert_eq!(w.observe(now, Some(f64::from(i) * 1000.0), u64::from(i)), None);
        }
        // restart: the counter falls back; a quiet, idle engine stays quiet.
        assert_eq!(w.observe(t0 + SILENT_AFTER * 20, Some(0.0), 9), None);
        assert_eq!(w.observe(t0 + SILENT_AFTER * 30, Some(0.0), 9), None);
    }
}
