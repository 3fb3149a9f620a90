import hashlib

import pytest

from kvroute_hooks import collect_hashes, convert_key
from kvroute_hooks.hashes import CacheUnavailable

from fakes import BlockHashType, BlockPool, EarlyBlockPool, grouped


def vllm_int(hash_bytes: bytes) -> int:
    """vLLM's maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1."""
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


def digest(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_current_map_strips_group_and_converts_like_events():
    pool = BlockPool()
    for i in range(5):
        pool.cached_block_hash_to_block.insert(grouped(digest(i)), object())
    # The same hash in a second KV-cache group (hybrid models) counts once.
    pool.cached_block_hash_to_block.insert(grouped(digest(0), 1), object())
    assert collect_hashes([pool]) == {vllm_int(digest(i)) for i in range(5)}


def test_bytes_mode_sends_raw_digests(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    pool = BlockPool()
    pool.cached_block_hash_to_block.insert(grouped(digest(1)), object())
    assert collect_hashes([pool]) == {digest(1)}


def test_xxhash128_keys():
    h = bytes(range(16))
    assert convert_key(grouped(h)) == vllm_int(h)


def test_early_v1_named_tuple_keys_and_signed_hashes():
    pool = EarlyBlockPool()
    pool.cached_block_hash_to_block[0][BlockHashType(-5, (1, 2))] = {}
    pool.cached_block_hash_to_block[1][BlockHashType(2**64 - 1, (3,))] = {}
    assert collect_hashes([pool]) == {-5, 2**64 - 1}


def test_evicted_blocks_disappear():
    pool = BlockPool()
    m = pool.cached_block_hash_to_block
    m.insert(grouped(digest(1)), object())
    m.insert(grouped(digest(2)), object())
    m.pop(grouped(digest(1)))
    assert collect_hashes([pool]) == {vllm_int(digest(2))}


def test_union_over_pools():
    a, b = BlockPool(), BlockPool()
    a.cached_block_hash_to_block.insert(grouped(digest(1)), object())
    b.cached_block_hash_to_block.insert(grouped(digest(2)), object())
    assert collect_hashes([a, b]) == {vllm_int(digest(1)), vllm_int(digest(2))}


def test_a_cache_that_cannot_be_read_is_an_error_not_an_empty_snapshot():
    # An empty set would tell the sidecar the engine holds nothing, and it
    # would drop every block: a renamed attribute, or no pool yet, is an error.
    a = BlockPool()
    a.cached_block_hash_to_block.insert(grouped(digest(1)), object())
    with pytest.raises(CacheUnavailable, match="cached_block_hash_to_block"):
        collect_hashes([a, object()])
    with pytest.raises(CacheUnavailable, match="no GPU block pool"):
        collect_hashes([])


def test_only_gpu_pools_and_group_zero_reach_a_snapshot():
    gpu, cpu = BlockPool(), BlockPool()
    cpu.medium = "CPU"  # an offload tier (e.g. hisparse's host pool)
    a, b = hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()
    gpu.cached_block_hash_to_block.insert(grouped(a, 0), object())
    gpu.cached_block_hash_to_block.insert(grouped(b, 1), object())  # hybrid model, group 1
    cpu.cached_block_hash_to_block.insert(grouped(b, 0), object())
    assert collect_hashes([gpu, cpu]) == {int.from_bytes(a[-8:], "big")}
