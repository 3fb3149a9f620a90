#!/usr/bin/env bash
# The replicas' news at process level: 4 simulated engines with sidecars,
# 2 router replicas exchanging (the bench's clients alternate between them),
# the default policy with news every 10 ms (the default) and without it
# (replica_news_interval = 0s), alternating A B A B A B on one machine
# (BENCHMARKS.md, "News between the replicas' reports").
set -euo pipefail
B=target/release/kvroute-bench
OUT=${OUT:-bench/results/replica-news}
OFF=$(mktemp)
echo 'replica_news_interval = "0s"' > "$OFF"
for round in 1 2 3; do
  [ -e $OUT/on-$round/results.json ] || $B compare --policies predicted_ttft --workers 4 --routers 2 --no-variants --out $OUT/on-$round
  [ -e $OUT/off-$round/results.json ] || $B compare --policies predicted_ttft --workers 4 --routers 2 --no-variants --router-config "$OFF" --out $OUT/off-$round
done
