//! The lab against a recorded process-level bench run (issue 12): the
//! bench's closed-loop chat on 4 simulated engines, 3 policies × 3 rounds,
//! replayed from the workload export it wrote (`tests/data/bench-chat`).
//! The lab must reproduce its hit rates within 2 points and, with the
//! request path measured on engines that take no time, its TTFT p50s within
//! 15 %. A change to the lab's engines, routers or sidecars that loses
//! that agreement fails here. Both sides are recorded or virtual-time
//! figures, so nothing here depends on this machine's speed.

use std::path::{Path, PathBuf};

use kvroute_lab::crosscheck::{Replay, check};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bench-chat")
}

#[test]
fn the_lab_reproduces_a_recorded_bench_chat_run() {
    let rows = check(
        &data().join("x4"),
        &Replay { path_from: Some(data().join("instant")), ..Replay::default() },
        None,
        |_| {},
    )
    .expect("a replayable run");
    let policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    assert_eq!(policies, ["predicted_ttft", "cache_aware", "round_robin"]);
    for r in &rows {
        assert_eq!((r.workload.as_str(), r.requests, r.bench_rounds), ("chat", 144, 3));
        assert!(r.hit_ok(), "{}: hit rate bench {:.3}, lab {:.3}", r.policy, r.bench_hit, r.lab_hit);
        assert!(r.p50_ok(), "{}: TTFT p50 bench {:.2} ms, lab {:.2} ms", r.policy, r.bench_p50_ms, r.lab_p50_ms);
        assert!((r.lab_ceiling - r.bench_ceiling).abs() < 1e-9, "the export keeps the workload's sharing exactly");
    }
    // The policies differ as they did in the bench: cache-aware routing
    // beats round-robin on hit rate by about 0.1.
    assert!(rows[0].lab_hit > rows[2].lab_hit + 0.05 && rows[1].lab_hit > rows[2].lab_hit + 0.05);
}
