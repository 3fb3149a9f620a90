#!/usr/bin/env bash
# "Speculative copies are not a hot prefix; equal workers prefer the only
# copy" at process level: 4 simulated engines with sidecars, 2 router
# replicas exchanging (the bench's default), the default policy before the
# change (router built from cdbdf29) and after it (ead48a8; 95d553e is the
# same figures), alternating A B A B on one machine (BENCHMARKS.md).
# OLD and NEW are the two kvroute-router binaries; the bench starts
# target/release/kvroute-router, so each round copies one in place.
set -euo pipefail
B=target/release/kvroute-bench
OUT=${OUT:-bench/results/only-copy}
for round in 1 2; do
  for which in old new; do
    bin=$OLD; [ $which = new ] && bin=$NEW
    cp "$bin" target/release/kvroute-router
    $B compare --policies predicted_ttft --workers 4 --routers 2 --no-variants --out $OUT/$which-$round
  done
done
