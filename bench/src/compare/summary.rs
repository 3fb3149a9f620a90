//! compare's Markdown report: one table per workload and worker count (with
//! `--rounds N`, the median over rounds and each figure's range), then the
//! project's expectations checked against the figures (PASS/FAIL), so a
//! reader sees at once where the default policy falls short and by how much.

use crate::ceiling::Ceiling;
use crate::cli::CompareArgs;
use crate::engine::EngineKind;
use crate::report::{self, ms};
use kvroute_router::policy::DEFAULT_POLICY;

use super::Record;
use super::spread::{Aggregate, aggregate};

fn label(r: &Record) -> String {
    let mut s = r.policy.clone();
    if r.routers > 1 {
        s.push_str(&format!(" ×{} routers", r.routers));
    }
    // Other routers (`--peers`) have no sidecars to speak of.
    if !r.sidecars && !super::is_peer(&r.policy) {
        s.push_str(" (no sidecars)");
    }
    if let Some(c) = &r.router_config {
        let name = std::path::Path::new(c).file_stem().map_or(c.clone(), |n| n.to_string_lossy().into_owned());
        s.push_str(&format!(" [{name}]"));
    }
    s
}

/// The share of a run's requests served by its `--slow-engines` (the first
/// workers), or `None` in a homogeneous fleet.
fn slow_share(r: &Record) -> Option<f64> {
    if r.slow_engines == 0 {
        return None;
    }
    let total: u64 = r.per_worker.values().sum();
    let slow: u64 = (0..r.slow_engines).map(|i| r.per_worker.get(&super::worker_id(i)).copied().unwrap_or(0)).sum();
    Some(if total > 0 { slow as f64 / total as f64 } else { 0.0 })
}

/// The runs the default is judged against: one router each, kvroute's with
/// sidecars, and other routers (`--peers`) as they come.
fn baseline_runs<'a>(rs: &'a [&'a Record]) -> impl Iterator<Item = &'a Record> + 'a {
    rs.iter().copied().filter(|r| r.routers == 1 && (r.sidecars || super::is_peer(&r.policy)))
}

fn verdict(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

/// The expectations of issue 6 for one workload's runs, as table rows.
pub fn checks(workload: &str, rs: &[&Record]) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let Some(ca) = baseline_runs(rs).find(|r| r.policy == DEFAULT_POLICY) else { return rows };
    let others: Vec<&Record> = baseline_runs(rs).filter(|r| r.policy != DEFAULT_POLICY).collect();
    let mut row =
        |what: String, measured: String, ok: bool| rows.push(vec![workload.into(), what, measured, verdict(ok).into()]);
    let ratio = if ca.ceiling > 0.0 { ca.hit_rate / ca.ceiling } else { 0.0 };
    row(
        "hit rate ≥ 0.9 × ceiling".into(),
        format!("{:.3} / {:.3} = {ratio:.2}", ca.hit_rate, ca.ceiling),
        ratio >= 0.9,
    );
    if !others.is_empty() {
        let best_hit = others.iter().max_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate)).copied();
        if let Some(b) = best_hit {
            row(
                "best hit rate of all policies".into(),
                format!("{:.3} vs best baseline {} {:.3}", ca.hit_rate, b.policy, b.hit_rate),
                ca.hit_rate >= b.hit_rate,
            );
        }
        let best_ttft = others.iter().min_by(|a, b| a.ttft_p50_ms.total_cmp(&b.ttft_p50_ms)).copied();
        if let Some(b) = best_ttft {
            row(
                "best TTFT p50 of all policies".into(),
                format!("{} ms vs best baseline {} {} ms", ms(ca.ttft_p50_ms), b.policy, ms(b.ttft_p50_ms)),
                ca.ttft_p50_ms <= b.ttft_p50_ms,
            );
        }
    }
    if let Some(rr) = baseline_runs(rs).find(|r| r.policy == "round_robin") {
        let x = if rr.ttft_p50_ms > 0.0 { ca.ttft_p50_ms / rr.ttft_p50_ms } else { f64::INFINITY };
        row(
            "TTFT p50 ≤ 0.4 × round_robin".into(),
            format!("{} / {} ms = {x:.2}", ms(ca.ttft_p50_ms), ms(rr.ttft_p50_ms)),
            x <= 0.4,
        );
    }
    row("max/mean load ≤ 1.3".into(), format!("{:.2}", ca.max_mean_load), ca.max_mean_load <= 1.3);
    if let Some(two) = rs.iter().find(|r| r.policy == DEFAULT_POLICY && r.routers == 2 && r.sidecars) {
        let loss = ca.hit_rate - two.hit_rate;
        row(
            "2 replicas lose ≤ 2 % hit rate".into(),
            format!("{:.3} → {:.3} ({:+.1} points)", ca.hit_rate, two.hit_rate, -loss * 100.0),
            loss <= 0.02,
        );
    }
    if let Some(ns) = rs.iter().find(|r| r.policy == DEFAULT_POLICY && !r.sidecars) {
        rows.push(vec![
            workload.into(),
            "what sidecars buy (info)".into(),
            format!(
                "hit {:.3} without vs {:.3} with; TTFT p50 {} vs {} ms",
                ns.hit_rate,
                ca.hit_rate,
                ms(ns.ttft_p50_ms),
                ms(ca.ttft_p50_ms)
            ),
            "—".into(),
        ]);
    }
    rows
}

