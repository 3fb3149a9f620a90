"""Processes for the real-vLLM tier: vLLM engines (scripts/vllm-serve.sh),
kvroute sidecars and routers (the debug binaries), each in its own process
group, with its output kept in a log file that failures print.

Ports: kvroute's binaries bind port 0 and print `listening on URL`, which is
read back. vLLM cannot report a port it chose (its API socket, its ZMQ event
and replay endpoints and the plugin's snapshot socket all take a number), so
for vLLM free ports are found and passed in. They are drawn below the
kernel's ephemeral range (32768+), where vLLM's own internal sockets and every
other bind(0) land: under data parallelism vLLM and the plugin also bind
port + rank, which an ephemeral port handed out meanwhile could take.
"""

import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable, List, Optional, TypeVar

import msgpack
import requests
import zmq

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
BIN = TARGET / "debug"
MODEL = "tiny-qwen3"
# The cluster's engines' --default-chat-template-kwargs, given to its router
# too: chats are rendered without thinking unless a request asks for it.
CHAT_DEFAULTS = '{"enable_thinking": false}'
# A second --served-model-name of the cluster's engines: vLLM caches the
# model's blocks whichever name a request gives.
ALIAS = "tiny-qwen3-alias"
BLOCK_SIZE = 32
TOKEN = "real-vllm-tier-internal-token"
# Engines start in 1–2 minutes on an idle 2-core machine; CI may be busier.
ENGINE_START_TIMEOUT = float(os.environ.get("KVROUTE_VLLM_START_TIMEOUT", "600"))

T = TypeVar("T")


def binary(name: str) -> pathlib.Path:
    path = BIN / name
    if not path.exists():
        raise RuntimeError(f"{path} is not built: run `cargo build --workspace --bins` (scripts/test.sh does)")
    return path


def tiny_model() -> pathlib.Path:
    out = subprocess.run([str(ROOT / "scripts" / "tiny-model.sh")], check=True, capture_output=True, text=True)
    return pathlib.Path(out.stdout.strip().splitlines()[-1])


_rng = __import__("random").Random()


