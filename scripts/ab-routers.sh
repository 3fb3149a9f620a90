#!/usr/bin/env bash
# Two kvroute-router binaries compared at process level on one machine:
# `kvroute-bench compare` (4 simulated engines with sidecars, 2 exchanging
# router replicas unless ROUTERS says otherwise, the default policy), alternating OLD and NEW (A B A B) so
# that the machine's drift falls on both. The bench starts
# target/release/kvroute-router, so each run copies one in place; NEW is left
# there at the end.
#   OLD=path NEW=path OUT=dir [ROUNDS="1 2"] [ROUTERS=2] scripts/ab-routers.sh
set -euo pipefail
: "${OLD:?the router before the change}" "${NEW:?the router after it}" "${OUT:?where the reports go}"
B=target/release/kvroute-bench
for round in ${ROUNDS:-1 2}; do
  for which in old new; do
    bin=$OLD; [ "$which" = new ] && bin=$NEW
    cp "$bin" target/release/kvroute-router
    $B compare --policies predicted_ttft --workers 4 --routers "${ROUTERS:-2}" --no-variants --out "$OUT/$which-$round"
  done
done
