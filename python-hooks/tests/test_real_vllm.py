"""Against vLLM's own BlockPool. Needs vLLM (scripts/install-vllm.sh): without
it this fails, saying so."""

import inspect

import pytest

try:
    import vllm.v1.core.block_pool as vllm_block_pool
    import vllm.v1.core.kv_cache_utils as kv_cache_utils
except ImportError as e:
    pytest.fail(f"vLLM (with its v1 engine) is not installed: scripts/install-vllm.sh ({e})", pytrace=False)


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
