//! CI gate (issue 12): per workload, a small lab run (three seeds, each
//! policy's percentiles averaged geometrically; `kvroute_lab::gate`) in which
//! the router's default policy must be within 3 % of the best registered
//! policy on TTFT p50 and p99.
//!
//! Where the default does not pass yet, the case is not skipped and not
//! loosened into a pass: it is a *ratchet*. It fails if the default falls
//! further behind than the gap measured when it was written (the figures are
//! in each test), and it fails too once the default passes the 3 % gate, so
//! that the case is moved back here with the others. Issue 12's target
//! stays unmet for those workloads until then; BENCHMARKS.md says so.
//! `kvroute-lab gate` prints every workload's figures.

use kvroute_lab::gate::{Gap, TOLERANCE_PCT, measure};
use kvroute_lab::workload::WorkloadKind;

fn run(kind: WorkloadKind) -> Gap {
    let gap = measure(kind).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", gap.report);
    gap
}

fn gate(kind: WorkloadKind) {
    let gap = run(kind);
    assert!(gap.passes(), "the default policy is more than {TOLERANCE_PCT} % behind: {}", gap.report);
}

/// A workload the default does not pass yet: it must not fall further behind
/// than `p50_max` / `p99_max` percent (today's gap, rounded up), and must be
/// promoted to [`gate`] once it passes.
fn ratchet(kind: WorkloadKind, p50_max: f64, p99_max: f64) {
    let gap = run(kind);
    assert!(
        !gap.passes(),
        "{} now passes the {TOLERANCE_PCT} % gate: make it a gate() case ({})",
        kind.as_str(),
        gap.report
    );
    assert!(
        gap.p50_pct <= p50_max && gap.p99_pct <= p99_max,
        "the default fell further behind than the ratchet's p50 +{p50_max} % / p99 +{p99_max} %: {}",
        gap.report
    );
}

/// 2026-11-23 (idle pull and imposed delay): predicted_ttft p50 1017 ms, the
/// best; p99 5242 vs 4898 (preble) +7.0 %. The previous default passed here
/// (p99 4843 on the same seeds): the imposed delay sends a long cold prompt where
/// fewer requests queue behind it, and on this trace such prompts are the p99.
/// 2026-11-25 (`stick_unique_weight`): p50 1008, the best; p99 5214 vs 4899,
/// +6.4 %.
/// Passes since 2026-11-26 (`imposed_cap_us`: a request gives up at most
/// 300 ms to spare the others): p50 1001, p99 4759, both the best.
#[test]
fn trace() {
    gate(WorkloadKind::Trace);
}

#[test]
fn chat() {
    gate(WorkloadKind::Chat);
}

/// 2026-11-23: predicted_ttft p50 4513 ms vs 4262 (llmd_weighted) +5.9 %,
/// p99 7837, the best.
/// 2026-11-26 (spill gate 2.5 ×, `imposed_cap_us` 300 ms): p50 4612 vs 4271
/// +8.0 %, p99 7758, the best. Loosened by 2 points for the cap: without
/// it, on these seeds and rates, p50 4510 (+5.6 %); on the 4/16-worker grid
/// it gained more than that elsewhere (BENCHMARKS.md, 2026-11-26).
/// 2026-11-26 (the sole router breaks near-ties by score): p50 4705 vs 4399
/// (llmd_weighted) +6.9 %, p99 7950, the best.
#[test]
fn long_conv_ratchet() {
    ratchet(WorkloadKind::LongConv, 7.0, 3.0);
}

/// 2026-11-23: predicted_ttft p50 159 ms vs 64 (llmd_weighted) +151 %, p99
/// 1535, the best (the previous default, same seeds: +256 %). llm-d's
/// scorers leave most questions on an idle holder and the cold documents'
/// prefills to a few workers: its p50 is lower, its p99 27 % higher.
/// 2026-11-25 (`stick_unique_weight`): p50 196 vs 101 (llmd_weighted)
/// +94.8 %, p99 1553, the best (the load levels are calibrated on the
/// default, so every policy's rate moved).
/// 2026-11-26 (spill gate 2.5 ×, `imposed_cap_us`): p50 115 vs 106
/// (llmd_weighted) +8.3 %, p99 1403, the best.
/// 2026-11-26 (the sole router breaks near-ties by score; RAG's gate runs
/// 1,000 requests, `kvroute_lab::gate::requests`): p50 32 vs 31
/// (llmd_weighted) +3.9 %, p99 1750, the best. Over 300 requests, at the
/// 4.6 % higher rate the new default's calibration gave, p50 +157 %, and
/// +135 % with ties broken by hash as before: the warm-up's luck.
#[test]
fn rag_ratchet() {
    ratchet(WorkloadKind::Rag, 5.0, 3.0);
}

/// Passes since 2026-11-23 (idle pull): before, +24.7 % on p50 against
/// preble, one worker never holding the tool prompt.
#[test]
fn agent() {
    gate(WorkloadKind::Agent);
}

/// 2026-11-23: predicted_ttft p50 157 ms vs 156 (preble) +0.8 %, p99 600 vs
/// 504 (preble) +19.2 % (the previous default, same seeds: 546, +8.3 %).
/// 2026-11-25 (`stick_unique_weight`): p50 156, the best; p99 577, +14.4 %.
/// 2026-11-26 (spill gate 2.5 ×, `imposed_cap_us`): p50 157 vs 156 (preble)
/// +0.2 %; p99 566 vs 504 (preble), +12.2 %.
/// 2026-11-26 (the sole router breaks near-ties by score): p50 155, the
/// best; p99 536 vs 499 (preble), +7.5 %.
#[test]
fn eviction_ratchet() {
    ratchet(WorkloadKind::Eviction, 3.0, 8.0);
}

/// Passes since 2026-11-23 (burst spread): p50 423 ms, level with dynamo_kv,
/// p99 652, the best. Before, p50 439 ms, +3.8 %: a burst queued behind the
/// one worker prefilling its new prefix.
#[test]
fn burst() {
    gate(WorkloadKind::Burst);
}

/// Held out (`WorkloadKind::HELD_OUT`): a quarter each of chat, RAG, agent
/// and eviction requests on one cluster, added 2026-11-26 after every
/// default was tuned, and not tuned on. That day: predicted_ttft p50 246 ms
/// vs 173 (llmd_weighted) +42.3 %, p99 1319, the best. At 4 workers and high
/// load llm-d's scorers leave the agent and RAG hits on their holders
/// behind shorter queues and the cold prompts' prefills to the others: its
/// p50 is lower, its p99 × 2 the default's (lab matrix, ρ 0.9: p50 561
/// against 977 ms, p99 5,019 against 2,343; BENCHMARKS.md).
#[test]
fn mixed_ratchet() {
    ratchet(WorkloadKind::Mixed, 43.0, 3.0);
}

/// Held out (`WorkloadKind::HELD_OUT`): nothing shared, long-tailed prompts
/// and answers, added 2026-11-27 after every default was tuned, and not
/// tuned on: where a cache-aware router has nothing to gain and must not
/// lose to a balancer. That day: predicted_ttft p50 75 ms vs 73 (preble)
/// +2.1 %, p99 939 vs 915 (preble) +2.6 %.
#[test]
fn unique() {
    gate(WorkloadKind::Unique);
}
