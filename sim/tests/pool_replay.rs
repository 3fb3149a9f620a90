//! Event consistency: whatever requests the scheduler runs, the hashes a
//! subscriber rebuilds from the emitted events (stores minus removes, cleared
//! on `AllBlocksCleared`, counted per physical block since vLLM stores a hash
//! again when it computes a duplicate block) equal the pool's cached blocks
//! after every step. This is what lets a sidecar mirror the engine from events
//! alone.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_sim::engine::block_pool::BlockPool;
use kvroute_sim::engine::hashing::{BlockExtras, HashMode};
use kvroute_sim::engine::scheduler::{Limits, Scheduler};
use kvroute_sim::engine::{Outcome, Rejected, Sink, Submission};
use kvroute_sim::events::{BlockHash, KvEvent};
use kvroute_sim::metrics::EngineMetrics;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::oneshot;

#[derive(Clone, Debug)]
enum Op {
    /// A request: shared prefix id, prefix blocks, suffix length, max tokens,
    /// salt/adapter variant, whether the client walks away.
    Submit {
        prefix: u8,
        prefix_blocks: u8,
        suffix: u8,
        max_tokens: u8,
        variant: u8,
        abandon: bool,
    },
    Step,
    Reset,
}

fn prompt(prefix: u8, prefix_blocks: u8, suffix: u8, nonce: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..u32::from(prefix_blocks) * 4).map(|i| u32::from(prefix) * 1000 + i).collect();
    p.extend((0..u32::from(suffix)).map(|i| 1_000_000 + nonce * 64 + i));
    if p.is_empty() {
        p.push(nonce);
    }
    p
}

struct Mirror {
    /// Hash → physical blocks holding it.
    blocks: HashMap<BlockHash, usize>,
    removed: usize,
}

impl Mirror {
    fn apply(&mut self, events: Vec<KvEvent>) {
        for e in events {
            match e {
                KvEvent::BlockStored { block_hashes, .. } => {
                    for h in block_hashes {
                        *self.blocks.entry(h).or_default() += 1;
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        let n = self.blocks.get_mut(&h).unwrap_or_else(|| panic!("removed a hash never stored: {h:?}"));
                        *n -= 1;
                        if *n == 0 {
                            self.blocks.remove(&h);
                        }
                        self.removed += 1;
                    }
                }
                KvEvent::AllBlocksCleared => self.blocks.clear(),
            }
        }
    }
}

type Waiter = oneshot::Receiver<Result<Outcome, Rejected>>;

/// Runs the ops, checking after every step; returns how many evictions happened.
fn run(ops: &[Op]) -> usize {
    let metrics = Arc::new(EngineMetrics::default());
    let limits = Limits { max_num_seqs: 6, max_num_batched_tokens: 48, max_model_len: 4096 };
    let mut sched = Scheduler::new(BlockPool::new(48, 4), limits, HashMode::Int, metrics);
    let mut mirror = Mirror { blocks: HashMap::new(), removed: 0 };
    let mut waiters: Vec<Waiter> = Vec::new();
    let mut nonce = 0;
    let check = |sched: &mut Scheduler, mirror: &mut Mirror| {
        mirror.apply(sched.take_events());
        let pool: HashMap<BlockHash, usize> = sched.pool().cached_hashes().map(|(h, n)| (*h, n)).collect();
        assert_eq!(pool, mirror.blocks);
    };
    for op in ops {
        match op {
            Op::Submit { prefix, prefix_blocks, suffix, max_tokens, variant, abandon } => {
                nonce += 1;
                let (tx, rx) = oneshot::channel();
                let extras = match variant % 4 {
                    0 | 1 => BlockExtras::default(),
                    2 => BlockExtras { cache_salt: Some("s".into()), ..Default::default() },
                    _ => BlockExtras { lora_name: Some("a".into()), ..Default::default() },
                };
                sched.submit(Submission {
                    prompt: prompt(*prefix, *prefix_blocks, *suffix, nonce),
                    max_tokens: u32::from(*max_tokens).max(1),
                    lora_id: extras.lora_name.as_ref().map(|_| 1),
                    extras,
                    arrival: Instant::now(),
                    sink: Sink::Once(tx),
                });
                if !abandon {
                    waiters.push(rx);
                }
            }
            Op::Step => {
                sched.schedule();
                check(&mut sched, &mut mirror);
                sched.complete(Instant::now());
                check(&mut sched, &mut mirror);
            }
            Op::Reset => {
                sched.reset_prefix_cache();
                check(&mut sched, &mut mirror);
            }
        }
    }
    // Drain: everything finishes and all blocks return to the free queue.
    for _ in 0..10_000 {
        if sched.is_idle() {
            break;
        }
        sched.schedule();
        sched.complete(Instant::now());
        check(&mut sched, &mut mirror);
    }
    assert!(sched.is_idle(), "requests stuck");
    assert_eq!(sched.pool().usage(), 0.0, "blocks leaked");
    for mut w in waiters {
        match w.try_recv() {
            Ok(Ok(_)) | Ok(Err(Rejected::TooLarge { .. })) => {}
            other => panic!("request never answered: {other:?}"),
        }
    }
    mirror.removed
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..6, 0u8..10, 0u8..9, 1u8..6, any::<u8>(), prop::bool::weighted(0.1)).prop_map(
            |(prefix, prefix_blocks, suffix, max_tokens, variant, abandon)| Op::Submit {
                prefix, prefix_blocks, suffix, max_tokens, variant, abandon
            }
        ),
        5 => Just(Op::Step),
        1 => Just(Op::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mirror_from_events_equals_pool(ops in prop::collection::vec(op(), 1..300)) {
        run(&ops);
    }
}

/// The same check over 10,000 requests from a seeded generator.
#[test]
fn ten_thousand_requests_deterministic() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut ops = Vec::with_capacity(30_000);
    let mut submitted = 0;
    while submitted < 10_000 {
        match rng.gen_range(0..100) {
            0..45 => {
                submitted += 1;
                ops.push(Op::Submit {
                    prefix: rng.gen_range(0..12),
                    prefix_blocks: rng.gen_range(0..10),
                    suffix: rng.gen_range(0..9),
                    max_tokens: rng.gen_range(1..6),
                    variant: rng.r#gen(),
                    abandon: rng.gen_bool(0.05),
                });
            }
            45..99 => ops.push(Op::Step),
            _ => ops.push(Op::Reset),
        }
    }
    let evictions = run(&ops);
    assert!(evictions > 1000, "the workload must exercise eviction, got {evictions}");
}
