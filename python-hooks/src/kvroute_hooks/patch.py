"""Installing the hook into vLLM: remember every ``BlockPool`` and start the
snapshot server the first time one is created (only engine-core processes
create one, so API-server and worker processes never bind anything).
"""

import logging
import os
import threading
import weakref
from typing import Any, List, Optional

from .hashes import collect_hashes
from .server import SnapshotServer

log = logging.getLogger("kvroute_hooks")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5560"

_pools: "weakref.WeakSet[Any]" = weakref.WeakSet()
_lock = threading.Lock()
_server: Optional[SnapshotServer] = None


def tracked_pools() -> List[Any]:
    return list(_pools)


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """``tcp://host:port`` shifted by the data-parallel rank, as vLLM does."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, port = endpoint.rsplit(":", 1)
    return f"{base}:{int(port) + rank}"


def _dp_rank() -> int:
    """This engine core's data-parallel rank: from vLLM's current config when
    the BlockPool is built inside it, else ``VLLM_DP_RANK``, else 0."""
    try:
        from vllm.config import get_current_vllm_config  # type: ignore

        rank = get_current_vllm_config().parallel_config.data_parallel_rank
        if isinstance(rank, int):
            return rank
    except Exception:
        pass
    try:
        return int(os.environ.get("VLLM_DP_RANK", "0"))
    except ValueError:
        return 0


def _ensure_server(endpoint: str) -> None:
    global _server
    with _lock:
        if _server is not None:
            return
        try:
            _server = SnapshotServer(endpoint, lambda: collect_hashes(tracked_pools())).start()
        except Exception:  # a busy port must not stop the engine
            log.exception("kvroute snapshot endpoint %s could not start", endpoint)


def install(block_pool_cls: Any, endpoint: Optional[str] = None) -> None:
    """Wraps ``block_pool_cls.__init__`` (idempotent)."""
    if getattr(block_pool_cls, "_kvroute_patched", False):
        return
    original = block_pool_cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _pools.add(self)
        # Resolved here, inside the engine core, where the rank is known.
        base = os.environ.get("KVROUTE_SNAPSHOT_ENDPOINT", DEFAULT_ENDPOINT)
        _ensure_server(endpoint or endpoint_for_rank(base, _dp_rank()))

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    block_pool_cls.__init__ = __init__
    block_pool_cls._kvroute_patched = True


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if os.environ.get("KVROUTE_HOOKS_DISABLE", "") not in ("", "0"):
        return
    try:
        from vllm.v1.core.block_pool import BlockPool  # type: ignore
    except Exception:
        log.warning("kvroute_hooks: vllm.v1.core.block_pool not importable; snapshot hook not installed")
        return
    install(BlockPool)
