"""kvroute in front of real vLLM: two engines (CPU build, tiny Qwen3, random
weights, block size 32, 40 KV blocks each so they evict), a sidecar each with
every setting at its default next to vLLM's defaults (topic "" included), one
router. Truth is the engine itself: the kvroute_hooks plugin's snapshot of
its prefix cache, translated to router keys by an independent Python
implementation of DESIGN.md §1 over the engine's own event history.

Tests that restart processes come last in this file (pytest keeps file order).
"""

import json
import pathlib
import random

import pytest
import requests

from harness import ALIAS, BLOCK_SIZE, MODEL, ROOT, Engine, Proc, binary, eventually, free_port, truth

CONVERGE = 30.0  # seconds: a sync every 5 s, pushes every 100 ms

VOCAB = (
    "cache block prefix router engine token request worker stream batch queue model "
    "answer question system user assistant document chapter section river mountain "
    "forest ocean planet signal memory vector kernel thread socket packet"
).split()


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def post(url: str, body: dict, timeout: float = 300) -> requests.Response:
    r = requests.post(url, json=body, timeout=timeout)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:500]}"
    return r


def complete(cluster, prompt: str, max_tokens: int = 2, **extra) -> requests.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    return post(f"{cluster.router.url}/v1/completions", body)


def converge(cluster, what: str, allow_empty: bool = False):
    """Every worker's confirmed entries in the router equal its engine's cache."""
    held = 0
    for engine, sidecar in zip(cluster.engines, cluster.sidecars):

        def probe(engine=engine, sidecar=sidecar):
            want = truth(engine)
            got = cluster.router.confirmed(sidecar.worker_id)
            return (want, got) if got == want else None

        want, _ = eventually(f"{what}: router map of {sidecar.worker_id} == its engine's cache", CONVERGE, probe, 0.5)
        held += len(want)
    assert held or allow_empty, "the engines cache nothing: the comparison proves nothing"


def evictions(engine: Engine) -> int:
    return sum(
        1 for _ts, events, *_ in engine.replay_all() for ev in events if isinstance(ev, dict) and ev.get("type") == "BlockRemoved"
    )


def test_completion_and_chat_stick_to_the_holder(cluster):
    prompt = "You are kvroute's stickiness test. " + text(1, 260)
    holder = complete(cluster, prompt).headers["x-kvroute-worker"]
    for i in range(3):
        resp = complete(cluster, f"{prompt} Question {i}?")
        assert resp.headers["x-kvroute-worker"] == holder
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 6 * BLOCK_SIZE, f"the holder served only {cached} cached tokens"
    # The engines serve the model as MODEL and ALIAS (`--served-model-name`):
    # a request naming the alias is keyed as the model, and finds the holder.
    rows = {w["id"]: w for w in cluster.router.explain({"model": ALIAS, "prompt": f"{prompt} By alias?"})["workers"]}
    assert rows[holder]["matched_blocks"] >= 6, rows
    resp = complete(cluster, f"{prompt} By alias?", model=ALIAS)
    assert resp.headers["x-kvroute-worker"] == holder
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK_SIZE

    system = "You are a careful assistant for the chat stickiness test. " + text(2, 260)
    chat = lambda q: {  # noqa: E731
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        "max_tokens": 2,
        "ignore_eos": True,
    }
    holder = post(f"{cluster.router.url}/v1/chat/completions", chat("first?")).headers["x-kvroute-worker"]
    for q in ("second?", "third?"):
        resp = post(f"{cluster.router.url}/v1/chat/completions", chat(q))
        assert resp.headers["x-kvroute-worker"] == holder
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK_SIZE
        # The router made the request's id (the client sent none), and the
        # engine took it as its own: its log lines and the answer name it.
        assert resp.json()["id"] == "chatcmpl-" + resp.headers["x-request-id"]


