#!/usr/bin/env bash
# "Near-ties: the sole router takes the best, a replica the better of two
# hashed" at process level (BENCHMARKS.md): the router built from 09650f1
# (OLD) against the change (NEW), one router (the sole router's path) in
# front of 4 simulated engines with sidecars, alternated A B A B.
set -euo pipefail
OUT=${OUT:-bench/results/sole-router} ROUTERS=${ROUTERS:-1} exec scripts/ab-routers.sh
