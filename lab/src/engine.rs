//! One simulated vLLM engine in virtual time: kvroute-sim's real
//! [`Scheduler`] and [`BlockPool`], stepped the way the sim's `step_loop`
//! steps them, without its thread or its sleeps.
//!
//! `step_loop` does, per step: drain the submissions that arrived, schedule,
//! sleep the modelled step time (`Config::step_duration`), apply the output
//! (`complete`), publish the step's KV events; an idle engine waits for work.
//! Here a step *starts* when the engine is idle and a request arrives, or when
//! the previous step ends with work left; it *ends* at start + the same
//! modelled duration, where the output is applied and the events are taken.
//! Requests arriving during a step wait in an inbox for the next one, as they
//! wait in the sim's channel.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_sim::config::{Config as SimConfig, Pace};
use kvroute_sim::engine::block_pool::BlockPool;
use kvroute_sim::engine::hashing::BlockExtras;
use kvroute_sim::engine::scheduler::{Limits, Scheduler, StepWork};
use kvroute_sim::engine::{Outcome, Sink, StreamEvent, Submission};
use kvroute_sim::events::KvEvent;
use kvroute_sim::metrics::EngineMetrics;
use tokio::sync::mpsc;

use crate::time::Micros;

/// What the engine says about one request after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    FirstToken { req: u32 },
    Done { req: u32, outcome: Outcome },
    Rejected { req: u32 },
}

/// The engine-side load the sidecar scrapes (vLLM's metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
}

#[derive(Debug)]
struct Live {
    req: u32,
    rx: mpsc::UnboundedReceiver<StreamEvent>,
    first_seen: bool,
}

#[derive(Debug)]
pub struct LabEngine {
    sched: Scheduler,
    metrics: Arc<EngineMetrics>,
    config: SimConfig,
    inbox: Vec<Submission>,
    live: Vec<Live>,
    /// The run's time zero as an `Instant` (the scheduler stamps TTFT
    /// histograms with `Instant`s; the lab's figures never read them).
    base: Instant,
    busy: bool,
    /// Prefill tokens this engine computed (recomputation included).
    pub prefill_tokens: u64,
    pub steps: u64,
}

impl LabEngine {
    /// An engine with the sim's model of timing and limits; `pace` is forced
    /// to real-time scale so `step_duration` yields the modelled time.
    pub fn new(config: &SimConfig, base: Instant) -> LabEngine {
        let mut config = config.clone();
        config.pace = Pace::Scaled(1.0);
        let pool = BlockPool::new(config.num_blocks, config.block_size.get()).with_model(config.model.as_str());
        let limits = Limits {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_model_len: config.max_model_len,
        };
        let metrics = Arc::new(EngineMetrics::default());
        let sched = Scheduler::new(pool, limits, config.hash_mode, metrics.clone());
        LabEngine {
            sched,
            metrics,
            config,
            inbox: Vec::new(),
            live: Vec::new(),
            base,
            busy: false,
            prefill_tokens: 0,
            steps: 0,
        }
    }

    fn instant(&self, t: Micros) -> Instant {
        self.base + Duration::from_micros(t.0)
    }

    /// A request reaches the engine at `now`; returns when a step it starts
    /// will end (the engine was idle), or `None` if it joins the next step.
    pub fn submit(&mut self, req: u32, prompt: Vec<u32>, max_tokens: u32, now: Micros) -> Option<Micros> {
        let (tx, rx) = mpsc::unbounded_channel();
        let sub = Submission {
            prompt,
            max_tokens,
            extras: BlockExtras::default(),
            lora_id: None,
            arrival: self.instant(now),
            sink: Sink::Stream(tx),
        };
        self.inbox.push(sub);
        self.live.push(Live { req, rx, first_seen: false });
        if self.busy { None } else { Some(self.start_step(now)) }
    }

    /// Drains the inbox and schedules a step; returns its end.
    fn start_step(&mut self, now: Micros) -> Micros {
        for sub in self.inbox.drain(..) {
            self.sched.submit(sub);
        }
        self.busy = true;
        let work = self.sched.schedule();
        self.prefill_tokens += work.prefill_tokens as u64;
        self.steps += 1;
        let d = if work == StepWork::default() {
            // Nothing schedulable (the sim would spin); let time pass.
            Duration::from_micros(self.config.cost.overhead_us as u64)
        } else {
            self.config.step_duration(work.prefill_tokens, work.decode_seqs, 1.0).unwrap_or_default()
        };
        now + Micros(d.as_micros().max(1) as u64)
    }

