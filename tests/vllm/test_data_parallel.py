"""Real vLLM under data parallelism (`--data-parallel-size 2`, one API
server: vLLM's internal load balancing). Every rank is its own engine core
with its own KV cache, and vLLM publishes rank r's events on the base event
port + r.

- The kvroute_hooks plugin binds its snapshot port + r too (it used to bind
  the same port on every rank), and each rank's snapshot is that rank's cache.
- kvroute routes to ranks, not engines (issue 14): the sidecar reports each
  rank as a target of its own, and the router pins the rank it chose with
  `X-data-parallel-rank`, which vLLM's API server honours.
"""

from collections import Counter

import pytest
import requests

from harness import MODEL, Engine, Router, Sidecar, engine_hash_to_router_key, eventually, metric_sum, tiny_model, truth

RANKS = 2


@pytest.fixture(scope="module")
def engine():
    engine = Engine("dp", num_blocks=40, extra=["--data-parallel-size", str(RANKS)])
    try:
        engine.wait_ready()
        yield engine
    finally:
        engine.proc.stop()


def engine_counter(engine: Engine, name: str, rank: int) -> float:
    """A counter of one data-parallel engine core (`engine="R"`), summed over
    its other labels."""
    return metric_sum(engine.url, name, f'engine="{rank}"')


def test_each_rank_serves_its_own_snapshot_on_port_plus_rank(engine):
    # vLLM's own balancer spreads these over both ranks.
    for i in range(8):
        body = {"model": MODEL, "prompt": f"rank spread {i} " + "word " * 80, "max_tokens": 1, "ignore_eos": True}
        requests.post(f"{engine.url}/v1/completions", json=body, timeout=120).raise_for_status()
    snapshots = []
    for rank in range(RANKS):
        held = eventually(f"rank {rank}'s snapshot", 30, lambda r=rank: engine.snapshot_hashes(r) or None)
        stored = set(engine_hash_to_router_key(engine.replay_all(rank)))
        assert held <= stored, f"rank {rank} reports blocks its own events never stored"
        snapshots.append(held)
    assert snapshots[0] != snapshots[1], "both ports answered with the same cache"


def test_the_router_picks_ranks_and_vllm_serves_on_the_rank_it_picked(engine):
    router = Router(tiny_model())
    sidecar = Sidecar("dp", engine, [router.url], extra=["--data-parallel-size", str(RANKS)])
    try:
        ids = [f"dp-dp{r}" for r in range(RANKS)]

        def registered():
            ws = router.workers()
            ok = all(ws.get(i, {}).get("sidecar") and ws[i].get("healthy") for i in ids)
            return ws if ok else None

        workers = eventually("each rank registered by the sidecar", 60, registered)
        assert [workers[i]["dp_rank"] for i in ids] == list(range(RANKS)), workers

        served_before = [engine_counter(engine, "vllm:request_success_total", r) for r in range(RANKS)]
        routed = Counter()
        for i in range(6):
            prompt = f"data parallel routing {i} " + " ".join(f"w{i}x{j}" for j in range(90))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
            first = requests.post(f"{router.url}/v1/completions", json=body, timeout=120)
            assert first.status_code == 200, first.text
            holder = first.headers["x-kvroute-worker"]
            routed[holder] += 1
            rank = ids.index(holder)
            # The repeat waits until the router knows where the blocks are.
            eventually(
                f"{holder}'s map to hold prompt {i}", 30,
                lambda r=rank: truth(engine, r) <= router.confirmed(ids[r]) and truth(engine, r) or None,
                0.3,
            )
            again = requests.post(f"{router.url}/v1/completions", json=body, timeout=120)
            assert again.status_code == 200, again.text
            assert again.headers["x-kvroute-worker"] == holder, f"the repeat of prompt {i} left {holder}"
            routed[holder] += 1
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0, f"the repeat of prompt {i} on {holder} hit nothing: vLLM ran it on another rank"
        # vLLM served on each rank exactly the requests the router sent there.
        for r in range(RANKS):
            served = engine_counter(engine, "vllm:request_success_total", r) - served_before[r]
            assert served == routed[ids[r]], f"rank {r} served {served}, the router sent {dict(routed)}"
    finally:
        sidecar.proc.stop()
        router.proc.stop()
