//! The simulated engine: a paged prefix cache ([`block_pool`]) driven by a
//! continuous-batching step loop ([`scheduler`]) on its own OS thread.
//!
//! Why a dedicated thread: the engine is one sequential, write-heavy state
//! machine (like vLLM's EngineCore process). Owning it on one thread, fed by a
//! channel, needs no locks, and its step sleeps never occupy a tokio worker.
//! In `--instant` mode the loop never sleeps; requests arriving while a step
//! runs join the next one, which is how the hot path stays cheap.

pub mod block_pool;
pub mod free_queue;
pub mod hashing;
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
    ResetPrefixCache(oneshot::Sender<()>),
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
        let limits =
            Limits { max_num_seqs: config.max_num_seqs, max_num_batched_tokens: config.max_num_batched_tokens };
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

    /// Forgets every cached block (publishes `AllBlocksCleared`).
    pub async fn reset_prefix_cache(&self) -> Result<(), EngineGone> {
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
            sched.reset_prefix_cache();
            let _ = done.send(());
        }
        Command::RouterKeys(reply) => {
            let _ = reply.send(sched.pool().router_keys());
        }
    };
    loop {
        if sched.is_idle() {
            match rx.blocking_recv() {
                Some(cmd) => apply(&mut sched, cmd),
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            apply(&mut sched, cmd);
        }
        let work = sched.schedule();
        // Events are produced at scheduling time (vLLM caches blocks in
        // `allocate_slots`); publishing them before the step's sleep is what
        // vLLM does too (they leave with the step's output).
        publish(&mut sched, events);
        let slowdown = faults.borrow().slowdown;
        let busy = work != StepWork::default();
        if busy && let Some(d) = config.step_duration(work.prefill_tokens, work.decode_seqs, slowdown) {
            std::thread::sleep(d);
        }
        sched.complete(Instant::now());
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
