#!/usr/bin/env bash
# Make sure a Docker engine answers and docker-compose is installed, for the
# compose bring-up test (tests/python/test_compose.py) and for
# scripts/docker-images.sh.
#
# - Engine already up (`docker info` works): nothing to do.
# - Otherwise, as root on Debian/Ubuntu: installs Debian's `docker.io`,
#   `docker-compose` (1.29; the compose v2 plugin works too) and `debootstrap`
#   with apt, then starts `dockerd` in the background (its log in
#   target/dockerd.log) and waits until it answers. CI runs this on a fresh
#   machine. No registry but Debian's is needed.
# - Otherwise: fails, saying what to install.
#
# Exits non-zero when no engine can be had; the caller counts that as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

have_compose() {
  command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1
}

if docker info >/dev/null 2>&1 && have_compose && command -v debootstrap >/dev/null 2>&1; then
  exit 0
fi

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  cat >&2 <<'MSG'
docker-engine.sh: no Docker engine answers (or docker-compose/debootstrap is missing).
Install and start one, then run again, e.g. on Debian/Ubuntu as root:
  apt-get install -y docker.io docker-compose debootstrap && dockerd &
(or run scripts/test.sh as root, which does exactly that).
MSG
  exit 1
fi

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
have_compose || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "docker-engine.sh: installing ${need[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  mkdir -p target
  echo "docker-engine.sh: starting dockerd (log: target/dockerd.log)"
  # setsid: the daemon outlives this script and the test run's process group.
  setsid dockerd >target/dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    echo "docker-engine.sh: dockerd did not answer within 60 s; its log:" >&2
    tail -n 20 target/dockerd.log >&2
    exit 1
  fi
fi
docker version --format 'docker-engine.sh: engine {{.Server.Version}}, client {{.Client.Version}}'
