#!/usr/bin/env bash
# kvroute's test suite: what the README tells newcomers to run and what CI runs.
#
# 1. builds the binaries once (the end-to-end tests start them);
# 2. installs the Python test environment: real vLLM (CPU build) and the test
#    clients in target/vllm-venv (scripts/install-vllm.sh; idempotent, a few
#    minutes and ~6 GB the first time), and
# 3. makes sure a Docker engine runs (scripts/docker-engine.sh: as root it
#    installs Debian's docker.io + docker-compose + debootstrap and starts
#    dockerd), both in the background while the Rust tests compile;
# 4. Rust unit, property, golden and end-to-end tests;
# 5. Python tests in that venv: the vLLM plugin, the openai client through a
#    simulated cluster, the deployment files, compose.yaml brought up for real
#    in Docker (tests/python/test_compose.py, image built offline), and the
#    real-vLLM tier (tests/vllm: kvroute in front of real vLLM engines,
#    simulator conformance).
#
# Nothing is skipped silently: a step that cannot run counts as a failure, and
# the last line is `N passed, N failed, N skipped` over everything.
set -uo pipefail
cd "$(dirname "$0")/.."

out=$(mktemp -d)
broken=()
# Each phase says when it started (minutes:seconds since the start): where a
# newcomer's time goes.
phase() { printf '== %s (at %d:%02d)\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

phase "build"
if ! cargo build --workspace --bins; then
  broken+=(--broken "cargo build")
fi

# The two installs are mostly downloads (several GB from PyPI; Debian's
# packages): they run in the background while the Rust tests compile, and
# their output follows once they are done.
phase "Python test environment (real vLLM) and container engine, in the background"
scripts/install-vllm.sh > "$out/install-vllm.log" 2>&1 &
vllm_pid=$!
# Installs Debian's docker.io, docker-compose and debootstrap when run as root
# and starts dockerd (otherwise says what to install, and
# tests/python/test_compose.py then fails too), then makes the compose test's
# Debian base image (debootstrap, about a minute the first time).
{ scripts/docker-engine.sh && scripts/docker-images.sh --base-only; } > "$out/docker-engine.log" 2>&1 &
docker_pid=$!

phase "Rust tests: compiling"
if ! cargo test --workspace --no-run; then
  broken+=(--broken "cargo test --no-run (the test binaries did not build)")
fi

phase "Python test environment (real vLLM): waiting for it"
wait "$vllm_pid"
vllm_status=$?
cat "$out/install-vllm.log"
if [ "$vllm_status" -eq 0 ]; then
  export KVROUTE_PYTHON=$PWD/target/vllm-venv/bin/python
else
  broken+=(--broken "scripts/install-vllm.sh (real vLLM and the Python test clients)")
fi

phase "container engine (the compose bring-up test): waiting for it"
wait "$docker_pid"
docker_status=$?
cat "$out/docker-engine.log"
if [ "$docker_status" -ne 0 ]; then
  broken+=(--broken "scripts/docker-engine.sh and docker-images.sh --base-only (a Docker engine, docker-compose, debootstrap and the base image)")
fi

phase "Rust tests"
cargo test --workspace --no-fail-fast 2>&1 | tee "$out/cargo.txt"
# A test binary that crashed (a signal, an abort, the OOM killer) or did not
# link prints no `test result:` line: the summary counts such binaries, and
# cargo's own status, as failures.
cargo_status=${PIPESTATUS[0]}

phase "Python tests"
junit=()
if [ -n "${KVROUTE_PYTHON:-}" ]; then
  # The venv's bin first: tools installed there (hadolint) are found.
  PATH="$(dirname "$KVROUTE_PYTHON"):$PATH" "$KVROUTE_PYTHON" -m pytest -q -rs -p no:cacheprovider --durations=10 \
    --junitxml="$out/python.xml" python-hooks/tests tests/python tests/vllm
  junit=(--junit "$out/python.xml" --pytest-status "$?")
fi

phase "summary"
python3 scripts/test_summary.py --cargo "$out/cargo.txt" --cargo-status "$cargo_status" "${junit[@]}" "${broken[@]}"