def test_after_evictions_the_map_equals_each_engines_cache(cluster):
    # 5 shared prefixes × 8 suffixes, ~7 blocks each: far beyond 2 × 40 blocks.
    for i in range(40):
        complete(cluster, f"Group {i % 5}: " + text(100 + i % 5, 120) + " " + text(1000 + i, 80))
    for e in cluster.engines:
        assert evictions(e) > 0, f"{e.name} never evicted: the test is too small to prove anything"
    converge(cluster, "after evictions")
    for s in cluster.sidecars:
        # Every field of vLLM 0.32's events is known to the decoder.
        assert s.metric("kvroute_sidecar_unknown_fields_total") == 0
        assert s.metric("kvroute_sidecar_event_batches_total") > 0


def test_rereported_hits_leave_no_phantom_entries(cluster):
    """`kv_cache_report_mode: "full"` makes vLLM re-send BlockStored for prefix
    hits; once those blocks are evicted the router must not keep them."""
    shared = "Phantom check. " + text(7, 200)
    for i in range(6):
        complete(cluster, f"{shared} {i}", vllm_xargs={"kv_cache_report_mode": "full"})
    rereported = sum(s.metric("kvroute_sidecar_rereported_stores_total") for s in cluster.sidecars)
    assert rereported > 0, "vLLM re-reported no hit: the request option had no effect"
    for i in range(40):  # evict them
        complete(cluster, f"Flush {i}: " + text(2000 + i, 200))
    converge(cluster, "after re-reported hits were evicted")


