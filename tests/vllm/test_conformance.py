"""kvroute-sim against real vLLM 0.32, request for request (issue 11 §3, §4).

One real vLLM (CPU build, tiny Qwen3, random weights) and one kvroute-sim,
configured alike: the same tokenizer (target/tiny-qwen3), block size 32, the
same block count (small, so both evict), context length and scheduler limits.
Both get the same seeded requests: token-id, text and chat prompts over
shared prefixes, with exact repeats and block-aligned lengths.

- One at a time: every response's `cached_tokens`, the prefix-cache hit and
  query totals of `/metrics`, and the KV-event streams must be equal, batch
  for batch, apart from hash values (see conformance_support.Canon); so must
  the prompts' token ids (render endpoints), the answers to
  `/reset_prefix_cache` (idle, and while a request runs), and a batch prompt's
  answer shape.
- A scripted preemption (requests queued behind a big one, admitted in one
  step, outgrowing the pool): equal event for event, one preemption each.
- Eight in flight (at least 400 requests): total cached tokens within 2 %,
  prefix-cache queries equal.

    target/vllm-venv/bin/python -m pytest tests/vllm/test_conformance.py -s

KVROUTE_CONFORMANCE_REQUESTS (default 150) sets the requests sent one at a
time and, above 400, the concurrent ones too (2000 for a long run by hand).
Nothing skips: without vLLM or a built kvroute-sim (`cargo build --workspace
--bins`), the test fails saying so.
"""

import os
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

sys.path.insert(0, os.path.dirname(__file__))

from conformance_support import (  # noqa: E402
    BLOCK_SIZE,
    MODEL,
    Canon,
    ConformanceEngine,
    EventLog,
    SimEngine,
    binary,
    chain_key,
    eventually,
    compare_streams,
    max_model_len,
    metric,
    now,
    post,
    prompt_keys,
    render,
    summary,
    wait_for_prefill,
    wait_for_sentinel,
    workload,
)

# Requests sent one at a time; the concurrent phase sends at least
# CONCURRENT_MIN: its totals are compared statistically, and vLLM's own
# run-to-run spread on this workload is about 1 % at 240 requests.
REQUESTS = int(os.environ.get("KVROUTE_CONFORMANCE_REQUESTS", "150"))
CONCURRENT_MIN = 400
# How far the concurrent phase's totals may differ (see its test).
TOTALS_BOUND = 0.02
# 127 usable blocks of 32 tokens (4064): the workload sends many times that,
# so both engines evict all along, yet its hot prefixes mostly fit, so the
# concurrent totals depend little on how arrivals interleave with steps.
NUM_BLOCKS = 128
LONGEST_PROMPT = 700
CONCURRENCY = 8


class Pair:
    """The two engines, started by the first test that needs them (so a
    missing binary fails that test rather than erroring a fixture)."""

    def __init__(self):
        self.vllm = self.sim = None
        self.logs = {}
        self.lock = threading.Lock()

    def get(self):
        with self.lock:
            if self.sim is None:
                # Checked before vLLM's minute of start-up.
                binary("kvroute-sim")
                # vLLM cannot report a port it chose itself (its API socket and
                # its ZMQ event, replay and snapshot endpoints all take a
                # number), so harness.free_port binds a random free port below
                # the ephemeral range, closes it and passes the number on; the
                # sim binds port 0 itself and prints what it got.
                self.vllm = ConformanceEngine(NUM_BLOCKS)
                self.sim = SimEngine(NUM_BLOCKS)
                print(f"\nlogs: {self.vllm.proc.log_path}, {self.sim.proc.log_path}")
                self.sim.wait_ready()
                self.vllm.wait_ready()
                self.logs = {
                    "vllm": EventLog("vLLM", self.vllm.events_endpoint, self.vllm.replay_endpoint),
                    "sim": EventLog("kvroute-sim", self.sim.events_endpoint, self.sim.replay_endpoint),
                }
            return self.vllm, self.sim

    def stop(self):
        for log in self.logs.values():
            log.close()
        for e in (self.sim, self.vllm):
            if e is not None:
                e.proc.stop()


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.stop()


