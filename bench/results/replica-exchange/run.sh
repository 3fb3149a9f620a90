#!/usr/bin/env bash
# Router replicas' exchange at process level: 4 simulated engines with
# sidecars, 2 router replicas (the bench's clients alternate between them),
# the default policy with the exchange (the bench's default) and without,
# alternating A B A B A B on one machine (BENCHMARKS.md, "Router replicas
# exchange what they have in flight"). Binaries built from 835a69f (the
# commit after it changes only when the hints are rebuilt and that a router
# keeps its requests for reports only once it exchanges with someone).
set -euo pipefail
B=target/release/kvroute-bench
OUT=${OUT:-bench/results/replica-exchange}
for round in 1 2 3; do
  [ -e $OUT/on-$round/results.json ] || $B compare --policies predicted_ttft --workers 4 --routers 2 --no-variants --out $OUT/on-$round
  $B compare --policies predicted_ttft --workers 4 --routers 2 --no-variants --no-replica-exchange --out $OUT/off-$round
done