def test_openai_client_streams_through_the_router(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.router.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream eight tokens. " + text(3, 40)}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content, "no content streamed"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    stream = client.completions.create(
        model=MODEL,
        prompt="Stream a completion. " + text(4, 40),
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    # Six tokens' text, in as many chunks as vLLM sent: not one per token
    # (its detokenizer holds back a token that ends mid UTF-8 character), and
    # how many is timing (it merges the deltas a slower reader has not taken
    # yet: on a busy machine all six came in one), so it is not asserted.
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert "".join(pieces), pieces


def _goldens() -> list:
    path = ROOT / "testdata" / "tokenizers" / "qwen3" / "chat-goldens.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _conversations() -> list:
    """Chat cases: the HF goldens' conversations, then seeded ones with and
    without tools, with tool calls, and ending in a partial assistant turn."""
    cases = [
        {
            "messages": g["messages"],
            "add_generation_prompt": g.get("add_generation_prompt", True),
            "continue_final_message": g.get("continue_final_message", False),
            **({"tools": g["tools"]} if g.get("tools") else {}),
            **({"chat_template_kwargs": g["chat_template_kwargs"]} if g.get("chat_template_kwargs") else {}),
        }
        for g in _goldens()
    ]
    # Messages as agent loops and SDKs send them: vLLM builds each anew
    # (null content is "", text parts are joined for Qwen3's string
    # template, developer turns become the system message).
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    cases += [
        {"messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": '{"temp": 3}'}]},
        ], "tools": TOOLS},
        {"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, "there"]},
            {"role": "assistant", "reasoning_content": "greet back", "content": "hi"},
            {"role": "assistant", "tool_calls": [], "refusal": None, "content": "again"},
            {"role": "user", "content": "bye"},
        ]},
        # The reasoning of a tool-calling turn after the last user message,
        # which Qwen3's template renders: a chat completion takes a client's
        # `reasoning_content` as `reasoning` (vLLM's /tokenize does not).
        {"messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "reasoning_content": "I need the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
        ], "tools": TOOLS},
        {"messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "reasoning": "Calling it.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
        ], "tools": TOOLS},
        # Tools as clients write them: vLLM renders its own dump of each
        # (type first, a missing description as null, added keys after).
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [
            {"function": {"parameters": {"type": "object"}, "name": "get_weather"}},
            {"function": {"name": "clock", "strict": True}, "type": "function", "cache_control": {"type": "ephemeral"}},
        ]},
        {"messages": [
            {"role": "system", "content": "first"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "second"},
            {"role": "user", "content": "v"},
        ]},
        # Claude Code through a gateway: vLLM drops the attribution line.
        {"messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1; cch=5e1f;\nYou are a coding agent."},
            {"role": "user", "content": "hi"},
        ]},
        {"messages": [
            {"role": "system", "content": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=77aa;"},
                {"type": "text", "text": "You are a coding agent."},
            ]},
            {"role": "user", "content": "hi"},
        ]},
        # The effort turns Qwen3's thinking off, unless the kwargs say otherwise.
        {"messages": [{"role": "user", "content": "Quick one?"}], "reasoning_effort": "none"},
        {"messages": [{"role": "user", "content": "Quick one?"}], "reasoning_effort": "none",
         "chat_template_kwargs": {"enable_thinking": True}},
        # The kwargs' tools win over the request's none, and a null kwarg is
        # unset (vLLM's merge_kwargs); a tool reference joins its name.
        {"messages": [{"role": "user", "content": "Weather?"}], "chat_template_kwargs": {"tools": TOOLS}},
        {"messages": [{"role": "user", "content": "Quick one?"}], "chat_template_kwargs": {"enable_thinking": None}},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Use it"}, {"type": "tool_reference", "name": "get_weather"}]}]},
        # An assistant prefill continued with its trailing whitespace, and an
        # empty one (transformers 5 cuts at a tag appended to it).
        {"messages": [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "```json\n"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"messages": [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": ""}],
         "add_generation_prompt": False, "continue_final_message": True},
    ]
    rng = random.Random(11)
    for i in range(24):
        msgs = [{"role": "system", "content": text(300 + i, rng.randint(3, 30))}] if i % 3 else []
        for turn in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": text(400 + i * 10 + turn, rng.randint(1, 40)) + " ünïcødé 日本語 🙂"})
            if i % 4 == 1 and turn == 0:
                call = {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
                msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temp": 21}'})
            msgs.append({"role": "assistant", "content": text(500 + i * 10 + turn, rng.randint(1, 30))})
        continue_final = i % 5 == 2
        if not continue_final:
            msgs.append({"role": "user", "content": text(600 + i, 12)})
        case = {"messages": msgs, "add_generation_prompt": not continue_final, "continue_final_message": continue_final}
        if i % 4 in (1, 3):
            case["tools"] = TOOLS
        if i % 6 == 5:
            # Over the engines' default (CHAT_DEFAULTS): thinking on.
            case["chat_template_kwargs"] = {"enable_thinking": True}
        cases.append(case)
    return cases


def test_router_token_ids_equal_the_engines(cluster):
    engine = cluster.engines[0]
    cases = _conversations()
    assert len(cases) >= 30
    mismatches = []
    for case in cases:
        # What the engine itself prefills for the chat (its /tokenize builds
        # another request class, which renders some messages otherwise).
        # (Tools are rendered whatever the choice; "auto" would need a
        # tool-call parser on the engine.)
        choice = {"tool_choice": "none"} if case.get("tools") else {}
        body = {"model": MODEL, "max_tokens": 1, "return_token_ids": True, **choice, **case}
        answer = post(f"{engine.url}/v1/chat/completions", body)
        want = answer.json()["prompt_token_ids"]
        got = cluster.router.tokenize({"model": MODEL, "max_tokens": 1, **case})
        if got != want:
            mismatches.append((case, want[:40], got[:40]))
    prompts = [text(700 + i, 5 + 37 * i) for i in range(12)] + [
        "  leading spaces, tabs\tand\nnewlines\n\n", "数字 123 4567 and émojis 🙂🙃", "<|im_start|>user\nraw special tokens<|im_end|>"
    ]
    for p in prompts:
        want = post(f"{engine.url}/tokenize", {"model": MODEL, "prompt": p}).json()["tokens"]
        got = cluster.router.tokenize({"model": MODEL, "prompt": p, "max_tokens": 1})
        if got != want:
            mismatches.append(({"prompt": p}, want[:40], got[:40]))
    assert not mismatches, f"{len(mismatches)} of {len(cases) + len(prompts)} differ; first: {mismatches[0]}"
    # The router's own check against each engine's /tokenize (once per
    # worker, after its first probe) agrees: every worker compared, none differs.
    def compared():
        text = requests.get(f"{cluster.router.url}/metrics", timeout=5).text
        lines = [ln for ln in text.splitlines() if ln.startswith("kvroute_worker_tokenizer_mismatch{")]
        return lines if len(lines) == len(cluster.engines) else None

    lines = eventually("the router's tokenizer check of every worker", CONVERGE, compared)
    assert all(ln.endswith(" 0") for ln in lines), lines


def test_a_sidecar_that_hears_nothing_says_so(cluster):
    """A sidecar whose topic matches nothing the engine publishes, beside an
    engine that serves requests: it must say so (metric and log)."""
    engine = cluster.engines[0]
    proc = Proc(
        "sidecar-silent",
        [
            str(binary("kvroute-sidecar")),
            "--worker-id", "silent",
            "--engine-url", engine.url,
            "--events", f"tcp://127.0.0.1:{engine.events}",
            "--topic", "no-such-topic",
            "--router", f"http://127.0.0.1:{free_port()}",  # nothing listens: pushes fail, that is fine here
            "--internal-token", "real-vllm-tier-internal-token",
            "--listen", "127.0.0.1:0",
        ],
    )
    try:
        url = proc.announced_url()

        def silent():
            for i in range(2):
                post(f"{engine.url}/v1/completions", {"model": MODEL, "prompt": text(900 + i, 50), "max_tokens": 1})
            metrics = requests.get(f"{url}/metrics", timeout=5).text.splitlines()
            return True if "kvroute_sidecar_events_silent 1" in metrics else None

        eventually("the sidecar to report silence", 60, silent, every=2.0)
        assert "no KV event arrived" in proc.log(200)
    finally:
        proc.stop()


def test_reset_prefix_cache_clears_the_workers_entries(cluster):
    engine, worker = cluster.engines[0], cluster.sidecars[0].worker_id
    # Sent to the engine itself: routed, it may have gone to the other one,
    # and entries that were never there "went" at once.
    body = {"model": MODEL, "prompt": "Before the reset. " + text(5, 100), "max_tokens": 2, "ignore_eos": True}
    post(f"{engine.url}/v1/completions", body)
    converge(cluster, "before the reset")
    assert cluster.router.confirmed(worker), f"{worker} held nothing: its entries' going would prove nothing"
    resp = post(f"{engine.url}/reset_prefix_cache", {})
    assert resp.json().get("success") is True, resp.text
    eventually(f"{worker}'s entries gone after the reset", CONVERGE,
               lambda: True if not cluster.router.confirmed(worker) else None)
    converge(cluster, "after a reset", allow_empty=True)


def test_sidecar_restart(cluster):
    for i in range(6):
        complete(cluster, f"Before the sidecar restart {i}. " + text(3000 + i, 150))
    sidecar, engine = cluster.sidecars[0], cluster.engines[0]
    sidecar.proc.stop()
    # Blocks the engine caches while no sidecar listens: only the new
    # process (its replay, its snapshot) can tell the router of them.
    before = truth(engine)
    for i in range(4):
        prompt = f"While the sidecar was down {i}. " + text(3100 + i, 150)
        post(f"{engine.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert truth(engine) - before, "the engine cached nothing new while the sidecar was down"
    sidecar.start()  # its address read from its own announcement, not its predecessor's
    converge(cluster, "after a sidecar restart")
    assert sidecar.metric("kvroute_sidecar_pushes_total") >= 1, "the new process answers, and pushed"


def test_router_restart_is_whole_again(cluster):
    for i in range(6):
        complete(cluster, f"Before the router restart {i}. " + text(4000 + i, 150))
    converge(cluster, "before the router restart")
    cluster.router.restart_same_port()
    cluster.wait_registered()
    converge(cluster, "after a router kill -9 and restart")


def test_engine_restart(cluster):
    engine = cluster.engines[1]
    for i in range(4):
        complete(cluster, f"Before the engine restart {i}. " + text(5000 + i, 150))
    engine.restart()
    cluster.wait_registered()
    # The new engine holds nothing; the sidecar must have noticed and cleared.
    assert truth(engine) == set()
    for i in range(6):
        complete(cluster, f"After the engine restart {i}. " + text(6000 + i, 150))
    converge(cluster, "after an engine restart")