def both(fn, vllm, sim):
    """fn(engine) on both engines at once; (vLLM's result, the sim's)."""
    with ThreadPoolExecutor(2) as ex:
        a, b = ex.submit(fn, vllm), ex.submit(fn, sim)
        return a.result(), b.result()


def counters(e) -> tuple:
    return metric(e, "vllm:prefix_cache_hits_total"), metric(e, "vllm:prefix_cache_queries_total")


def test_one_at_a_time_everything_is_equal(pair):
    vllm, sim = pair.get()
    started = now()
    reqs = workload(seed=11, n=REQUESTS, longest_prompt=LONGEST_PROMPT)
    before = both(counters, vllm, sim)

    # The prompts' token ids: the engines must tokenize alike (chat template
    # included), and the event comparison names prompt blocks by them.
    prompts = []
    for i, req in enumerate(reqs):
        want, got = both(lambda e: render(e, req), vllm, sim)
        assert got == want, f"request {i} ({req['path']}) tokenizes differently: vLLM {want[:20]}…, sim {got[:20]}…"
        prompts.append(want)
    sentinel = [140_000 + i for i in range(BLOCK_SIZE)]

    cached = []
    for i, req in enumerate(reqs):
        if i == len(reqs) // 2:
            # Idle: both reset, and publish AllBlocksCleared with the next step.
            answers = both(lambda e: post(f"{e.url}/reset_prefix_cache", {}), vllm, sim)
            assert answers == ({"success": True}, {"success": True}), answers
        a, b = both(lambda e: post(f"{e.url}{req['path']}", req["body"]), vllm, sim)
        cached.append(tuple(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (a, b)))
        assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"] == len(prompts[i])
        assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"] == req["body"]["max_tokens"]
    both(lambda e: post(f"{e.url}/v1/completions", {"model": MODEL, "prompt": sentinel, "max_tokens": 1}), vllm, sim)
    after = both(counters, vllm, sim)

    differ = [(i, a, b) for i, (a, b) in enumerate(cached) if a != b]
    hits = sum(a for a, _ in cached)
    print(f"\nsequential: {len(reqs)} requests, cached tokens vLLM {hits} / sim {sum(b for _, b in cached)}, "
          f"{len(differ)} requests differ")
    assert not differ, f"cached_tokens differ (request, vLLM, sim): {differ[:10]}"
    assert hits > 0, "vLLM cached nothing: the comparison proved nothing"
    deltas = [tuple(x - y for x, y in zip(after[k], before[k])) for k in (0, 1)]
    assert deltas[0] == deltas[1], f"(hits, queries) from /metrics: vLLM {deltas[0]}, sim {deltas[1]}"

    key = chain_key(None, sentinel)
    raw = both(lambda e: wait_for_sentinel(pair.logs["vllm" if e is vllm else "sim"], key), vllm, sim)
    blocks = prompt_keys(prompts + [sentinel])
    canons = [Canon(blocks), Canon(blocks)]
    streams = [c.batches(r) for c, r in zip(canons, raw)]
    print(f"events: vLLM {summary(streams[0])}, sim {summary(streams[1])}, duplicate stores "
          f"{canons[0].duplicates} / {canons[1].duplicates} ({now() - started:.0f} s)")
    diff = compare_streams(*streams)
    assert diff is None, diff

    check_batch_prompts(vllm, sim)
    check_reset_refused_while_running(vllm, sim)


