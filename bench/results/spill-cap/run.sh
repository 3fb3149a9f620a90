#!/usr/bin/env bash
# "The spill gate at 2.5 x the mean; a request gives up at most 300 ms" at
# process level: 4 simulated engines with sidecars, 2 router replicas
# exchanging (the bench's default), the default policy before the change
# (router built from 8bcbb3d) and after it (5f891c2), alternating A B A B
# on one machine (BENCHMARKS.md). OLD and NEW are the two kvroute-router
# binaries; the bench starts target/release/kvroute-router, so each round
# copies one in place.
set -euo pipefail
B=target/release/kvroute-bench
OUT=${OUT:-bench/results/spill-cap}
for round in ${ROUNDS:-1 2}; do
  for which in old new; do
    bin=$OLD; [ $which = new ] && bin=$NEW
    cp "$bin" target/release/kvroute-router
    $B compare --policies predicted_ttft --workers 4 --routers 2 --no-variants --out $OUT/$which-$round
  done
done
