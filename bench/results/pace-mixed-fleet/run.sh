#!/bin/bash
# How bench/results/pace-mixed-fleet was made (2026-11-25): the default policy
# with its measured pace on and off (pace-off.toml), alternating run by run,
# 3 rounds each, 4 simulated workers of which the first (w1) is 2 x slower.
# Run from the repo root after `cargo build --release --workspace`.
set -euo pipefail
OUT=${OUT:-bench-out/pace}
OFF=bench/results/pace-mixed-fleet/pace-off.toml
T=../shared/testdata/traces/mooncake_synthetic_trace.jsonl
SLOW="--workers 4 --no-variants --slow-engines 1 --slow-factor 2"
run() { # name, compare arguments...
  local name=$1; shift
  target/release/kvroute-bench compare "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
}
mkdir -p "$OUT"
for w in trace chat rag; do
  if [ $w = trace ]; then W="--trace $T --skip 3200 --limit 600 --speedup 2 --time-scale 4"; else W="--workload $w"; fi
  for round in 1 2 3; do
    run $w-on-$round $W $SLOW --policies predicted_ttft
    run $w-off-$round $W $SLOW --policies predicted_ttft --router-config $OFF
  done
  run $w-base $W $SLOW --policies round_robin,least_loaded
done