def check_batch_prompts(vllm, sim):
    """A list of prompts: one choice each, usage summed, the same cached tokens."""
    body = {"model": MODEL, "prompt": ["Batch one. " + "river " * 40, "Batch two. " + "meadow copper " * 30],
            "max_tokens": 3, "ignore_eos": True}
    a, b = both(lambda e: post(f"{e.url}/v1/completions", body), vllm, sim)
    assert [c["index"] for c in b["choices"]] == [c["index"] for c in a["choices"]] == [0, 1]
    pick = lambda r: (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"],  # noqa: E731
                      r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert pick(b) == pick(a), f"usage: vLLM {a['usage']}, sim {b['usage']}"
    ra, rb = both(lambda e: post(f"{e.url}/v1/completions/render", body), vllm, sim)
    assert isinstance(rb, list) and len(rb) == len(ra) == 2
    assert [r["token_ids"] for r in rb] == [r["token_ids"] for r in ra]
    assert sorted(rb[0]) == sorted(ra[0]), f"GenerateRequest fields: vLLM {sorted(ra[0])}, sim {sorted(rb[0])}"
    assert rb[0]["sampling_params"] == ra[0]["sampling_params"]


def check_reset_refused_while_running(vllm, sim):
    """While a request holds blocks both refuse the reset, and say so the same way."""

    def refused(e):
        body = {"model": MODEL, "prompt": "Keep going.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with requests.post(f"{e.url}/v1/completions", json=body, stream=True, timeout=300) as r:
            assert r.status_code == 200
            # Keep the iterator: a dropped one closes the stream, and an
            # engine aborts the request and frees its blocks at once.
            lines = r.iter_lines()
            next(lines)
            answer = post(f"{e.url}/reset_prefix_cache", {})
            next(lines)
        return answer

    assert both(refused, vllm, sim) == ({"success": False}, {"success": False})


def idle_reset(e):
    """Resets once nothing holds blocks (aborted streams may still be draining)."""
    def probe():
        return True if post(f"{e.url}/reset_prefix_cache", {})["success"] else None

    return eventually(f"{e.name} to reset", 60, probe)


def sync_point(pair, vllm, sim, label: int) -> list:
    """Sends the same one-block request to both and waits until its batch
    is out: the number of batches each engine had published by then."""
    tokens = [130_000 + 64 * label + i for i in range(BLOCK_SIZE)]
    both(lambda e: post(f"{e.url}/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 1}), vllm, sim)
    key = chain_key(None, tokens)
    published = both(lambda e: wait_for_sentinel(pair.logs["vllm" if e is vllm else "sim"], key), vllm, sim)
    return [len(b) for b in published]


def test_preemption_is_equal(pair):
    """A deterministic preemption: X fills most of the pool while A and B
    queue behind it (their prompts do not fit); when X ends both are admitted
    in the same step, and their decoding outgrows the pool, so B, the last
    running request, is preempted, A finishes, and B resumes from what is
    left of its cached blocks. Everything must be equal, event for event.

    Synchronised by the engines' own events, not their gauges (which lag
    behind the scheduler in vLLM: polling them made this test flaky): A and
    B are sent once X's first block is published, X is still decoding for
    seconds then, and A and B travel as one batch prompt, which both engines
    submit in order at once."""
    vllm, sim = pair.get()
    start = sync_point(pair, vllm, sim, 1)
    both(idle_reset, vllm, sim)
    rng = random.Random(5)
    x = [rng.randrange(1000, 100_000) for _ in range(3000)]
    a = [rng.randrange(1000, 100_000) for _ in range(1400)]
    b = [rng.randrange(1000, 100_000) for _ in range(1400)]
    preempted_before = both(lambda e: metric(e, "vllm:num_preemptions_total"), vllm, sim)

    def script(e):
        def send(prompt, max_tokens):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            return post(f"{e.url}/v1/completions", body)["usage"]["prompt_tokens_details"]["cached_tokens"]

        log = pair.logs["vllm" if e is vllm else "sim"]
        with ThreadPoolExecutor(2) as ex:
            fx = ex.submit(send, x, 600)
            wait_for_prefill(log, x[:BLOCK_SIZE])
            # The batch's usage reports the last entry's cached tokens (vLLM's quirk).
            fab = ex.submit(send, [a, b], 700)
            return fx.result(), fab.result()

    cached = both(script, vllm, sim)
    end = sync_point(pair, vllm, sim, 2)
    preempted_after = both(lambda e: metric(e, "vllm:num_preemptions_total"), vllm, sim)
    preempted = [after - before for after, before in zip(preempted_after, preempted_before)]
    raw = [pair.logs[k].snapshot()[s:n] for k, s, n in zip(("vllm", "sim"), start, end)]
    blocks = prompt_keys([x, a, b, [130_000 + 128 + i for i in range(BLOCK_SIZE)]])
    streams = [Canon(blocks).batches(r) for r in raw]
    print(f"\npreemption: cached tokens {cached}, preemptions {preempted}, events vLLM {summary(streams[0])}, "
          f"sim {summary(streams[1])}")
    assert cached[0] == cached[1]
    assert preempted[0] == preempted[1] >= 1, f"preemptions: vLLM {preempted[0]}, sim {preempted[1]}"
    diff = compare_streams(*streams)
    assert diff is None, diff


def test_eight_in_flight_totals_agree(pair):
    vllm, sim = pair.get()
    both(idle_reset, vllm, sim)
    reqs = workload(seed=23, n=max(REQUESTS, CONCURRENT_MIN), longest_prompt=LONGEST_PROMPT)
    before = both(counters, vllm, sim)
    started = now()

    def run(e):
        def one(req):
            r = post(f"{e.url}{req['path']}", req["body"])
            return r["usage"]["prompt_tokens_details"]["cached_tokens"]

        with ThreadPoolExecutor(CONCURRENCY) as ex:
            return list(ex.map(one, reqs))

    a, b = both(run, vllm, sim)
    after = both(counters, vllm, sim)
    preempted = both(lambda e: metric(e, "vllm:num_preemptions_total"), vllm, sim)
    hits_a, hits_b = sum(a), sum(b)
    queries = [after[k][1] - before[k][1] for k in (0, 1)]
    metric_hits = [after[k][0] - before[k][0] for k in (0, 1)]
    same = sum(1 for x, y in zip(a, b) if x == y)
    print(f"\nconcurrent ({CONCURRENCY} in flight): {len(reqs)} requests in {now() - started:.0f} s, cached tokens "
          f"vLLM {hits_a} / sim {hits_b} ({(hits_b - hits_a) / max(hits_a, 1):+.2%}), {same} requests equal, "
          f"queries {queries}, /metrics hits {metric_hits}, preemptions so far {preempted}")
    assert queries[0] == queries[1]
    assert hits_a > 0, "vLLM cached nothing: the comparison proved nothing"
    # 2 %: vLLM against itself differs by up to 1.0 % here (batching follows
    # timing), so two engines may differ by about twice that. At 1 % a
    # clean-clone CI run failed on 2026-11-23 at -1.08 % (earlier runs:
    # -0.15, +0.51, +0.30 %).
    assert abs(hits_b - hits_a) <= TOTALS_BOUND * hits_a, f"cached tokens: vLLM {hits_a}, sim {hits_b}"
    assert abs(metric_hits[1] - metric_hits[0]) <= TOTALS_BOUND * metric_hits[0]


def test_requests_at_the_context_edge_are_answered_alike(pair):
    """What vLLM 0.32 clamps or refuses, the sim does too: max_tokens is what
    the context leaves at most (the sim refused prompt + max_tokens past it),
    a prompt that fills the context and a max_tokens past it are refused, and
    a request naming no model is for the served one (the sim answered 404).
    Last in the file: its long prompt evicts everything."""
    vllm, sim = pair.get()
    mml = max_model_len(NUM_BLOCKS)

    def ask(body):
        def run(e):
            r = requests.post(f"{e.url}/v1/completions", json=body, timeout=300)
            return r.status_code, (r.json().get("usage") or {}).get("completion_tokens")

        return both(run, vllm, sim)

    near = {"model": MODEL, "prompt": [1000 + i for i in range(mml - 3)], "max_tokens": 16, "ignore_eos": True}
    assert ask(near) == ((200, 3), (200, 3))
    assert ask({"prompt": [1000, 1001], "max_tokens": 1, "ignore_eos": True}) == ((200, 1), (200, 1))
    (v, _), (s, _) = ask({"model": MODEL, "prompt": [1000], "max_tokens": mml + 1})
    assert (v, s) == (400, 400)
    (v, _), (s, _) = ask({"model": MODEL, "prompt": [1000 + i for i in range(mml)], "max_tokens": 1})
    assert (v, s) == (400, 400)
