"""The kvroute_hooks plugin under data parallelism, on real vLLM: every rank is
its own engine core with its own KV cache, and vLLM publishes rank r's events
on the base event port + r. The plugin must bind its snapshot port + r too
(it used to bind the same port on every rank), and each rank's snapshot must
be that rank's cache: the hashes its own events stored.
"""

import requests

from harness import MODEL, Engine, engine_hash_to_router_key, eventually


def test_each_rank_serves_its_own_snapshot_on_port_plus_rank():
    engine = Engine("dp", num_blocks=40, extra=["--data-parallel-size", "2"])
    try:
        engine.wait_ready()
        # vLLM's own balancer spreads these over both ranks.
        for i in range(8):
            body = {"model": MODEL, "prompt": f"rank spread {i} " + "word " * 80, "max_tokens": 1, "ignore_eos": True}
            requests.post(f"{engine.url}/v1/completions", json=body, timeout=120).raise_for_status()
        snapshots = []
        for rank in (0, 1):
            held = eventually(f"rank {rank}'s snapshot", 30, lambda r=rank: engine.snapshot_hashes(r) or None)
            stored = set(engine_hash_to_router_key(engine.replay_all(rank)))
            assert held <= stored, f"rank {rank} reports blocks its own events never stored"
            snapshots.append(held)
        assert snapshots[0] != snapshots[1], "both ports answered with the same cache"
    finally:
        engine.proc.stop()
