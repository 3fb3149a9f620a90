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
