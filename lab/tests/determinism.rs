//! The lab's first promise: the same seed gives the same history.

use kvroute_lab::cluster::{Scenario, SidecarModel, run};
use kvroute_lab::policies::factory;
use kvroute_lab::time::Micros;
use kvroute_lab::workload::{Shape, Workload, WorkloadKind, default_trace_path};

fn once(seed: u64, loss: f64, closed_loop: bool) -> (Vec<Option<Micros>>, String) {
    let mut s = Scenario::new(6, 3, seed);
    s.sidecar = SidecarModel { loss, ..Default::default() };
    let shape =
        Shape { requests: 300, seed, cluster_kv_tokens: s.kv_tokens(), trace_path: default_trace_path(), closed_loop };
    let w = Workload::generate(WorkloadKind::Chat, &shape).expect("synthetic").at_rate(40.0);
    let r = run(&s, &w, &factory("cache_aware").expect("registered"));
    let ttfts = r.records.iter().map(|x| x.first_token).collect();
    (ttfts, serde_json::to_string(&(r.summary, r.reasons)).expect("serialisable"))
}

#[test]
fn the_same_seed_gives_identical_results_and_another_seed_does_not() {
    for closed_loop in [false, true] {
        let a = once(5, 0.1, closed_loop);
        assert_eq!(a, once(5, 0.1, closed_loop));
        assert!(a.0.iter().all(Option::is_some), "every request answered");
        assert_ne!(a, once(6, 0.1, closed_loop));
    }
}

/// A matrix pooled over seeds gives the same figures on one thread as on
/// several, and pooling really adds each seed's requests.
#[test]
fn a_pooled_matrix_does_not_depend_on_its_threads() {
    use kvroute_lab::gate::spec;
    use kvroute_lab::matrix::run_matrix;
    let matrix = |seeds: usize, jobs: usize| {
        let mut m = spec(WorkloadKind::Rag, 3);
        m.policies = vec!["predicted_ttft".into(), "round_robin".into()];
        m.requests = 120;
        (m.seeds, m.jobs) = (seeds, jobs);
        let rows = run_matrix(&m, |_| {}).expect("runs").rows;
        rows.into_iter()
            .map(|r| serde_json::to_string(&(r.policy, r.summary, r.per_seed, r.reasons)).expect("json"))
            .collect::<Vec<_>>()
    };
    let one = matrix(2, 1);
    assert_eq!(one, matrix(2, 3));
    assert!(one[0].contains("\"requests\":240"), "two seeds' requests pooled: {}", one[0]);
    assert_ne!(one, matrix(1, 1));
}

/// The what-ifs (`shared_pending`, `peer_exchange`) reach the replicas'
/// decisions, and stay deterministic.
#[test]
fn replicas_that_hear_each_other_decide_differently_and_reproducibly() {
    let once = |shared: bool, peer_ms: Option<u64>| {
        let mut s = Scenario::new(4, 3, 9);
        s.shared_pending = shared;
        s.peer_exchange = peer_ms.map(Micros::from_ms);
        let shape = Shape {
            requests: 300,
            seed: 9,
            cluster_kv_tokens: s.kv_tokens(),
            trace_path: default_trace_path(),
            closed_loop: false,
        };
        let w = Workload::generate(WorkloadKind::LongConv, &shape).expect("synthetic").at_rate(30.0);
        let r = run(&s, &w, &factory("predicted_ttft").expect("registered"));
        r.records.iter().map(|x| (x.worker, x.first_token)).collect::<Vec<_>>()
    };
    let alone = once(false, None);
    let heard = once(false, Some(100));
    assert_eq!(heard, once(false, Some(100)));
    assert_ne!(alone, heard);
    assert_ne!(alone, once(true, None));
}