    /// Ends the running step at `now`: applies its output, reports each
    /// request's progress into `out` and the step's KV events into `events`.
    /// Returns the end of the next step if there is work left.
    pub fn end_step(&mut self, now: Micros, out: &mut Vec<Progress>, events: &mut Vec<KvEvent>) -> Option<Micros> {
        self.sched.complete(self.instant(now));
        events.extend(self.sched.take_events());
        self.live.retain_mut(|l| {
            loop {
                match l.rx.try_recv() {
                    Ok(StreamEvent::Token { index: 0 }) if !l.first_seen => {
                        l.first_seen = true;
                        out.push(Progress::FirstToken { req: l.req });
                    }
                    Ok(StreamEvent::Token { .. }) => {}
                    Ok(StreamEvent::Done(outcome)) => {
                        out.push(Progress::Done { req: l.req, outcome });
                        return false;
                    }
                    Ok(StreamEvent::Failed(_)) => {
                        out.push(Progress::Rejected { req: l.req });
                        return false;
                    }
                    Err(_) => return true,
                }
            }
        });
        self.busy = false;
        if self.sched.is_idle() && self.inbox.is_empty() { None } else { Some(self.start_step(now)) }
    }

    /// What vLLM's metrics say right now.
    pub fn load(&self) -> EngineLoad {
        use std::sync::atomic::Ordering::Relaxed;
        EngineLoad {
            running: self.metrics.running.load(Relaxed) as u32,
            waiting: self.metrics.waiting.load(Relaxed) as u32 + self.inbox.len() as u32,
            kv_usage: self.metrics.kv_usage(),
        }
    }

    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Prompt tokens the engine looked up and found cached (vLLM's counters).
    pub fn prefix_counters(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.metrics.prefix_queries.load(Relaxed), self.metrics.prefix_hits.load(Relaxed))
    }

    pub fn preemptions(&self) -> u64 {
        self.metrics.preemptions.load(Relaxed)
    }
}

use std::sync::atomic::Ordering::Relaxed;

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> LabEngine {
        let mut c = SimConfig::for_model("m");
        c.num_blocks = 256;
        LabEngine::new(&c, Instant::now())
    }

    #[test]
    fn a_request_gets_its_first_token_after_its_prefill_step() {
        let mut e = engine();
        let end = e.submit(0, (1..=1_000).collect(), 3, Micros::ZERO).expect("idle engine starts a step");
        // 5 ms overhead + 1,000 × 70 µs.
        assert_eq!(end, Micros(75_000));
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        let next = e.end_step(end, &mut out, &mut ev).expect("decode left");
        assert_eq!(out, vec![Progress::FirstToken { req: 0 }]);
        assert!(matches!(ev[..], [KvEvent::BlockStored { .. }]));
        assert_eq!(next, Micros(75_000 + 5_040));
        // Two more decode steps finish it.
        out.clear();
        let next = e.end_step(next, &mut out, &mut ev).expect("one more");
        assert!(out.is_empty());
        assert_eq!(e.end_step(next, &mut out, &mut ev), None);
        assert!(matches!(out[..], [Progress::Done { req: 0, outcome }] if outcome.completion_tokens == 3));
    }

    #[test]
    fn arrivals_during_a_step_join_the_next() {
        let mut e = engine();
        let end = e.submit(0, (1..=100).collect(), 1, Micros::ZERO).unwrap();
        assert_eq!(e.submit(1, (1..=100).collect(), 1, Micros(10)), None);
        assert_eq!(e.load().waiting, 1);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        let next = e.end_step(end, &mut out, &mut ev).expect("the second request's step");
        assert!(matches!(out[..], [Progress::FirstToken { req: 0 }, Progress::Done { req: 0, .. }]));
        out.clear();
        assert_eq!(e.end_step(next, &mut out, &mut ev), None);
        let Progress::Done { outcome, .. } = out[1] else { panic!("{out:?}") };
        assert_eq!(outcome.cached_tokens, 96, "the second request hit the first one's blocks");
    }
}
