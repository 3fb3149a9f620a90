#!/usr/bin/env python3
"""Captures what a real vLLM publishes, byte for byte, as golden test data for
the sidecar's decoder (testdata/vllm-events/vllm-VERSION.jsonl and
vllm-VERSION.replay-from-5.json, the format of the existing captures).

Run it with the vLLM venv's Python against a fresh engine started by
scripts/vllm-serve.sh with a small KV capacity (so it evicts), e.g.:

    scripts/vllm-serve.sh --port 18001 --events-port 15557 --replay-port 15558 \\
        --snapshot-port 15560 --num-blocks 8 &
    target/vllm-venv/bin/python scripts/capture_vllm_events.py \\
        --engine http://127.0.0.1:18001 --events 15557 --replay 15558

It sends requests that store blocks, hit them, evict them and reset the
cache, and keeps the first 8 messages that carry events.
"""

import argparse
import json
import pathlib
import time

import msgpack
import requests
import zmq

OUT = pathlib.Path(__file__).resolve().parents[1] / "testdata" / "vllm-events"
WANT = 8


def hash_json(h):
    return {"bytes_hex": h.hex()} if isinstance(h, bytes) else {"u64": h & (2**64 - 1)}


def expect(seq: int, payload: bytes) -> dict:
    """The decoded batch in the shape sidecar/tests/golden_decode.rs renders."""
    ts, events, *rest = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    out = []
    for ev in events:
        kind = ev["type"]
        if kind == "BlockStored":
            out.append(
                {
                    "type": kind,
                    "block_hashes": [hash_json(h) for h in ev["block_hashes"]],
                    "parent_block_hash": None if ev["parent_block_hash"] is None else hash_json(ev["parent_block_hash"]),
                    "token_ids": ev["token_ids"],
                    "block_size": ev["block_size"],
                    "lora_id": ev["lora_id"],
                    "medium": ev["medium"],
                    "lora_name": ev["lora_name"],
                }
            )
        elif kind == "BlockRemoved":
            out.append({"type": kind, "block_hashes": [hash_json(h) for h in ev["block_hashes"]], "medium": ev["medium"]})
        else:
            out.append({"type": kind})
    return {"seq": seq, "ts": ts, "data_parallel_rank": rest[0] if rest else None, "events": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--events", type=int, required=True)
    ap.add_argument("--replay", type=int, required=True)
    ap.add_argument("--model", default="tiny-qwen3")
    args = ap.parse_args()
    version = requests.get(f"{args.engine}/version", timeout=5).json()["version"].split("+")[0]

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 2000)
    sub.connect(f"tcp://127.0.0.1:{args.events}")
    time.sleep(1.0)  # a SUB misses what is published before it is connected

    def complete(prompt: str):
        body = {"model": args.model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
        requests.post(f"{args.engine}/v1/completions", json=body, timeout=60).raise_for_status()

    base = " ".join(f"word{i}" for i in range(40))
    complete(base)  # stores
    complete(base + " and more")  # hits, stores the tail
    for i in range(4):  # evicts (a small KV capacity)
        complete(" ".join(f"other{i}x{j}" for j in range(50)))
    requests.post(f"{args.engine}/reset_prefix_cache", timeout=10).raise_for_status()
    for i in range(4):  # enough batches for the capture
        complete(f"again {i} " + base)

    lines = []
    while len(lines) < WANT:
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            break
        n = int.from_bytes(seq, "big")
        lines.append({"frames_hex": [topic.hex(), seq.hex(), payload.hex()], "expect": expect(n, payload)})
    if len(lines) < WANT:
        raise SystemExit(f"only {len(lines)} messages arrived; expected {WANT}")
    first = lines[0]["expect"]["seq"]
    if first != 0:
        raise SystemExit(f"the first message has seq {first}: capture from an engine that has served nothing yet")
    (OUT / f"vllm-{version}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{args.replay}")
    start = first + 5
    request = [b"", start.to_bytes(8, "big")]
    dealer.send_multipart(request)
    replies = []
    while True:
        frames = dealer.recv_multipart()
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if seq == -1:
            replies.append([f.hex() for f in frames])
            break
        if seq < first + WANT:
            replies.append([f.hex() for f in frames])
    exchange = {"request_frames_hex": [f.hex() for f in request], "reply_messages_hex": replies}
    (OUT / f"vllm-{version}.replay-from-5.json").write_text(json.dumps(exchange, indent=1) + "\n")
    print(f"captured {len(lines)} messages from vLLM {version} into {OUT}")


if __name__ == "__main__":
    main()
