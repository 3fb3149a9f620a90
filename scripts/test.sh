#!/usr/bin/env bash
# kvroute's test suite: what the README tells newcomers to run and what CI runs.
# Rust unit, property, golden and end-to-end tests, then the Python tests
# (the vLLM plugin, the openai client through a live cluster, deployment files).
set -euo pipefail
cd "$(dirname "$0")/.."

# End-to-end tests start the real binaries: build them first, once.
cargo build --workspace --bins
cargo test --workspace --no-fail-fast

if ! python3 -c "import pytest" 2>/dev/null; then
  echo "SKIPPED: python tests (pytest is not installed: pip install pytest pyzmq msgpack openai pyyaml)" >&2
  exit 0
fi
dirs=()
for d in python-hooks/tests tests/python; do
  [ -d "$d" ] && dirs+=("$d")
done
python3 -m pytest -q "${dirs[@]}"
