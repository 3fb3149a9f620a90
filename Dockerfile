# syntax=docker/dockerfile:1
#
# kvroute: one image, three binaries. Each service picks its binary as the
# command (compose `command:`, Kubernetes `command:`); there is no entrypoint
# script.
#   kvroute-router   the OpenAI-compatible router          (EXPOSE 8080)
#   kvroute-sidecar  beside each vLLM worker: events → router (EXPOSE 9100)
#   kvroute-sim      a simulated vLLM for the no-GPU profile (EXPOSE 8000 5557 5558)
#
# Build: docker build -t kvroute:local .

ARG RUST_VERSION=1
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the target dir between builds (BuildKit);
# the binaries are copied out inside the same step because a cache mount is not
# part of the image. `--locked`: build exactly what Cargo.lock says.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
        -p kvroute-router -p kvroute-sidecar -p kvroute-sim \
    && mkdir -p /out \
    && cp target/release/kvroute-router target/release/kvroute-sidecar target/release/kvroute-sim /out/ \
    # The release profile keeps debug info for profiling; the image does not
    # need it (symbols stay: backtraces still name functions).
    && strip --strip-debug /out/*

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
# curl is the container healthcheck tool (compose `healthcheck:` runs
# `curl -fsS http://127.0.0.1:PORT/health`): slim has none, the binaries have no
# self-check subcommand, and a /dev/tcp shell one-liner cannot tell a 503 from a
# 200 reliably. It costs a few MB; Kubernetes does not need it (httpGet probes).
# The binaries themselves need only glibc and libgcc (TLS is rustls, built in:
# `--tls-cert`/`--tls-ca` when router ⇄ worker ⇄ sidecar traffic leaves a
# trusted network; plain HTTP inside the cluster otherwise).
# Versions are not pinned so that a rebuild picks up Debian security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvroute \
    && useradd --system --uid 10001 --gid kvroute --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvroute
COPY --from=builder /out/ /usr/local/bin/
# Numeric so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
ENV RUST_LOG=info KVROUTE_LOG=info
# router, sidecar (/health, /metrics), sim HTTP, sim KV events PUB, sim replay
EXPOSE 8080 9100 8000 5557 5558
CMD ["kvroute-router", "--help"]
