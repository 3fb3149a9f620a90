"""The snapshot endpoint: a ZMQ REP socket on a daemon thread.

Protocol (msgpack): request ``{"op": "snapshot"}``; reply
``{"ok": True, "hashes": [...], "count": n, "ts": unix_seconds}`` or
``{"ok": False, "error": "..."}``. The sidecar's ``snapshot.rs`` is the client.
"""

import logging
import threading
import time
from typing import Any, Callable, Iterable, Optional

import msgpack
import zmq

log = logging.getLogger("kvroute_hooks")

_POLL_MS = 200


class SnapshotServer:
    """Serves ``collect()`` (a set of hashes) on ``endpoint`` until ``stop``."""

    def __init__(self, endpoint: str, collect: Callable[[], Iterable[Any]]):
        self._collect = collect
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        # The real address (a ":0" port resolved), for logs and tests.
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvroute-snapshot", daemon=True)

    def start(self) -> "SnapshotServer":
        self._thread.start()
        log.info("kvroute snapshot endpoint on %s", self.endpoint)
        return self

    def stop(self, timeout: Optional[float] = 2.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def _reply(self, request: bytes) -> bytes:
        try:
            body = msgpack.unpackb(request, raw=False)
        except Exception:
            return msgpack.packb({"ok": False, "error": "request is not msgpack"})
        if not isinstance(body, dict) or body.get("op") != "snapshot":
            return msgpack.packb({"ok": False, "error": "unknown op"})
        try:
            hashes = list(self._collect())
        except Exception as e:  # never take the engine down
            log.exception("kvroute snapshot failed")
            return msgpack.packb({"ok": False, "error": type(e).__name__})
        return msgpack.packb({"ok": True, "hashes": hashes, "count": len(hashes), "ts": time.time()})

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if not dict(poller.poll(_POLL_MS)):
                    continue
                request = self._socket.recv()
                self._socket.send(self._reply(request))
        finally:
            self._socket.close(linger=0)