/// A figure's median over rounds with its range: `12.0 (10.0–30.0)`.
fn spread_cell(s: &super::spread::Spread, fmt: fn(f64) -> String) -> String {
    format!("{} ({}–{})", fmt(s.median), fmt(s.min), fmt(s.max))
}

/// The table of a workload and worker count run over several rounds: per
/// shape the median and range of hit rate and TTFT, the TTFT p50 range
/// relative to its median, and whether its p50 range clears the default
/// policy's (if not, the two are not told apart by this run).
fn rounds_table(agg: &[Aggregate]) -> String {
    let default = agg.iter().find(|a| a.median.policy == DEFAULT_POLICY && a.median.routers == 1 && a.median.sidecars);
    let hit = |x: f64| format!("{x:.3}");
    let rows: Vec<Vec<String>> = agg
        .iter()
        .map(|a| {
            let versus = match default {
                Some(d) if !std::ptr::eq(d, a) => format!(
                    "×{:.2}, {}",
                    if d.ttft_p50.median > 0.0 { a.ttft_p50.median / d.ttft_p50.median } else { f64::INFINITY },
                    if a.ttft_p50.overlaps(&d.ttft_p50) { "ranges overlap" } else { "apart" }
                ),
                _ => "—".into(),
            };
            vec![
                label(&a.median),
                a.rounds.to_string(),
                spread_cell(&a.hit, hit),
                spread_cell(&a.ttft_p50, ms),
                format!("{:.0} %", a.ttft_p50.relative_range() * 100.0),
                spread_cell(&a.ttft_p99, ms),
                versus,
                format!("{:.1}", a.median.throughput_rps),
                format!("{:.2}", a.median.max_mean_load),
                format!("{}/{}", a.median.errors, a.median.requests),
            ]
        })
        .collect();
    let mut md = String::from(
        "Median over rounds (min–max). Rounds interleave the policies (odd rounds in the listed order, even \
         rounds reversed). p50 range = (max − min) / median; vs default: median TTFT p50 over the default's, \
         and whether the two p50 ranges are apart (a difference beyond this run's round-to-round noise).\n\n",
    );
    md.push_str(&report::table(
        &[
            "policy",
            "rounds",
            "hit rate",
            "TTFT p50 ms",
            "p50 range",
            "TTFT p99 ms",
            "p50 vs default",
            "req/s",
            "max/mean load",
            "errors",
        ],
        &rows,
    ));
    md
}

