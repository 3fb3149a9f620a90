"""The compose bring-up, for real: compose.yaml's sim profile run by a Docker
engine, with the kvroute image built offline (scripts/docker-images.sh, from
the binaries scripts/test.sh built).

Five containers and two namespace holders: the router, two simulated workers
and their sidecars, each sidecar in its worker's network namespace. Then what
the README promises: a curl through the router's published port, stickiness,
both workers confirmed by their sidecars, a killed worker ejected and its
requests rerouted, the worker restarted and re-admitted with its sidecar, and
everything stopped cleanly.

Needs a Docker engine, docker-compose (1.29, Debian's) or the compose v2
plugin, and debootstrap: scripts/test.sh runs scripts/docker-engine.sh, which
installs them as root with apt and starts dockerd. Without them this test
fails, saying so. Test traffic goes only to ports published on 127.0.0.1
(host port 0: Docker picks free ones).
"""
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = f"kvroute-test-{os.getpid()}"
IMAGE = f"kvroute:test-{os.getpid()}"
MODEL = "sim-model"
WORKERS = {"worker-1": "sim-1", "worker-2": "sim-2"}
# What `--profile sim` runs: the router, two sim workers, their sidecars and
# the two network-namespace holders.
SERVICES = {"worker-1-net", "worker-2-net", "sim-1", "sim-2", "sim-sidecar-1", "sim-sidecar-2", "sim-router"}
# Every wait is bounded: a stuck bring-up fails the test instead of hanging CI.
UP_DEADLINE_S = 180
CHANGE_DEADLINE_S = 60


def _bin_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"


def _compose_cmd() -> list:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("neither docker-compose nor the docker compose plugin is installed: run scripts/docker-engine.sh "
                "(as root it installs Debian's docker.io, docker-compose and debootstrap and starts dockerd)")


