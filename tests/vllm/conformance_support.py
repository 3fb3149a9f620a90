"""Helpers for test_conformance.py: kvroute-sim and real vLLM side by side.

- `start_sim` / `ConformanceEngine`: the two engines, configured alike (same
  tokenizer, block size, block count, context length, scheduler limits).
- `workload`: a seeded request sequence (token-id, text and chat prompts with
  shared prefixes, exact repeats, block-aligned lengths) big enough to evict.
- `EventLog`: one engine's KV-event batches from its ZMQ PUB socket, with gaps
  (a subscription still joining) filled from its replay socket.
- `Canon`: turns an engine's batches into a hash-free structure that two
  engines must agree on. Block hashes differ by design, so a block is named by
  what it holds: a block of some prompt that was sent is named by its token
  chain (the same on both engines), a block holding generated tokens (whose
  ids differ: random model vs filler) by the order it first appeared in.
"""

import hashlib
import random
import struct
import threading
import time
from typing import Dict, Iterable, List, Optional, Tuple

import msgpack
import requests
import zmq

from harness import BLOCK_SIZE, MODEL, Engine, Proc, binary, eventually, tiny_model

# Scheduler limits both engines run with: vLLM's defaults for the OpenAI
# server on CPU, passed to both explicitly so neither depends on a default.
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
# kvroute-sim's step cost, measured on vLLM 0.32's CPU build serving the tiny
# Qwen3 (2 cores): ~4.8 ms a step, ~1.8 ms more per decoding sequence (CPU
# sampling over a 151k vocabulary), ~15 µs per prefill token. Only the
# concurrent phase depends on it (how arrivals interleave with steps).
SIM_COST = ["--step-overhead-us", "4800", "--prefill-us-per-token", "15", "--decode-us-per-seq", "1800"]


def max_model_len(num_blocks: int) -> int:
    """What scripts/vllm-serve.sh gives vLLM: the pool minus the null block, at most 4096."""
    return min((num_blocks - 1) * BLOCK_SIZE, 4096)


class ConformanceEngine(Engine):
    """A real vLLM with the development endpoints (`/reset_prefix_cache`
    exists only with VLLM_SERVER_DEV_MODE=1) and the render endpoints
    (`--enable-scale-out`)."""

    def __init__(self, num_blocks: int):
        extra = [
            "--enable-scale-out",
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        ]
        super().__init__("conformance", num_blocks, extra)

    def _cmd(self) -> List[str]:
        return ["env", "VLLM_SERVER_DEV_MODE=1"] + super()._cmd()

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay}"


class SimEngine:
    """kvroute-sim on ports it picked itself (port 0), read back from its
    `listening on` / `kv-events on` / `kv-replay on` lines."""

    def __init__(self, num_blocks: int):
        sim = binary("kvroute-sim")
        cmd = [
            str(sim),
            "--listen", "127.0.0.1:0",
            "--model", MODEL,
            "--tokenizer", str(tiny_model()),
            "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(num_blocks),
            "--max-model-len", str(max_model_len(num_blocks)),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--kv-events-endpoint", "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
        ] + SIM_COST
        self.name = "kvroute-sim"
        self.proc = Proc("sim-conformance", cmd)
        self.url = self.proc.announced_url()
        self.events_endpoint = self._announced("kv-events on ")
        self.replay_endpoint = self._announced("kv-replay on ")

    def _announced(self, prefix: str) -> str:
        def probe():
            self.proc.check_alive()
            for line in self.proc.log_path.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            return None

        return eventually(f"kvroute-sim to print {prefix.strip()!r}", 30, probe)

    def wait_ready(self) -> None:
        def probe():
            return True if requests.get(f"{self.url}/health", timeout=2).ok else None

        eventually("kvroute-sim to serve", 30, probe)


# ---------------------------------------------------------------- workload