def free_port(span: int = 1) -> int:
    """A port P in 20000–32000 with P … P+span-1 all free right now: below
    the ephemeral range, so that while vLLM loads its model (tens of
    seconds before it binds) no `bind(0)` elsewhere, nor a client's own
    source port, takes it. Bound and released here: nothing is fixed."""
    for _ in range(1000):
        p = _rng.randrange(20000, 32000 - span)
        try:
            for q in range(p, p + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        return p
    raise RuntimeError("no free port range below the ephemeral ports")


def eventually(what: str, timeout: float, probe: Callable[[], Optional[T]], every: float = 0.2) -> T:
    """Polls `probe` until it returns something other than None."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got is not None:
                return got
        except (requests.RequestException, zmq.ZMQError) as e:
            last_error = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error})")


class Proc:
    """A child process in its own group, output to a log file."""

    def __init__(self, name: str, cmd: List[str], env: Optional[dict] = None):
        self.name = name
        self.cmd = cmd
        self.env = env
        self.log_path = pathlib.Path(tempfile.mkstemp(prefix=f"kvroute-{name}-", suffix=".log")[1])
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        # A restarted process appends to the same log: what it announces
        # is read from here on, not the previous process's lines.
        self.log_start = self.log_path.stat().st_size
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=ROOT
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def announced_url(self, timeout: float = 60) -> str:
        """The URL of this process's `listening on URL` line (the current
        process's, after a restart)."""

        def probe():
            self.check_alive()
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                lines = f.read().decode(errors="replace").splitlines()
            for line in lines:
                if line.startswith("listening on "):
                    return line.split(" on ", 1)[1].strip()
            return None

        return eventually(f"{self.name} to listen", timeout, probe)


class Engine:
    """One real vLLM (tiny Qwen3, random weights) with KV events and the plugin."""

    def __init__(self, name: str, num_blocks: int, extra: Optional[List[str]] = None):
        self.name = name
        self.num_blocks = num_blocks
        self.extra = extra or []
        ranks = 1
        if "--data-parallel-size" in self.extra:
            ranks = int(self.extra[self.extra.index("--data-parallel-size") + 1])
        # Each of these is a base that rank r offsets by r.
        self.port, self.events, self.replay, self.snapshot = (free_port(ranks) for _ in range(4))
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(f"vllm-{name}", self._cmd())

    def _cmd(self) -> List[str]:
        cmd = [
            str(ROOT / "scripts" / "vllm-serve.sh"),
            "--port", str(self.port),
            "--events-port", str(self.events),
            "--replay-port", str(self.replay),
            "--snapshot-port", str(self.snapshot),
            "--num-blocks", str(self.num_blocks),
            "--block-size", str(BLOCK_SIZE),
        ]
        return cmd + (["--"] + self.extra if self.extra else [])

    def wait_ready(self) -> None:
        def probe():
            self.proc.check_alive()
            r = requests.get(f"{self.url}/health", timeout=2)
            return True if r.status_code == 200 else None

        eventually(f"vLLM {self.name} to serve", ENGINE_START_TIMEOUT, probe, every=1.0)

    def restart(self) -> None:
        self.proc.stop()
        self.proc.start()
        self.wait_ready()

    def snapshot_hashes(self, rank: int = 0) -> set:
        """The plugin's answer: the engine's cached block hashes right now."""
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(f"tcp://127.0.0.1:{self.snapshot + rank}")
        try:
            s.send(msgpack.packb({"op": "snapshot"}))
            reply = msgpack.unpackb(s.recv(), raw=False)
        finally:
            s.close()
        assert reply["ok"], reply
        return set(reply["hashes"])

    def replay_all(self, rank: int = 0) -> List[list]:
        """Every buffered event batch since the engine started (vLLM's replay
        socket, from seq 0), as decoded payloads [ts, events, dp_rank]."""
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(f"tcp://127.0.0.1:{self.replay + rank}")
        batches = []
        try:
            s.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                frames = s.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == -1:
                    return batches
                batches.append(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False))
        finally:
            s.close()

    def metric(self, name: str) -> float:
        return metric_sum(self.url, name)


def metric_sum(base_url: str, name: str, label: str = "") -> float:
    """A Prometheus metric from `base_url/metrics`, summed over its label sets
    (those containing `label`, e.g. `engine="1"`, when given)."""
    text = requests.get(f"{base_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line
    )


def _u64(h) -> int:
    return h if isinstance(h, int) and h >= 0 else (h & (2**64 - 1) if isinstance(h, int) else int.from_bytes(h[-8:], "big"))


def kvroute_root(model: str, salt: str = "") -> bytes:
    """DESIGN.md §1, written again here, independently of the Rust code."""
    return hashlib.sha256(b"kvroute/root/v1" + model.encode() + b"\x00" + salt.encode()).digest()[:8]


def kvroute_key(parent: bytes, tokens: List[int]) -> bytes:
    data = b"kvroute/block/v1" + parent + b"".join(t.to_bytes(4, "little") for t in tokens)
    return hashlib.sha256(data).digest()[:8]


def engine_hash_to_router_key(batches: List[list], model: str = MODEL) -> dict:
    """Engine block hash → kvroute router key (hex), from every BlockStored of
    group 0 in `batches`: an independent translation to check the sidecar's."""
    keys: dict = {}
    for _ts, events, *_ in batches:
        for ev in events:
            if not isinstance(ev, dict) or ev.get("type") != "BlockStored":
                continue
            if (ev.get("group_idx") or 0) != 0 or ev.get("medium") not in (None, "GPU"):
                continue
            bs = ev["block_size"]
            parent_hash = ev.get("parent_block_hash")
            parent = kvroute_root(model) if parent_hash is None else keys.get(_u64(parent_hash))
            if parent is None:
                continue
            for i, h in enumerate(ev["block_hashes"]):
                key = kvroute_key(parent, ev["token_ids"][i * bs : (i + 1) * bs])
                keys.setdefault(_u64(h), key)
                parent = keys[_u64(h)]
    return keys