def _run(cmd: list, env=None, timeout=300) -> str:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def _until(what: str, check, deadline_s: float):
    """Polls `check` until it returns something truthy; fails after the deadline."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            last = check()
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {deadline_s} s (last: {last!r})")


class Cluster:
    def __init__(self, compose: list, env: dict, env_file: pathlib.Path):
        self.base = compose + ["--env-file", str(env_file), "-p", PROJECT, "-f", str(ROOT / "compose.yaml"),
                               "--profile", "sim"]
        self.env = env
        self.router = None

    def compose(self, *args, timeout=300) -> str:
        return _run(self.base + list(args), env=self.env, timeout=timeout)

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).strip()
        assert cid, f"no container for {service}"
        return cid

    def inspect(self, service: str) -> dict:
        return json.loads(_run(["docker", "inspect", self.container(service)]))[0]

    def http(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.router + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")

    def complete(self, prompt: str):
        status, headers, body = self.http("POST", "/v1/completions",
                                          {"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert status == 200, body
        return headers.get("x-kvroute-worker"), body

    def workers(self) -> dict:
        return {w["id"]: w for w in self.http("GET", "/admin/workers")[2]["workers"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("no Docker engine answers: run scripts/docker-engine.sh (as root it installs Debian's docker.io, "
                    "docker-compose and debootstrap and starts dockerd)")
    compose = _compose_cmd()
    bins = _bin_dir()
    if not (bins / "kvroute-router").exists():
        pytest.fail(f"{bins}/kvroute-router is not built (scripts/test.sh builds it: cargo build --workspace --bins)")
    _run([str(ROOT / "scripts/docker-images.sh"), "--binaries", str(bins), "--tag", IMAGE], timeout=900)

    # Our own env file, so that a developer's .env cannot change the test; the
    # process environment (which compose prefers) carries the same values.
    values = {
        "KVROUTE_INTERNAL_TOKEN": secrets.token_hex(16),
        "KVROUTE_IMAGE": IMAGE,
        "SERVED_MODEL_NAME": MODEL,
        # Host port 0: Docker picks a free one (no fixed ports).
        "ROUTER_PORT": "0",
        "VLLM_1_HOST_PORT": "0",
        "VLLM_2_HOST_PORT": "0",
        "SIDECAR_1_HOST_PORT": "0",
        "SIDECAR_2_HOST_PORT": "0",
        "SIM_TIME_SCALE": "20",
        "KVROUTE_LOG": "info",
    }
    env_file = tmp_path_factory.mktemp("compose") / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    env = {**os.environ, **values}
    c = Cluster(compose, env, env_file)
    try:
        c.compose("up", "-d", "--no-build", timeout=UP_DEADLINE_S)
        def all_healthy():
            states = {}
            for s in SERVICES:
                st = c.inspect(s)["State"]
                states[s] = st.get("Health", {}).get("Status", st["Status"])
            return states if all(v in ("healthy", "running") for v in states.values()) else None

        c.states = _until("every container healthy", all_healthy, UP_DEADLINE_S)
        port = c.compose("port", "sim-router", "8080").strip()
        host, _, number = port.rpartition(":")
        assert host == "127.0.0.1", f"the router is published on {port}, not only on loopback"
        c.router = f"http://127.0.0.1:{number}"
        yield c
    finally:
        logs = ""
        try:
            logs = c.compose("logs", "--no-color", "--tail", "40", timeout=60)
        except AssertionError as e:
            logs = str(e)
        down = subprocess.run(c.base + ["down", "-v", "--remove-orphans", "--timeout", "10"], env=env,
                              capture_output=True, text=True, timeout=180)
        left = _run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"]).split()
        subprocess.run(["docker", "image", "rm", "-f", IMAGE], capture_output=True)
        print(logs)
        assert down.returncode == 0, f"compose down failed:\n{down.stdout}\n{down.stderr}"
        assert not left, f"containers left after compose down: {left}"


def test_every_service_runs_and_each_sidecar_shares_its_workers_namespace(cluster):
    running = set(cluster.compose("ps", "--services", "--filter", "status=running").split())
    assert running == SERVICES, f"running {running}, expected {SERVICES}"
    for n in ("1", "2"):
        holder = cluster.container(f"worker-{n}-net")
        for service in (f"sim-{n}", f"sim-sidecar-{n}"):
            mode = cluster.inspect(service)["HostConfig"]["NetworkMode"]
            assert mode == f"container:{holder}", f"{service} runs in {mode}, not worker-{n}'s namespace"


def test_the_readme_curl_is_answered_through_the_router(cluster):
    # README: curl -s localhost:8080/v1/completions ... -d '{"model":…,"prompt":"You are a helpful assistant. Hello!"…}'
    worker, body = cluster.complete("You are a helpful assistant. Hello!")
    assert worker in WORKERS, worker
    assert body["choices"][0]["text"], body


PROMPT = ("You are kvroute's compose test. The following document is long enough to fill several KV blocks "
          "so that the router has a prefix to stick to. " * 4)


def _holder(cluster) -> str:
    served = {cluster.complete(PROMPT)[0] for _ in range(6)}
    assert len(served) == 1, f"the same prompt went to {served}: no stickiness"
    return served.pop()


def test_requests_stick_and_both_workers_are_confirmed_by_their_sidecars(cluster):
    holder = _holder(cluster)

    def confirmed():
        ws = cluster.workers()
        ok = (set(ws) == set(WORKERS)
              and all(w["healthy"] and w["sidecar"] and w["index_mode"] == "exact" for w in ws.values())
              and ws[holder]["index"]["confirmed"] > 0)
        return ws if ok else None

    ws = _until("both workers sidecar-confirmed, the holder's keys confirmed", confirmed, CHANGE_DEADLINE_S)
    assert all(w["source"] == "sidecar" for w in ws.values()), ws


def test_a_killed_worker_is_ejected_rerouted_and_readmitted_when_restarted(cluster):
    holder = _holder(cluster)
    other = next(w for w in WORKERS if w != holder)
    service = WORKERS[holder]
    _run(["docker", "kill", cluster.container(service)])

    _until(f"{holder} ejected", lambda: not cluster.workers().get(holder, {}).get("healthy", False),
           CHANGE_DEADLINE_S)
    for _ in range(3):
        assert cluster.complete(PROMPT)[0] == other, "a request went to the killed worker"

    cluster.compose("start", service)

    def readmitted():
        w = cluster.workers().get(holder)
        return w if w and w["healthy"] and w["sidecar"] and w["index_mode"] == "exact" else None

    _until(f"{holder} re-admitted", readmitted, CHANGE_DEADLINE_S)
    # Its sidecar (not restarted: it shares the namespace's holder, not the
    # worker) follows the new engine: a prompt only the restarted worker has
    # seen is confirmed in its index.
    sidecar = f"sim-sidecar-{service[-1]}"
    assert cluster.inspect(sidecar)["RestartCount"] == 0

    def served_by_restarted():
        before = cluster.workers()[holder]["index"]["confirmed"]
        fresh = f"a prompt for the restarted worker {secrets.token_hex(8)} " * 6
        w, _ = cluster.complete(fresh)
        return before if w == holder else None

    # The router may place a new prompt on either worker; a few tries land one
    # on the restarted worker. The keys its sidecar then confirms can only come
    # from the new engine's events: the old engine is gone.
    before = _until(f"a new prompt served by {holder}", served_by_restarted, CHANGE_DEADLINE_S)
    _until(f"{holder}'s sidecar confirms keys of the restarted engine",
           lambda: cluster.workers()[holder]["index"]["confirmed"] > before, CHANGE_DEADLINE_S)
