//! The simulated engine: a paged prefix cache ([`block_pool`]) driven by a
//! continuous-batching step loop ([`scheduler`]) on its own OS thread.
//!
//! A step is vLLM's `EngineCore.step`: schedule (blocks are allocated, cached
//! and evicted here), run the model (sleep the modelled step time), apply the
//! output (tokens sampled, finished requests freed), then publish every KV
//! event the step produced as one batch, as vLLM's scheduler does at the end
//! of `update_from_output`. Like vLLM, an idle engine runs no steps: events
//! from between steps (`AllBlocksCleared` after a reset) leave with the next
//! step's batch.
//!
//! Why a dedicated thread: the engine is one sequential, write-heavy state
//! machine (like vLLM's EngineCore process). Owning it on one thread, fed by a
//! channel, needs no locks, and its step sleeps never occupy a tokio worker.
//! In `--instant` mode the loop never sleeps; requests arriving while a step
//! runs join the next one, which is how the hot path stays cheap.

pub mod block_pool;
pub mod free_queue;
pub mod hashing;
pub mod request;
pub mod scheduler;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch};

use crate::config::Config;
use crate::events::KvEvent;
use crate::faults::Faults;
use crate::metrics::EngineMetrics;
use block_pool::BlockPool;
use hashing::BlockExtras;
use scheduler::{Limits, Scheduler, StepWork};

/// One inference request as the engine sees it: token ids and limits.
#[derive(Debug)]
pub struct Submission {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub extras: BlockExtras,
    pub lora_id: Option<u32>,
    pub arrival: Instant,
    pub sink: Sink,
}

/// Where the engine reports a request's progress.
#[derive(Debug)]
pub enum Sink {
    /// Non-streaming: only the end.
    Once(oneshot::Sender<Result<Outcome, Rejected>>),
    /// Streaming: every token, then the end.
    Stream(mpsc::UnboundedSender<StreamEvent>),
}

#[derive(Debug)]
pub enum StreamEvent {
    Token { index: u32 },
    Done(Outcome),
    Failed(Rejected),
}

/// A finished request's accounting (the response's `usage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error(
        "the request needs {needed_blocks} KV-cache blocks (prompt plus max_tokens) but the engine has only {num_blocks}"
    )]
    TooLarge { needed_blocks: usize, num_blocks: usize },
}

#[derive(Debug)]
enum Command {
    Submit(Submission),
    ResetPrefixCache(oneshot::Sender<bool>),
    RouterKeys(oneshot::Sender<Vec<kvroute_shared::BlockKey>>),
}

#[derive(Debug, thiserror::Error)]
#[error("the engine has stopped")]
pub struct EngineGone;

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone, Debug)]
pub struct Engine {
    // Unbounded: the HTTP server's connection limit is what bounds in-flight
    // requests, and the engine drains the channel every step.
    tx: mpsc::UnboundedSender<Command>,
}

impl Engine {
    /// Starts the engine thread. It stops when every handle is dropped.
    /// Each step that produced KV events sends them as one batch on `events`.
    pub fn start(
        config: &Config,
        metrics: Arc<EngineMetrics>,
        faults: watch::Receiver<Faults>,
        events: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = mpsc::unbounded_channel();
        let pool = BlockPool::new(config.num_blocks, config.block_size.get()).with_model(config.model.as_str());
        let limits = Limits {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_model_len: config.max_model_len,
        };
        let sched = Scheduler::new(pool, limits, config.hash_mode, metrics);
        let config = config.clone();
        std::thread::Builder::new()
            .name("sim-engine".into())
            .spawn(move || step_loop(sched, rx, &config, &faults, events.as_ref()))?;
        Ok(Engine { tx })
    }

    pub fn submit(&self, sub: Submission) -> Result<(), EngineGone> {
        self.tx.send(Command::Submit(sub)).map_err(|_| EngineGone)
    }

