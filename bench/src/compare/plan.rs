//! The order compare's runs happen in. With `--rounds N` every (worker count,
//! workload) runs all its shapes (policy × replicas × sidecars) once per
//! round, interleaved: round 1 in the listed order, round 2 reversed, round 3
//! listed again, … (A B C, C B A, A B C). On a shared machine the load from
//! other work drifts over minutes; running policies one after another in a
//! single block would turn that drift into a difference between policies,
//! while interleaving spreads it over all of them, and reversing every other
//! round keeps any one policy from always going first or last.

use super::Record;
use crate::engine::EngineKind;

/// One run of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// Index into the prepared workloads.
    pub workload: usize,
    pub workers: usize,
    pub policy: String,
    pub routers: usize,
    pub sidecars: bool,
    /// 1-based.
    pub round: usize,
}

impl Planned {
    /// Whether `records` (from an interrupted run being resumed) already
    /// hold this run: same engine, workload, shape, router config and round.
    pub fn recorded_in(
        &self,
        records: &[Record],
        engine: EngineKind,
        workload: &str,
        router_config: Option<&str>,
    ) -> bool {
        records.iter().any(|r| {
            r.engine == engine
                && r.workload == workload
                && r.policy == self.policy
                && r.workers == self.workers
                && r.routers == self.routers
                && r.sidecars == self.sidecars
                && r.router_config.as_deref() == router_config
                && r.round == self.round
        })
    }
}

/// Worker count outermost, then workload (real engines are started once per
/// pair and shared by its runs), then rounds, each round every shape of
/// `shapes` (policy, routers, sidecars) in alternating order.
pub fn interleaved(
    workers: &[usize],
    workloads: usize,
    shapes: &[(String, usize, bool)],
    rounds: usize,
) -> Vec<Planned> {
    let mut plan = Vec::new();
    for &n in workers {
        for wi in 0..workloads {
            for round in 1..=rounds.max(1) {
                let order: Box<dyn Iterator<Item = &(String, usize, bool)>> =
                    if round % 2 == 1 { Box::new(shapes.iter()) } else { Box::new(shapes.iter().rev()) };
                plan.extend(order.map(|(policy, routers, sidecars)| Planned {
                    workload: wi,
                    workers: n,
                    policy: policy.clone(),
                    routers: *routers,
                    sidecars: *sidecars,
                    round,
                }));
            }
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::summary::tests::rec;

    fn shapes(names: &[&str]) -> Vec<(String, usize, bool)> {
        names.iter().map(|n| (n.to_string(), 1, true)).collect()
    }

    fn order(plan: &[Planned]) -> Vec<(usize, &str)> {
        plan.iter().map(|p| (p.round, p.policy.as_str())).collect()
    }

    #[test]
    fn rounds_alternate_the_order_of_the_policies() {
        let plan = interleaved(&[4], 1, &shapes(&["a", "b", "c"]), 3);
        assert_eq!(
            order(&plan),
            [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"), (3, "a"), (3, "b"), (3, "c")]
        );
        // Over an even number of rounds every policy goes first as often as last.
        let plan = interleaved(&[4], 1, &shapes(&["a", "b"]), 4);
        let firsts: Vec<&str> = plan.chunks(2).map(|c| c[0].policy.as_str()).collect();
        assert_eq!(firsts, ["a", "b", "a", "b"]);
    }

    #[test]
    fn one_round_is_the_plain_order_and_rounds_stay_within_a_workload() {
        let plan = interleaved(&[2, 4], 2, &shapes(&["a", "b"]), 1);
        let keys: Vec<(usize, usize, &str, usize)> =
            plan.iter().map(|p| (p.workers, p.workload, p.policy.as_str(), p.round)).collect();
        assert_eq!(
            keys,
            [
                (2, 0, "a", 1),
                (2, 0, "b", 1),
                (2, 1, "a", 1),
                (2, 1, "b", 1),
                (4, 0, "a", 1),
                (4, 0, "b", 1),
                (4, 1, "a", 1),
                (4, 1, "b", 1)
            ]
        );
        let plan = interleaved(&[4], 2, &shapes(&["a", "b"]), 2);
        let workloads: Vec<usize> = plan.iter().map(|p| p.workload).collect();
        assert_eq!(workloads, [0, 0, 0, 0, 1, 1, 1, 1], "a workload's rounds run together (its engines are shared)");
    }

    #[test]
    fn resume_keeps_rounds_apart() {
        let plan = interleaved(&[4], 1, &shapes(&["predicted_ttft", "round_robin"]), 2);
        // An interrupted run: round 1 done, round 2's first run (reversed order) done.
        let mut records = Vec::new();
        for (policy, round) in [("predicted_ttft", 1), ("round_robin", 1), ("round_robin", 2)] {
            let mut r = rec(policy, 0.5, 10.0);
            r.round = round;
            records.push(r);
        }
        let todo: Vec<(usize, &str)> = plan
            .iter()
            .filter(|p| !p.recorded_in(&records, EngineKind::Sim, "w", None))
            .map(|p| (p.round, p.policy.as_str()))
            .collect();
        assert_eq!(todo, [(2, "predicted_ttft")]);
        // Another workload, engine or router config is not this run.
        assert!(!plan[0].recorded_in(&records, EngineKind::Sim, "other", None));
        assert!(!plan[0].recorded_in(&records, EngineKind::Vllm, "w", None));
        assert!(!plan[0].recorded_in(&records, EngineKind::Sim, "w", Some("tuned.toml")));
    }

    #[test]
    fn records_from_before_rounds_are_round_one() {
        let mut old = serde_json::to_value(rec("round_robin", 0.5, 10.0)).unwrap();
        old.as_object_mut().unwrap().remove("round");
        let back: Record = serde_json::from_value(old).unwrap();
        assert_eq!(back.round, 1);
        let plan = interleaved(&[4], 1, &shapes(&["round_robin"]), 2);
        assert!(plan[0].recorded_in(std::slice::from_ref(&back), EngineKind::Sim, "w", None));
        assert!(!plan[1].recorded_in(&[back], EngineKind::Sim, "w", None));
    }
}
