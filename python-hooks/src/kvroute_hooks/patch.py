"""Installing the hook into vLLM.

Current vLLM (0.32+): wrap ``Scheduler.__init__``. The scheduler lives only in
engine-core processes, owns the GPU ``BlockPool`` (``kv_cache_manager.block_pool``;
offload tiers such as hisparse's ``SharedEventQueueBlockPool`` are other pools
and never reach a snapshot), and knows its data-parallel rank as
``parallel_config.data_parallel_index`` -- the very value vLLM offsets its KV
event ports by. So the snapshot server binds port + that rank, like the events.

Older vLLM without that scheduler: wrap ``BlockPool.__init__`` instead, keep
GPU pools only, and take the rank from the current config or ``VLLM_DP_RANK``.
"""

import logging
import os
import threading
import weakref
from typing import Any, Callable, List, Optional

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


def _base_endpoint() -> str:
    return os.environ.get("KVROUTE_SNAPSHOT_ENDPOINT", DEFAULT_ENDPOINT)


def rank_of(parallel_config: Any) -> int:
    """The rank vLLM offsets event ports by: ``data_parallel_index`` (set for
    MoE and independent dense ranks alike), else ``data_parallel_rank``."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        rank = getattr(parallel_config, name, None)
        if isinstance(rank, int):
            return rank
    return 0


def _env_rank() -> int:
    """Older vLLM: the current config when it is set, else ``VLLM_DP_RANK``."""
    try:
        from vllm.config import get_current_vllm_config  # type: ignore

        return rank_of(get_current_vllm_config().parallel_config)
    except Exception:
        pass
    try:
        return int(os.environ.get("VLLM_DP_RANK", "0"))
    except ValueError:
        return 0


def _is_gpu_pool(pool: Any) -> bool:
    return getattr(pool, "medium", "GPU") == "GPU"


def events_port(kv_events_config: Any, rank: int) -> Optional[int]:
    """The TCP port this rank publishes KV events on (vLLM offsets the
    configured endpoint's port by the rank), or ``None`` when there is none
    or the OS picks it (port 0)."""
    endpoint = getattr(kv_events_config, "endpoint", None)
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None
    try:
        port = int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        return None
    return port + rank if port > 0 else None


def _ensure_server(endpoint: Callable[[], str], events: Optional[int] = None) -> None:
    """Starts the endpoint once per process. Runs inside vLLM's own
    constructors: nothing here may raise into them (a busy port, a malformed
    ``KVROUTE_SNAPSHOT_ENDPOINT``), so the endpoint is resolved under the
    same guard."""
    global _server
    with _lock:
        if _server is not None:
            return
        address = "?"
        try:
            address = endpoint()
            _server = SnapshotServer(address, lambda: collect_hashes(tracked_pools()), events).start()
        except Exception:
            log.exception("kvroute snapshot endpoint %s could not start", address)


def install_scheduler(scheduler_cls: Any, endpoint: Optional[str] = None) -> None:
    """Wraps ``scheduler_cls.__init__`` (idempotent): tracks the scheduler's GPU
    block pool and serves it on the endpoint of the scheduler's DP rank."""
    if getattr(scheduler_cls, "_kvroute_patched", False):
        return
    original = scheduler_cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        if pool is None:
            log.warning("kvroute_hooks: this scheduler has no kv_cache_manager.block_pool; no snapshot")
            return
        _pools.add(pool)
        rank = rank_of(getattr(self, "parallel_config", None))
        # Named in every reply: the sidecar refuses another engine's snapshot.
        events = events_port(getattr(self, "kv_events_config", None), rank)
        _ensure_server(lambda: endpoint or endpoint_for_rank(_base_endpoint(), rank), events)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    scheduler_cls.__init__ = __init__
    scheduler_cls._kvroute_patched = True


def install(block_pool_cls: Any, endpoint: Optional[str] = None) -> None:
    """Older vLLM: wraps ``block_pool_cls.__init__`` (idempotent)."""
    if getattr(block_pool_cls, "_kvroute_patched", False):
        return
    original = block_pool_cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not _is_gpu_pool(self):
            return
        _pools.add(self)
        # Resolved here, inside the engine core, where the rank is known.
        _ensure_server(lambda: endpoint or endpoint_for_rank(_base_endpoint(), _env_rank()))

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    block_pool_cls.__init__ = __init__
    block_pool_cls._kvroute_patched = True


def disabled(value: Optional[str]) -> bool:
    """Whether ``KVROUTE_HOOKS_DISABLE`` switches the hook off: unset, empty,
    ``0``, ``false``, ``no`` and ``off`` leave it on (``=false`` turned it off
    before, as did any value but ``0``), ``1``, ``true``, ``yes`` and ``on``
    switch it off, and any other value switches it off with a warning."""
    v = (value or "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v not in ("1", "true", "yes", "on"):
        log.warning("KVROUTE_HOOKS_DISABLE=%r is not 1/true/yes/on or 0/false/no/off: the hook is off", value)
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if disabled(os.environ.get("KVROUTE_HOOKS_DISABLE")):
        return
    try:
        from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore
    except Exception:
        Scheduler = None
    if Scheduler is not None:
        install_scheduler(Scheduler)
        return
    try:
        from vllm.v1.core.block_pool import BlockPool  # type: ignore
    except Exception:
        log.warning("kvroute_hooks: vllm.v1.core.block_pool not importable; snapshot hook not installed")
        return
    install(BlockPool)
