"""Against vLLM's own BlockPool. Needs vLLM (scripts/install-vllm.sh): without
it this fails, saying so."""

import inspect

import pytest

# Failed per test, not at import (which would stop the whole pytest run).
try:
    import vllm.v1.core.block_pool as vllm_block_pool
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    MISSING = None
except ImportError as e:
    vllm_block_pool = kv_cache_utils = None
    MISSING = f"vLLM (with its v1 engine) is not installed: scripts/install-vllm.sh ({e})"


@pytest.fixture(autouse=True)
def _needs_vllm():
    if MISSING:
        pytest.fail(MISSING, pytrace=False)


def make_pool():
    BlockPool = vllm_block_pool.BlockPool
    params = inspect.signature(BlockPool.__init__).parameters
    kwargs = {"num_gpu_blocks": 8, "enable_caching": True}
    for name in ("hash_block_size", "num_single_type_managers"):
        if name in params and params[name].default is inspect.Parameter.empty:
            kwargs[name] = 16 if name == "hash_block_size" else 1
    return BlockPool(**{k: v for k, v in kwargs.items() if k in params})


def test_hashes_of_the_real_block_pool_convert_like_events():
    from kvroute_hooks import collect_hashes

    make_key = getattr(kv_cache_utils, "make_block_hash_with_group_id", None)
    if make_key is None:
        pytest.fail("this vLLM predates BlockHashWithGroupId bytes keys: the plugin needs vLLM 0.11 or later")
    pool = make_pool()
    block = pool.blocks[1]
    digest = bytes(range(32))
    pool.cached_block_hash_to_block.insert(make_key(digest, 0), block)
    expected = kv_cache_utils.maybe_convert_block_hash(digest)
    assert collect_hashes([pool]) == {expected}


def test_the_fast_path_converts_as_vllms_helpers_do(monkeypatch):
    """Many keys, two groups: the one-comprehension conversion gives what
    vLLM's helpers give key by key, in int mode and in bytes mode."""
    import hashlib

    from kvroute_hooks import hashes

    make_key = kv_cache_utils.make_block_hash_with_group_id
    pool = make_pool()
    block = pool.blocks[1]
    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(500)]
    for i, d in enumerate(digests):
        pool.cached_block_hash_to_block.insert(make_key(d, i % 3 == 0), block)
    keys = hashes._keys_of(pool.cached_block_hash_to_block)
    helpers = hashes._vllm_helpers()
    slow = {hashes.convert_key(k, helpers[0], helpers[1]) for k in keys if hashes.group_of(k, helpers[2]) == 0}
    fast = hashes._convert_group0_fast(keys, *helpers)
    assert fast is not None, "the fast path refused vLLM's own keys"
    assert set(fast) == slow and len(slow) == sum(1 for i in range(500) if i % 3 != 0)
    assert hashes.collect_hashes([pool]) == slow
    # Helpers that convert otherwise than the layout (a vLLM that changed
    # it) send every key the slow way.
    def other_convert(raw):
        return int.from_bytes(raw[:8], "big")

    assert hashes._convert_group0_fast(keys, helpers[0], other_convert, helpers[2]) is None


def test_the_fast_path_checks_a_sample_wherever_group_0_starts():
    """Group 0's first key far down the list is still checked: with no
    group-0 key sampled, the fast path would be trusted unchecked."""
    import hashlib

    from kvroute_hooks import hashes

    make_key = kv_cache_utils.make_block_hash_with_group_id
    keys = [make_key(hashlib.sha256(str(i).encode()).digest(), 1) for i in range(200)]
    keys.append(make_key(hashlib.sha256(b"zero").digest(), 0))
    helpers = hashes._vllm_helpers()
    assert hashes._convert_group0_fast(keys, *helpers) == [hashes.convert_key(keys[-1], helpers[0], helpers[1])]

    def other_convert(raw):
        return int.from_bytes(raw[:8], "big")

    assert hashes._convert_group0_fast(keys, helpers[0], other_convert, helpers[2]) is None
    assert hashes._convert_group0_fast([k for k in keys if k != keys[-1]], *helpers) is None, "nothing sampled"
