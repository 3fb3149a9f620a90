#!/usr/bin/env bash
# Build kvroute's container image with no registry but Debian's packages and
# the binaries built here: for machines where Docker Hub is out of reach (CI,
# air-gapped clusters). With registry access, `docker build .` (the root
# Dockerfile, a multi-stage build from rust:bookworm) is the ordinary path.
#
#   scripts/docker-images.sh [--binaries DIR] [--tag IMAGE] [--base-tag IMAGE] [--base-only]
#
# 1. The base image (default kvroute-base:bookworm): a Debian bookworm root
#    file system made by `debootstrap --variant=minbase` with curl (the compose
#    healthchecks) and ca-certificates, from $DEBIAN_MIRROR (default
#    http://deb.debian.org/debian, the mirror apt uses), imported with
#    `docker import`. Made once; an existing image of that tag is reused
#    (`--rebuild-base` makes it again). `--base-only` stops here
#    (scripts/test.sh makes it in the background while tests compile).
# 2. The kvroute image (default kvroute:local, what compose.yaml runs): the
#    base plus kvroute-router, kvroute-sidecar and kvroute-sim from --binaries
#    (default target/release, built with `cargo build --release` when absent),
#    by deploy/docker/Dockerfile.prebuilt with the classic builder (BuildKit's
#    `# syntax` line would fetch a frontend image from Docker Hub).
#
# The binaries link only glibc and libgcc: build them on bookworm (or an older
# glibc) so that they run on the bookworm base.
set -euo pipefail
cd "$(dirname "$0")/.."

binaries=target/release
tag=${KVROUTE_IMAGE:-kvroute:local}
base=kvroute-base:bookworm
rebuild_base=0
base_only=0
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
while [ $# -gt 0 ]; do
  case "$1" in
    --binaries) binaries=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --base-tag) base=$2; shift 2 ;;
    --rebuild-base) rebuild_base=1; shift ;;
    --base-only) base_only=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "docker-images.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
bins=(kvroute-router kvroute-sidecar kvroute-sim)

work=target/docker
mkdir -p "$work"

if [ "$rebuild_base" = 1 ] || ! docker image inspect "$base" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { echo "docker-images.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
  rootfs=$(mktemp -d "$PWD/$work/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "docker-images.sh: debootstrap bookworm from $mirror (about a minute)"
  debootstrap --variant=minbase --include=curl,ca-certificates bookworm "$rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
  # What an image does not need: apt's lists and caches, docs, man pages.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
  tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  echo "docker-images.sh: base image $base"
fi
[ "$base_only" = 1 ] && exit 0

missing=0
for b in "${bins[@]}"; do [ -x "$binaries/$b" ] || missing=1; done
if [ "$missing" = 1 ]; then
  if [ "$binaries" = target/release ]; then
    cargo build --release --locked --bins -p kvroute-router -p kvroute-sidecar -p kvroute-sim
  else
    echo "docker-images.sh: $binaries lacks one of ${bins[*]} (cargo build --bins first)" >&2
    exit 1
  fi
fi

# A context of its own: only the binaries, not the repository and its target/.
ctx="$work/context"
rm -rf "$ctx" && mkdir -p "$ctx/bin"
for b in "${bins[@]}"; do
  # Debug info stays on the host (the release profile keeps it for profiling);
  # symbols stay, so backtraces still name functions.
  if command -v strip >/dev/null; then
    strip --strip-debug -o "$ctx/bin/$b" "$binaries/$b"
  else
    cp "$binaries/$b" "$ctx/bin/$b"
  fi
done
cp deploy/docker/Dockerfile.prebuilt "$ctx/Dockerfile"
DOCKER_BUILDKIT=0 docker build -q --build-arg "BASE=$base" -t "$tag" "$ctx" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; exit 1; }
rm -rf "$ctx"
echo "docker-images.sh: image $tag (binaries from $binaries)"
