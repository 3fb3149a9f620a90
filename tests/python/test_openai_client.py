"""The official OpenAI Python client, streaming and not, through the router."""
import json
import urllib.request

import pytest

from prerequisites import needed

openai, _needs_openai = needed("openai", "pip install openai")


MODEL = "sim-model"


@pytest.fixture(scope="module")
def client(router_url):
    return openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="You are a helpful assistant. Say hi.", max_tokens=5)
    assert r.choices[0].text
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens == 5


def test_completion_stream(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Count to five.", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text
    assert any(c.usage and c.usage.completion_tokens == 5 for c in chunks)


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        max_tokens=4,
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream please."}], max_tokens=6, stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(deltas) > 1
    assert "".join(deltas)


def test_models(client):
    assert MODEL in [m.id for m in client.models.list().data]


def test_repeat_sticks_to_one_worker(client, router_url):
    prompt = "A long shared system prompt. " * 40
    workers = set()
    for i in range(4):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt + f"Q{i}", max_tokens=2)
        workers.add(raw.headers["x-kvroute-worker"])
    assert len(workers) == 1
    # By what that worker holds, not by a hash of the first block alone: the
    # router explains the next one as a match there (the sim cluster keys
    # bytes, no tokenizer: a character is a token).
    (holder,) = workers
    body = json.dumps({"model": MODEL, "prompt": prompt + "Q4"}).encode()
    req = urllib.request.Request(f"{router_url}/debug/route", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        explained = json.load(resp)
    assert explained["decision"]["worker"] == holder, explained
    row = next(w for w in explained["workers"] if w["id"] == holder)
    assert row["matched_tokens"] >= len(prompt) // 2, row
