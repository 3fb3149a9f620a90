#!/usr/bin/env bash
# "The spill gate at 2.5 x the mean; a request gives up at most 300 ms" at
# process level (BENCHMARKS.md): the router built from 8bcbb3d (OLD) against
# 5f891c2 (NEW), rounds 1-2 beside a CI run, 3-4 on a quiet machine
# (ROUNDS="3 4").
set -euo pipefail
OUT=${OUT:-bench/results/spill-cap} exec scripts/ab-routers.sh
