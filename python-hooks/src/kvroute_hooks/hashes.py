"""Reading the cached block hashes out of a vLLM ``BlockPool``.

``BlockPool.cached_block_hash_to_block`` changed shape across vLLM versions:

- current: a ``BlockHashToBlockMap`` whose ``_cache`` dict is keyed by
  ``BlockHashWithGroupId`` (hash bytes + 4-byte big-endian group id);
- mid-2025: a plain dict with the same bytes keys;
- early v1: a list (one per KV-cache manager) of dicts keyed by a
  ``BlockHashType`` named tuple whose ``hash_value`` is an int.

Events publish ``maybe_convert_block_hash(get_block_hash(key))``: with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (the default) the big-endian integer of
the hash bytes masked to 64 bits, i.e. its last 8 bytes; otherwise the raw
bytes. We use vLLM's own functions when they exist, and the same rule when not.
"""

import os
from typing import Any, Iterable, List, Optional, Set, Union

ExternalHash = Union[int, bytes]

_MASK64 = (1 << 64) - 1
# Lengths of BlockHashWithGroupId keys: sha256 (32) or xxhash128 (16), + 4.
_GROUPED_LENGTHS = (36, 20)


class CacheUnavailable(RuntimeError):
    """The engine's prefix cache could not be read. Answered as an error,
    never as an empty snapshot: the sidecar drops whatever a snapshot does
    not list."""


def _vllm_helpers():
    try:
        from vllm.v1.core import kv_cache_utils as u  # type: ignore
    except Exception:  # vLLM absent or a version without these helpers
        return None, None, None
    return (
        getattr(u, "get_block_hash", None),
        getattr(u, "maybe_convert_block_hash", None),
        getattr(u, "get_group_id", None),
    )


def _use_int_hashes() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").lower() not in ("0", "false", "no")


def group_of(key: Any, get_group_id=None) -> int:
    """The KV-cache group of a ``BlockHashWithGroupId`` bytes key (0 otherwise):
    vLLM's own ``get_group_id`` where it has one (every bytes key is grouped
    there, whatever its hash's length), else by the key's length."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        if get_group_id is not None:
            return get_group_id(bytes(key))
        if len(key) in _GROUPED_LENGTHS:
            return int.from_bytes(bytes(key[-4:]), "big")
        return 0
    group = getattr(key, "group_id", None)
    return group if isinstance(group, int) else 0


def convert_key(key: Any, get_block_hash=None, maybe_convert=None) -> ExternalHash:
    """One cache-map key as vLLM's KV events would publish it."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        # Bytes keys are BlockHashWithGroupId (hash + 4-byte group id) in every
        # vLLM with get_block_hash; without it, a bare digest length means a
        # version that keyed by the hash alone.
        if get_block_hash is not None:
            raw = bytes(get_block_hash(raw))
        elif len(raw) in _GROUPED_LENGTHS:
            raw = raw[:-4]
        if maybe_convert is not None:
            return maybe_convert(raw)
        if _use_int_hashes():
            return int.from_bytes(raw, "big") & _MASK64
        return raw
    inner = getattr(key, "block_hash", None)  # NamedTuple BlockHashWithGroupId (vLLM 0.9)
    if inner is not None:
        return convert_key(inner, get_block_hash, maybe_convert)
    hash_value = getattr(key, "hash_value", None)  # NamedTuple BlockHashType
    if hash_value is not None:
        return _as_wire_int(hash_value) if isinstance(hash_value, int) else convert_key(hash_value)
    if isinstance(key, int):
        return _as_wire_int(key)
    raise TypeError(f"unsupported block hash key type {type(key).__name__}")


def _as_wire_int(n: int) -> int:
    # Python's hash() is signed 64-bit; msgpack carries it as int64 and the
    # sidecar keeps the bits, exactly as for events.
    return n if -(1 << 63) <= n <= _MASK64 else n & _MASK64


def _keys_of(cache_map: Any) -> List[Any]:
    # list(dict) copies the keys in one C call under the GIL: a consistent
    # snapshot even while the scheduler thread mutates the map. Retry anyway
    # in case an implementation iterates in Python.
    for _ in range(5):
        try:
            inner = getattr(cache_map, "_cache", None)
            if inner is not None:
                return list(inner)
            if isinstance(cache_map, (list, tuple)):
                return [k for d in list(cache_map) for k in list(d)]
            return list(cache_map)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    raise CacheUnavailable("the cache map kept changing while it was read")


def collect_hashes(pools: Iterable[Any]) -> Set[ExternalHash]:
    """The union of cached block hashes of ``pools``, converted for the wire.

    Only what the sidecar routes on: pools whose ``medium`` is GPU (offload
    tiers publish their own events, with medium CPU) and KV-cache group 0
    (hybrid models repeat the same hashes in their other groups).

    Raises ``CacheUnavailable`` when there is no GPU pool yet, or one without
    the map this reads (a vLLM that renamed it): an empty set would tell the
    sidecar that the engine holds nothing."""
    get_block_hash, maybe_convert, get_group_id = _vllm_helpers()
    gpu_pools = [pool for pool in pools if getattr(pool, "medium", "GPU") == "GPU"]
    if not gpu_pools:
        raise CacheUnavailable("no GPU block pool is tracked (the engine has not built its scheduler yet)")
    out: Set[ExternalHash] = set()
    for pool in gpu_pools:
        cache_map = getattr(pool, "cached_block_hash_to_block", None)
        if cache_map is None:
            raise CacheUnavailable(
                f"{type(pool).__name__} has no cached_block_hash_to_block: a vLLM this plugin does not know"
            )
        keys = _keys_of(cache_map)
        fast = _convert_group0_fast(keys, get_block_hash, maybe_convert, get_group_id)
        if fast is not None:
            out.update(fast)
            continue
        for key in keys:
            if group_of(key, get_group_id) == 0:
                out.add(convert_key(key, get_block_hash, maybe_convert))
    return out


# Keys checked against vLLM's own helpers before the fast path is trusted.
_FAST_PATH_SAMPLE = 16


def _convert_group0_fast(keys: List[Any], get_block_hash, maybe_convert, get_group_id) -> Optional[List[ExternalHash]]:
    """Group 0's keys converted in one comprehension, for the layout every
    vLLM with ``get_block_hash`` uses (``BlockHashWithGroupId``: the hash's
    bytes, then the group id in 4 big-endian bytes): three helper calls a key
    took the engine's GIL for ~0.5 s per 100k keys, every sync. ``None``
    (take the slow path) unless every key is such bytes and a sample
    converts exactly as vLLM's helpers convert it."""
    if get_block_hash is None or get_group_id is None or not all(type(k) is bytes for k in keys):
        return None
    zero = b"\0\0\0\0"
    if _use_int_hashes():
        fast = [int.from_bytes(k[-12:-4], "big") for k in keys if len(k) >= 12 and k[-4:] == zero]
    else:
        fast = [k[:-4] for k in keys if len(k) >= 12 and k[-4:] == zero]
    # The first group-0 keys by vLLM's own reading, wherever they stand
    # (none checked: the slow path), must be the first the layout finds, and
    # convert alike.
    sample = []
    for k in keys:
        if get_group_id(k) == 0:
            sample.append(k)
            if len(sample) == _FAST_PATH_SAMPLE:
                break
    if not sample or fast[: len(sample)] != [convert_key(k, get_block_hash, maybe_convert) for k in sample]:
        return None
    if [k for k in keys[: keys.index(sample[-1]) + 1] if len(k) >= 12 and k[-4:] == zero] != sample:
        return None
    return fast