    /// kvroute router keys of every cached block, for `GET /sim/cache`.
    pub async fn router_keys(&self) -> Result<Vec<kvroute_shared::BlockKey>, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::RouterKeys(tx)).map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }

    /// Forgets every cached block (`AllBlocksCleared` leaves with the next
    /// step's batch); false, as from vLLM, while requests hold blocks.
    pub async fn reset_prefix_cache(&self) -> Result<bool, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::ResetPrefixCache(tx)).map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }
}

fn step_loop(
    mut sched: Scheduler,
    mut rx: mpsc::UnboundedReceiver<Command>,
    config: &Config,
    faults: &watch::Receiver<Faults>,
    events: Option<&mpsc::UnboundedSender<Vec<KvEvent>>>,
) {
    let apply = |sched: &mut Scheduler, cmd: Command| match cmd {
        Command::Submit(sub) => sched.submit(sub),
        Command::ResetPrefixCache(done) => {
            let _ = done.send(sched.reset_prefix_cache());
        }
        Command::RouterKeys(reply) => {
            let _ = reply.send(sched.pool().router_keys());
        }
    };
    loop {
        while sched.is_idle() {
            match rx.blocking_recv() {
                Some(cmd) => apply(&mut sched, cmd),
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            apply(&mut sched, cmd);
        }
        let work = sched.schedule();
        let slowdown = faults.borrow().slowdown;
        let busy = work != StepWork::default();
        if busy && let Some(d) = config.step_duration(work.prefill_tokens, work.decode_seqs, slowdown) {
            std::thread::sleep(d);
        }
        sched.complete(Instant::now());
        publish(&mut sched, events);
    }
}

fn publish(sched: &mut Scheduler, events: Option<&mpsc::UnboundedSender<Vec<KvEvent>>>) {
    let batch = sched.take_events();
    if let Some(tx) = events
        && !batch.is_empty()
    {
        // The publisher only stops at shutdown; losing the tail then is fine.
        let _ = tx.send(batch);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{Pace, StepCost};

    fn slow_engine(step: Duration) -> (Engine, mpsc::UnboundedReceiver<Vec<KvEvent>>) {
        let mut config = Config::for_model("m");
        config.pace = Pace::Scaled(1.0);
        config.cost =
            StepCost { overhead_us: step.as_micros() as f64, prefill_us_per_token: 0.0, decode_us_per_seq: 0.0 };
        let (_faults_tx, faults) = watch::channel(Faults::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let engine = Engine::start(&config, Arc::new(EngineMetrics::default()), faults, Some(tx)).expect("engine");
        (engine, rx)
    }

    fn submit(engine: &Engine, prompt: Vec<u32>) -> oneshot::Receiver<Result<Outcome, Rejected>> {
        let (tx, rx) = oneshot::channel();
        let sub = Submission {
            prompt,
            max_tokens: 1,
            extras: BlockExtras::default(),
            lora_id: None,
            arrival: Instant::now(),
            sink: Sink::Once(tx),
        };
        engine.submit(sub).expect("running");
        rx
    }

    #[tokio::test]
    async fn a_steps_events_are_published_after_its_compute() {
        let step = Duration::from_millis(200);
        let (engine, mut events) = slow_engine(step);
        let mut done = submit(&engine, (0..32).collect());
        let batch = events.recv().await.expect("a batch");
        assert!(matches!(batch[..], [KvEvent::BlockStored { .. }]), "{batch:?}");
        // Ordered, not timed: the step's output (after its 200 ms compute) is
        // applied before its events leave.
        assert!(matches!(done.try_recv(), Ok(Ok(_))), "the step's output is applied before its events leave");
    }

    #[tokio::test]
    async fn a_reset_on_an_idle_engine_is_published_with_the_next_step() {
        let (engine, mut events) = slow_engine(Duration::from_millis(1));
        assert!(engine.reset_prefix_cache().await.expect("running"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(events.try_recv().is_err(), "an idle engine publishes nothing");
        let _done = submit(&engine, (0..32).collect());
        let batch = events.recv().await.expect("a batch");
        assert!(matches!(batch[..], [KvEvent::AllBlocksCleared, KvEvent::BlockStored { .. }]), "{batch:?}");
    }
}
