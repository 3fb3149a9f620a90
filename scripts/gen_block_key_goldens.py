#!/usr/bin/env python3
"""Independent reference for kvroute block keys (DESIGN.md section 1), using only hashlib.

Writes testdata/block-keys.json; shared/src/keys.rs's golden test compares its own
keys to these. Run: python3 scripts/gen_block_key_goldens.py > testdata/block-keys.json
"""
import hashlib
import json
import struct


def root(model: str, salt: str) -> int:
    d = hashlib.sha256(b"kvroute/root/v1" + model.encode() + b"\x00" + salt.encode()).digest()
    return struct.unpack(">Q", d[:8])[0]


def keys(model: str, salt: str, tokens: list, block_size: int) -> list:
    parent = root(model, salt)
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        payload = b"kvroute/block/v1" + struct.pack(">Q", parent) + b"".join(struct.pack("<I", t) for t in block)
        parent = struct.unpack(">Q", hashlib.sha256(payload).digest()[:8])[0]
        out.append(parent)
    return out


CASES = [
    ("qwen3-8b", "", list(range(40)), 16),
    ("qwen3-8b", "tenant-a", list(range(40)), 16),
    ("sql-adapter", "", list(range(40)), 16),
    ("gpt2", "", [15496, 995, 50256, 0, 1, 2, 3, 4], 4),
    ("m", "", [4294967295, 0, 2147483648, 7] * 4, 4),
    ("m", "", [1, 2, 3], 16),
    ("m", "sälz 東京", list(range(1000, 1100)), 32),
]

cases = [
    {
        "model": m,
        "cache_salt": s,
        "block_size": bs,
        "token_ids": t,
        "root": f"{root(m, s):016x}",
        "keys": [f"{k:016x}" for k in keys(m, s, t, bs)],
    }
    for (m, s, t, bs) in CASES
]
print(json.dumps({"generated_by": "scripts/gen_block_key_goldens.py", "cases": cases}))
