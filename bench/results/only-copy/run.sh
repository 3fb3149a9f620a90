#!/usr/bin/env bash
# "Speculative copies are not a hot prefix; equal workers prefer the only
# copy" at process level (BENCHMARKS.md): the router built from cdbdf29
# (OLD) against ead48a8 (NEW; 95d553e is the same figures).
set -euo pipefail
OUT=${OUT:-bench/results/only-copy} exec scripts/ab-routers.sh
