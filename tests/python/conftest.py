"""Shared fixtures: a local kvroute cluster started with the real binaries."""
import os
import pathlib
import queue
import signal
import subprocess
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bin_dir() -> pathlib.Path:
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug"


# The local cluster's banner: one line per process with its URL and metrics.
BANNER: "list[str]" = []


@pytest.fixture(scope="session")
def router_url():
    sim = _bin_dir() / "kvroute-sim"
    if not sim.exists():
        raise RuntimeError(f"{sim} is not built (scripts/test.sh builds it: cargo build --workspace --bins)")
    proc = subprocess.Popen(
        [str(sim), "cluster", "--port", "0", "--workers", "2", "--time-scale", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    seen = []
    url = None
    try:
        while url is None:
            line = lines.get(timeout=120)
            seen.append(line)
            if line.startswith(("router ", "engine ", "sidecar ")):
                BANNER.append(line)
            if line.startswith("Ctrl-C stops everything"):
                url = next(l.split()[2] for l in BANNER if l.startswith("router 1 "))
            if proc.poll() is not None:
                raise RuntimeError("cluster exited:\n" + "".join(seen))
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def cluster_banner(router_url):
    """The cluster's banner lines (one per process), once it is up."""
    return list(BANNER)