WORDS = (
    "cache block prefix router engine token request worker stream batch queue model answer question system user "
    "assistant document chapter section river mountain forest ocean planet signal memory vector kernel thread "
    "socket packet garden window letter harbor lantern meadow copper violet silver orbit canyon glacier island"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(seed: int, n: int, longest_prompt: int) -> List[dict]:
    """`n` requests: half token-id completions, a quarter text completions, a
    quarter chat (some multi-turn), over a few shared prefixes (skewed, so
    some stay hot), with repeats of recent prompts and block-aligned lengths
    (a repeat's last block is recomputed and stored twice). Every body sets
    `max_tokens` and `ignore_eos`."""
    rng = random.Random(seed)
    token_prefixes = [[rng.randrange(1000, 100_000) for _ in range(rng.randrange(20, 400))] for _ in range(6)]
    text_prefixes = [f"Context {i}. " + words(rng, rng.randrange(20, 200)) for i in range(4)]
    systems = [f"You are helper {i}. " + words(rng, rng.randrange(10, 150)) for i in range(4)]
    sent_tokens: List[List[int]] = []
    out = []
    for _ in range(n):
        max_tokens = rng.choice([1, 1, 2, 5, 16, 31, 32, 33, 48, rng.randrange(1, 64)])
        kind = rng.random()
        if kind < 0.5:
            if sent_tokens and rng.random() < 0.15:
                # A recent prompt again: when block-aligned, its last block
                # cannot hit and is computed (and stored) a second time.
                prompt = list(rng.choice(sent_tokens[-6:]))
            else:
                prefix = token_prefixes[min(int(rng.expovariate(0.6)), len(token_prefixes) - 1)]
                prompt = prefix + [rng.randrange(1000, 100_000) for _ in range(rng.randrange(0, 200))]
                if rng.random() < 0.3 and len(prompt) >= BLOCK_SIZE:
                    prompt = prompt[: len(prompt) // BLOCK_SIZE * BLOCK_SIZE]
            prompt = prompt[:longest_prompt]
            sent_tokens.append(prompt)
            out.append({"path": "/v1/completions", "body": {"prompt": prompt}})
        elif kind < 0.75:
            prefix = text_prefixes[min(int(rng.expovariate(0.8)), len(text_prefixes) - 1)]
            prompt = prefix + " " + words(rng, rng.randrange(1, 120))
            out.append({"path": "/v1/completions", "body": {"prompt": prompt}})
        else:
            messages = [{"role": "system", "content": rng.choice(systems)}]
            for turn in range(rng.randrange(0, 3)):
                messages.append({"role": "user", "content": f"Question {turn}: " + words(rng, 8)})
                messages.append({"role": "assistant", "content": f"Answer {turn}: " + words(rng, 12)})
            messages.append({"role": "user", "content": words(rng, rng.randrange(1, 60))})
            out.append({"path": "/v1/chat/completions", "body": {"messages": messages}})
        out[-1]["body"].update({"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True})
    return out


def post(url: str, body: dict, timeout: float = 300) -> dict:
    r = requests.post(url, json=body, timeout=timeout)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:500]}"
    return r.json()


def render(engine, req: dict) -> List[int]:
    """The prompt's token ids, from the engine's render endpoint."""
    got = post(f"{engine.url}{req['path']}/render", req["body"])
    if isinstance(got, list):
        assert len(got) == 1, got
        got = got[0]
    return got["token_ids"]


def metric(engine, name: str) -> float:
    text = requests.get(f"{engine.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{engine.name} /metrics has no {name}")


# ------------------------------------------------------------------ events


class EventLog:
    """Every KV-event batch one engine publishes, by seq: a SUB socket
    collects them live; batches it missed (before the subscription joined)
    come from the engine's replay socket."""

    def __init__(self, name: str, pub: str, replay: str):
        self.name = name
        self.replay = replay
        self.batches: Dict[int, list] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.thread = threading.Thread(target=self._run, name=f"events-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            frames = self.sub.recv_multipart()
            seq = int.from_bytes(frames[-2], "big")
            payload = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            with self.lock:
                self.batches[seq] = payload[1]
        self.sub.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)

    def _fill_from_replay(self, start: int) -> None:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10_000)
        s.connect(self.replay)
        try:
            s.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = s.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == -1:
                    return
                payload = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                with self.lock:
                    self.batches.setdefault(seq, payload[1])
        finally:
            s.close()

    def snapshot(self, tail: bool = False) -> List[list]:
        """The batches from seq 0 up to the newest, gaps filled from replay.
        `tail`: also ask the replay socket for batches after the newest one
        seen live, which finds a batch the subscription missed when no later
        one has arrived yet (the very first batch, published before the SUB
        socket had joined)."""
        with self.lock:
            top = max(self.batches, default=-1)
            missing = [s for s in range(top + 1) if s not in self.batches]
        if missing:
            self._fill_from_replay(missing[0])
        elif tail:
            self._fill_from_replay(top + 1)
        with self.lock:
            top = max(self.batches, default=-1)
            missing = [s for s in range(top + 1) if s not in self.batches]
            assert not missing, f"{self.name}: batches {missing[:10]} lost (not even in the replay buffer)"
            return [self.batches[s] for s in range(top + 1)]


def chain_key(parent: Optional[bytes], tokens: Iterable[int]) -> bytes:
    """Names a block by its whole token prefix: the same on every engine."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    for t in tokens:
        h.update(struct.pack("<I", t))
    return h.digest()


def prompt_keys(prompts: Iterable[List[int]]) -> set:
    keys = set()
    for p in prompts:
        parent = None
        for i in range(len(p) // BLOCK_SIZE):
            parent = chain_key(parent, p[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            keys.add(parent)
    return keys


class Canon:
    """One engine's event stream without its hash values (see the module doc)."""

    def __init__(self, prompt_blocks: set):
        self.prompt_blocks = prompt_blocks
        self.content: Dict[object, bytes] = {}
        self.names: Dict[object, Tuple[str, object]] = {}
        self.generated = 0
        # Physical blocks per name, and stores of a name already held: the
        # duplicates vLLM registers without deduplicating.
        self.live: Dict[Tuple[str, object], int] = {}
        self.duplicates = 0

    def _name(self, h) -> Tuple[str, object]:
        h = bytes(h) if isinstance(h, (bytes, bytearray)) else h
        assert h in self.names, f"an event names a hash never stored: {h!r}"
        return self.names[h]

    def event(self, ev) -> tuple:
        kind = ev["type"] if isinstance(ev, dict) else ev[0]
        assert isinstance(ev, dict), f"expected vLLM's map encoding, got {ev!r}"
        if kind == "BlockStored":
            hashes = ev["block_hashes"]
            tokens = ev["token_ids"]
            bs = ev["block_size"]
            assert len(tokens) == len(hashes) * bs, ev
            parent = ev["parent_block_hash"]
            parent_name = None if parent is None else self._name(parent)
            key = None if parent is None else self.content[bytes(parent) if isinstance(parent, bytearray) else parent]
            names = []
            for i, h in enumerate(hashes):
                key = chain_key(key, tokens[i * bs : (i + 1) * bs])
                if h not in self.names:
                    self.content[h] = key
                    if key in self.prompt_blocks:
                        self.names[h] = ("prompt", key.hex()[:12])
                    else:
                        self.names[h] = ("generated", self.generated)
                        self.generated += 1
                name = self.names[h]
                self.duplicates += self.live.get(name, 0) > 0
                self.live[name] = self.live.get(name, 0) + 1
                names.append(name)
            return ("BlockStored", tuple(names), parent_name, bs, ev.get("lora_id"), ev.get("medium"))
        if kind == "BlockRemoved":
            names = tuple(self._name(h) for h in ev["block_hashes"])
            for name in names:
                self.live[name] = self.live.get(name, 0) - 1
            return ("BlockRemoved", names, ev.get("medium"))
        if kind == "AllBlocksCleared":
            self.live.clear()
            return ("AllBlocksCleared",)
        raise AssertionError(f"unknown event {ev!r}")

    def batches(self, batches: List[list]) -> List[List[tuple]]:
        return [[self.event(ev) for ev in batch] for batch in batches]


def compare_streams(vllm: List[List[tuple]], sim: List[List[tuple]]) -> Optional[str]:
    """None if equal, else a description of the first difference."""
    for i, (a, b) in enumerate(zip(vllm, sim)):
        if a != b:
            before = vllm[max(0, i - 2) : i]
            return (
                f"batch {i} differs (of {len(vllm)} vLLM / {len(sim)} sim batches):\n"
                f"  vLLM: {a}\n  sim:  {b}\n  (the two batches before, vLLM: {before})"
            )
    if len(vllm) != len(sim):
        extra = vllm[len(sim) : len(sim) + 2] or sim[len(vllm) : len(vllm) + 2]
        return f"vLLM published {len(vllm)} batches, the sim {len(sim)}; next extra: {extra}"
    return None


def summary(batches: List[List[tuple]]) -> dict:
    counts: Dict[str, int] = {}
    for batch in batches:
        for ev in batch:
            n = len(ev[1]) if ev[0] != "AllBlocksCleared" else 1
            counts[ev[0]] = counts.get(ev[0], 0) + n
    return {"batches": len(batches), **counts}


def wait_for_sentinel(log: EventLog, key: bytes, timeout: float = 60) -> List[list]:
    """The engine's batches once the sentinel request's block has been
    published (batches go out in order, so every earlier one is in too)."""

    def probe():
        batches = log.snapshot(tail=True)
        for batch in reversed(batches):
            for ev in batch:
                if isinstance(ev, dict) and ev.get("type") == "BlockStored":
                    toks = ev["token_ids"]
                    if len(toks) == BLOCK_SIZE and chain_key(None, toks) == key and ev["parent_block_hash"] is None:
                        return batches
        return None

    return eventually(f"{log.name} to publish the sentinel's block", timeout, probe, every=0.2)


def wait_for_prefill(log: EventLog, first_block: List[int], timeout: float = 60) -> None:
    """Until the engine has published a BlockStored starting a chain with
    `first_block` (a prompt's first block): that prompt is admitted and its
    prefill has run."""

    def probe():
        for batch in log.snapshot(tail=True):
            for ev in batch:
                if (
                    isinstance(ev, dict)
                    and ev.get("type") == "BlockStored"
                    and ev["parent_block_hash"] is None
                    and ev["token_ids"][:BLOCK_SIZE] == first_block
                ):
                    return True
        return None

    eventually(f"{log.name} to publish the prompt's first block", timeout, probe, every=0.02)


def now() -> float:
    return time.monotonic()