pub fn markdown(records: &[Record], workloads: &[(String, String, Ceiling)], args: &CompareArgs) -> String {
    let mut md = String::from("# kvroute-bench compare\n\n");
    let (engines, fresh) = match args.engine.engine {
        EngineKind::Sim => ("kvroute-sim".to_owned(), "fresh cluster per run"),
        EngineKind::Vllm => (
            format!(
                "real vLLM (CPU build, tiny-qwen3 with random weights, blocks of {} tokens, `ignore_eos`)",
                EngineKind::Vllm.block_size()
            ),
            "engines started once per workload and worker count; before every run their prefix caches are \
             emptied (`/reset_prefix_cache`) and routers and sidecars started afresh",
        ),
    };
    md.push_str(&format!(
        "Machine: {}. Engines: {engines}. Mode: {}. Concurrency cap {} (open loop), {fresh}, KV blocks per engine \
         sized so the cluster holds 1.5 × the workload's working set.\n\n",
        report::machine(),
        if args.engine.engine == EngineKind::Vllm {
            "vLLM presets"
        } else if args.quick {
            "quick"
        } else {
            "full"
        },
        args.concurrency
    ));
    if args.slow_engines > 0 {
        md.push_str(&format!(
            "A mixed fleet: the first {} engine(s) ran {} × slower at every step (`--slow-engines`, \
             `--slow-factor`); \"on slow\" is the share of requests they served.\n\n",
            args.slow_engines, args.slow_factor
        ));
    }
    md.push_str(
        "Hit rate: Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total` summed over engines. \
                 Ceiling: one infinite cache, block-granular, in arrival order. TTFT: client-side, to the first \
                 streamed chunk. max/mean: requests served per worker.\n\n",
    );
    let mut checks_rows = Vec::new();
    for (name, description, ceiling) in workloads {
        md.push_str(&format!(
            "## {name}\n\n{description}. Ceiling {:.3}; working set {} blocks.\n\n",
            ceiling.rate(),
            ceiling.unique_blocks
        ));
        let mut worker_counts: Vec<usize> = records.iter().filter(|r| &r.workload == name).map(|r| r.workers).collect();
        worker_counts.sort();
        worker_counts.dedup();
        for n in worker_counts {
            let rs: Vec<&Record> = records.iter().filter(|r| &r.workload == name && r.workers == n).collect();
            let Some(first) = rs.first() else { continue };
            md.push_str(&match first.engine {
                EngineKind::Sim => {
                    format!(
                        "{n} workers, {} KV blocks each, engine time scale {}:\n\n",
                        first.num_blocks, first.time_scale
                    )
                }
                EngineKind::Vllm => format!("{n} real vLLM workers, {} KV blocks each:\n\n", first.num_blocks),
            });
            if rs.iter().any(|r| r.round > 1) {
                let agg = aggregate(&rs);
                md.push_str(&rounds_table(&agg));
                md.push('\n');
                let medians: Vec<&Record> = agg.iter().map(|a| &a.median).collect();
                checks_rows.extend(checks(&format!("{name} ({n} workers, median of rounds)"), &medians));
                continue;
            }
            let mixed = rs.iter().any(|r| r.slow_engines > 0);
            let rows: Vec<Vec<String>> = rs
                .iter()
                .map(|r| {
                    let mut row = vec![
                        label(r),
                        format!("{:.3}", r.hit_rate),
                        format!("{:.2}", if r.ceiling > 0.0 { r.hit_rate / r.ceiling } else { 0.0 }),
                        ms(r.ttft_p50_ms),
                        ms(r.ttft_mean_ms),
                        ms(r.ttft_p90_ms),
                        ms(r.ttft_p99_ms),
                        format!("{:.1}", r.throughput_rps),
                        format!("{:.2}", r.max_mean_load),
                        format!("{}/{}", r.errors, r.requests),
                    ];
                    if mixed {
                        row.push(slow_share(r).map_or("—".into(), |s| format!("{:.1} %", s * 100.0)));
                    }
                    row
                })
                .collect();
            let mut header = vec![
                "policy",
                "hit rate",
                "÷ ceiling",
                "TTFT p50 ms",
                "mean",
                "p90",
                "p99",
                "req/s",
                "max/mean load",
                "errors",
            ];
            if mixed {
                header.push("on slow");
            }
            md.push_str(&report::table(&header, &rows));
            md.push('\n');
            checks_rows.extend(checks(&format!("{name} ({n} workers)"), &rs));
        }
    }
    if !checks_rows.is_empty() {
        md.push_str("## Expectations\n\n");
        md.push_str(&report::table(&["workload", "expectation (default policy)", "measured", "verdict"], &checks_rows));
    }
    md
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn rec(policy: &str, hit: f64, p50: f64) -> Record {
        Record {
            round: 1,
            engine: EngineKind::Sim,
            workload: "w".into(),
            policy: policy.into(),
            workers: 4,
            routers: 1,
            sidecars: true,
            hit_rate: hit,
            ceiling: 0.8,
            ttft_p50_ms: p50,
            ttft_p90_ms: p50,
            ttft_p99_ms: p50,
            ttft_mean_ms: p50,
            latency_p50_ms: p50,
            throughput_rps: 1.0,
            max_mean_load: 1.1,
            requests: 10,
            errors: 0,
            per_worker: Default::default(),
            num_blocks: 1,
            time_scale: 1.0,
            wall_s: 1.0,
            router_config: None,
            router_queue_ms: None,
            slow_engines: 0,
            slow_factor: None,
        }
    }

    #[test]
    fn checks_compare_against_the_baselines() {
        let a = rec(DEFAULT_POLICY, 0.75, 10.0);
        let b = rec("round_robin", 0.2, 30.0);
        let rows = checks("w", &[&a, &b]);
        let verdicts: Vec<(&str, &str)> = rows.iter().map(|r| (r[1].as_str(), r[3].as_str())).collect();
        assert!(verdicts.contains(&("hit rate ≥ 0.9 × ceiling", "PASS")));
        assert!(verdicts.contains(&("TTFT p50 ≤ 0.4 × round_robin", "PASS")));
        let slow = rec(DEFAULT_POLICY, 0.75, 20.0);
        let rows = checks("w", &[&slow, &b]);
        assert!(rows.iter().any(|r| r[1] == "TTFT p50 ≤ 0.4 × round_robin" && r[3] == "FAIL"));
    }

    #[test]
    fn other_routers_are_baselines_and_named_without_sidecars() {
        let a = rec(DEFAULT_POLICY, 0.75, 10.0);
        let mut peer = rec("peer:smg_cache_aware", 0.7, 9.0);
        peer.sidecars = false;
        let mut variant = rec(DEFAULT_POLICY, 0.75, 8.0);
        variant.sidecars = false;
        let rows = checks("w", &[&a, &peer, &variant]);
        let best = rows.iter().find(|r| r[1] == "best TTFT p50 of all policies").unwrap();
        assert_eq!(best[3], "FAIL");
        assert!(best[2].contains("peer:smg_cache_aware"), "{}", best[2]);
        assert_eq!(label(&peer), "peer:smg_cache_aware");
        assert_eq!(label(&variant), format!("{DEFAULT_POLICY} (no sidecars)"));
    }

    #[test]
    fn a_mixed_fleet_reports_the_slow_engines_share() {
        #[derive(Debug, clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            args: CompareArgs,
        }
        let args = <Cmd as clap::Parser>::parse_from(["compare", "--slow-engines", "1", "--slow-factor", "2"]).args;
        let mut r = rec(DEFAULT_POLICY, 0.7, 10.0);
        r.slow_engines = 1;
        r.slow_factor = Some(2.0);
        r.per_worker = [(super::super::worker_id(0), 1), (super::super::worker_id(1), 3)].into_iter().collect();
        let ceiling = Ceiling { hit_tokens: 8, query_tokens: 10, unique_blocks: 1, max_prompt_blocks: 1 };
        let md = markdown(&[r], &[("w".into(), "d".into(), ceiling)], &args);
        assert!(md.contains("the first 1 engine(s) ran 2 × slower"), "{md}");
        assert!(md.contains("| on slow |"), "{md}");
        let row = md.lines().find(|l| l.starts_with(&format!("| {DEFAULT_POLICY} |"))).unwrap_or_default();
        assert!(row.ends_with("| 25.0 % |"), "{row}");
    }

    #[test]
    fn rounds_are_reported_as_median_and_range() {
        #[derive(Debug, clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            args: CompareArgs,
        }
        let args = <Cmd as clap::Parser>::parse_from(["compare", "--quick", "--rounds", "3"]).args;
        let mut records = Vec::new();
        for (round, (hit, p50)) in [(0.70, 12.0), (0.74, 10.0), (0.72, 30.0)].into_iter().enumerate() {
            for mut r in [rec(DEFAULT_POLICY, hit, p50), rec("round_robin", 0.2, 40.0 + round as f64)] {
                r.round = round + 1;
                records.push(r);
            }
        }
        let ceiling = Ceiling { hit_tokens: 8, query_tokens: 10, unique_blocks: 1, max_prompt_blocks: 1 };
        let md = markdown(&records, &[("w".into(), "d".into(), ceiling)], &args);
        let row = |policy: &str| md.lines().find(|l| l.starts_with(&format!("| {policy} |"))).unwrap_or_default();
        assert_eq!(
            row(DEFAULT_POLICY),
            format!(
                "| {DEFAULT_POLICY} | 3 | 0.720 (0.700–0.740) | 12.0 (10.0–30.0) | 167 % | 12.0 (10.0–30.0) | — | 1.0 | 1.10 | 0/30 |"
            )
        );
        assert!(row("round_robin").contains("| 41.0 (40.0–42.0) | 5 % |"), "{md}");
        assert!(row("round_robin").contains("×3.42, apart"), "{md}");
        assert_eq!(md.matches(&format!("| {DEFAULT_POLICY} |")).count(), 1, "one row per policy, not per round");
        assert!(md.contains("w (4 workers, median of rounds) | hit rate ≥ 0.9 × ceiling | 0.720 / 0.800"), "{md}");
    }
}
