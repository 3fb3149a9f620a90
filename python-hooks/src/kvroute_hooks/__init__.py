"""kvroute_hooks: a vLLM general plugin answering "which blocks do you hold?".

vLLM has no API that lists the prefix cache. This plugin runs inside the
engine-core process (vLLM loads every ``vllm.general_plugins`` entry point in
each of its processes), records the scheduler's GPU ``BlockPool``, and serves
the set of cached block hashes on a local ZMQ REP socket. The kvroute
sidecar asks for it at every sync and drops blocks the engine no longer holds
(anti-entropy from the source of truth, for events lost in transit).

Hashes are converted exactly as vLLM converts them for KV events, so they
compare equal to the ``block_hashes`` of ``BlockStored`` events.

Environment (read once, at plugin load, inside the engine):

- ``KVROUTE_SNAPSHOT_ENDPOINT``: where to bind, default ``tcp://127.0.0.1:5560``;
  data-parallel rank ``r`` binds port + r, like vLLM's event publisher (the
  rank is the scheduler's ``parallel_config.data_parallel_index``).
- ``KVROUTE_HOOKS_DISABLE=1`` (or ``true``, ``yes``, ``on``): do nothing.
"""

from .hashes import collect_hashes, convert_key
from .patch import install, install_scheduler, register, tracked_pools
from .server import SnapshotServer

__all__ = ["SnapshotServer", "collect_hashes", "convert_key", "install", "install_scheduler", "register", "tracked_pools"]