class Sidecar:
    def __init__(self, worker_id: str, engine: Engine, routers: List[str], extra: Optional[List[str]] = None):
        self.worker_id = worker_id
        self.engine = engine
        self.routers = routers
        self.extra = extra or []
        self.proc = Proc(f"sidecar-{worker_id}", self._cmd(), env={**os.environ, "RUST_LOG": "info"})
        self.url = self.proc.announced_url()

    def _cmd(self) -> List[str]:
        e = self.engine
        cmd = [
            str(binary("kvroute-sidecar")),
            "--worker-id", self.worker_id,
            "--engine-url", e.url,
            "--events", f"tcp://127.0.0.1:{e.events}",
            "--replay", f"tcp://127.0.0.1:{e.replay}",
            "--engine-snapshot", f"tcp://127.0.0.1:{e.snapshot}",
            "--internal-token", TOKEN,
            "--listen", "127.0.0.1:0",
        ]
        for r in self.routers:
            cmd += ["--router", r]
        return cmd + self.extra

    def restart(self) -> None:
        self.proc.stop()
        self.start()

    def start(self) -> None:
        self.proc.start()
        self.url = self.proc.announced_url()

    def metric(self, name: str) -> float:
        return metric_sum(self.url, name)


class Router:
    def __init__(self, tokenizer: pathlib.Path, listen: str = "127.0.0.1:0", extra: Optional[List[str]] = None):
        self.cmd = [
            str(binary("kvroute-router")),
            "--listen", listen,
            "--tokenizer", str(tokenizer),
            "--block-size", str(BLOCK_SIZE),
            "--internal-token", TOKEN,
            "--health-check-interval", "500ms",
        ] + (extra or [])
        self.proc = Proc("router", self.cmd, env={**os.environ, "KVROUTE_LOG": "info"})
        self.url = self.proc.announced_url()

    def restart_same_port(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        self.proc.kill()
        i = self.proc.cmd.index("--listen")
        self.proc.cmd[i + 1] = f"127.0.0.1:{port}"
        self.proc.start()
        self.url = self.proc.announced_url()

    def confirmed(self, worker: str) -> set:
        r = requests.get(f"{self.url}/debug/index", params={"worker": worker}, timeout=5)
        r.raise_for_status()
        return set(r.json()["confirmed"])

    def workers(self) -> dict:
        return {w["id"]: w for w in requests.get(f"{self.url}/admin/workers", timeout=5).json()["workers"]}

    def explain(self, body: dict) -> dict:
        """`/debug/route`'s account of where `body` would go."""
        r = requests.post(f"{self.url}/debug/route", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def tokenize(self, body: dict) -> List[int]:
        """The router's own token ids for an OpenAI body (`kvroute-router tokenize`)."""
        tok = self.cmd[self.cmd.index("--tokenizer") + 1]
        flag = "--default-chat-template-kwargs"
        defaults = [flag, self.cmd[self.cmd.index(flag) + 1]] if flag in self.cmd else []
        out = subprocess.run(
            [str(binary("kvroute-router")), "tokenize", "--tokenizer", tok, "--block-size", str(BLOCK_SIZE), *defaults],
            input=json.dumps(body),
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)["token_ids"]


def truth(engine: Engine, rank: int = 0) -> set:
    """The engine's (data-parallel rank's) cached blocks as router keys (hex):
    the plugin's snapshot, each hash translated through the rank's own event
    history."""
    table = engine_hash_to_router_key(engine.replay_all(rank))
    held = engine.snapshot_hashes(rank)
    missing = [h for h in held if _u64(h) not in table]
    assert not missing, f"{len(missing)} cached blocks of {engine.name} never appeared in its events"
    return {table[_u64(h)].hex() for h in held}
