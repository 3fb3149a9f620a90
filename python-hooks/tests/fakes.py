"""Structural stand-ins for vLLM's BlockPool shapes (no vLLM needed)."""

from typing import Any, Dict, NamedTuple


def grouped(hash_bytes: bytes, group: int = 0) -> bytes:
    """vLLM's make_block_hash_with_group_id."""
    return hash_bytes + group.to_bytes(4, "big", signed=False)


class BlockHashToBlockMap:
    """Current vLLM: {BlockHashWithGroupId: KVCacheBlock | {block_id: KVCacheBlock}}."""

    def __init__(self) -> None:
        self._cache: Dict[bytes, Any] = {}

    def insert(self, key: bytes, block: Any) -> None:
        self._cache[key] = block

    def pop(self, key: bytes) -> None:
        self._cache.pop(key, None)


class BlockPool:
    """The attribute the hook reads, as current vLLM has it."""

    def __init__(self, num_gpu_blocks: int = 16, enable_caching: bool = True) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.cached_block_hash_to_block = BlockHashToBlockMap()


class BlockHashType(NamedTuple):
    """Early vLLM v1's block hash."""

    hash_value: int
    token_ids: tuple
    extra_keys: Any = None


class EarlyBlockPool:
    """Early vLLM v1: one dict per KV-cache manager, keyed by BlockHashType."""

    def __init__(self) -> None:
        self.cached_block_hash_to_block = [dict(), dict()]
