#!/usr/bin/env bash
# The lab against the process-level bench on every bench workload
# (BENCHMARKS.md, "Every bench workload, replayed from its export").
# Binaries built from f072320's sources (the bench runs were made with the
# same code before it was committed: "-dirty" in results.json).
set -euo pipefail
B=target/release/kvroute-bench
L=target/release/kvroute-lab
P=predicted_ttft,cache_aware,round_robin
OUT=${OUT:-/tmp/xc}
# 1. The bench's four workloads at their own time scales (x4; the trace x20), 3 interleaved rounds (20 min).
$B compare --policies $P --workers 4 --no-variants --rounds 3 --out $OUT/default-time-scales
# 2. chat, RAG and shared_prefix with the engines at the model's own speed (about 14 min).
for w in chat rag shared_prefix; do
  $B compare --workload $w --policies $P --workers 4 --no-variants --rounds 3 --time-scale 1 --out $OUT/time-scale-1-$w
done
# 3. The request path alone: the same workloads with engines that take no time (about 6 min).
for w in chat rag shared_prefix; do
  $B compare --workload $w --policies round_robin,predicted_ttft --workers 4 --no-variants --time-scale 100000 --out $OUT/instant-$w
done
$B compare --trace ../shared/testdata/traces/mooncake_synthetic_trace.jsonl --policies round_robin,predicted_ttft \
  --workers 4 --no-variants --time-scale 100000 --out $OUT/instant-trace
mkdir -p $OUT/instant-all/requests && cp $OUT/instant-*/requests/*_r1.jsonl $OUT/instant-all/requests/
# 4. Two router replicas (the bench's clients alternate between them), 2 rounds (13 min).
$B compare --policies $P --workers 4 --routers 2 --no-variants --rounds 2 --out $OUT/two-routers
# 5. The lab's replays: no path, one linear path model, and each request's measured path.
for d in $OUT/default-time-scales $OUT/time-scale-1-* $OUT/two-routers; do
  $L crosscheck $d --json $d/crosscheck.json --requests-out $d/lab > $d/crosscheck.md
  $L crosscheck $d --path-us 1945 --path-ns-per-token 390 --json $d/crosscheck-path.json > $d/crosscheck-path.md
  $L crosscheck $d --path-from $OUT/instant-all --json $d/crosscheck-measured-path.json > $d/crosscheck-measured-path.md
done
