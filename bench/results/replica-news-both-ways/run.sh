#!/usr/bin/env bash
# News both ways over one replica link (the bench links 2 routers one way:
# the second lists the first): the trace, the default policy with news every
# 10 ms (the default) and without (replica_news_interval = 0s), alternating
# A B A B A B on one machine (BENCHMARKS.md, "News between the replicas'
# reports"). Binaries built from 6bd22ae.
set -euo pipefail
B=target/release/kvroute-bench
OUT=${OUT:-bench/results/replica-news-both-ways}
OFF=$(mktemp)
echo 'replica_news_interval = "0s"' > "$OFF"
for round in 1 2 3; do
  [ -e $OUT/on-$round/results.json ] || $B compare --workload trace --policies predicted_ttft --workers 4 --routers 2 --no-variants --out $OUT/on-$round
  [ -e $OUT/off-$round/results.json ] || $B compare --workload trace --policies predicted_ttft --workers 4 --routers 2 --no-variants --router-config "$OFF" --out $OUT/off-$round
done
