"""The snapshot endpoint: a ZMQ REP socket on a daemon thread.

Protocol (msgpack): request ``{"op": "snapshot"}``; reply
``{"ok": True, "hashes": [...], "count": n, "ts": unix_seconds}`` (and
``"events_port"``: the TCP port this engine rank publishes its KV events on,
when known) or ``{"ok": False, "error": "..."}``. The sidecar's
``snapshot.rs`` is the client: it refuses a snapshot whose ``events_port`` is
not the one it follows (another engine's plugin on a shared host answered).

The socket runs inside the engine and answers whoever reaches its port, so:
requests are at most 4 KiB (``MAXMSGSIZE``: libzmq drops the connection of a
peer that sends more), few are queued either way, a request of several
frames gets an error reply (a REP that replied before reading them all would
be stuck), and any failure is logged and the socket made again.

Every answer is read from the cache when its request arrives, never kept
from an earlier one: the sidecar drops blocks a snapshot does not list
unless they were stored after it asked, so an older answer would drop
blocks stored in between.
"""

import logging
import threading
import time
from typing import Any, Callable, Iterable, Optional

import msgpack
import zmq

log = logging.getLogger("kvroute_hooks")

_POLL_MS = 200
_MAX_REQUEST_BYTES = 4096
_QUEUE = 4


class SnapshotServer:
    """Serves ``collect()`` (a set of hashes) on ``endpoint`` until ``stop``."""

    def __init__(self, endpoint: str, collect: Callable[[], Iterable[Any]], events_port: Optional[int] = None):
        self._collect = collect
        self._events_port = events_port
        self._ctx = zmq.Context.instance()
        self._socket = self._bind(endpoint)
        # The real address (a ":0" port resolved), for logs and tests; the
        # socket is made again on this address after a failure.
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvroute-snapshot", daemon=True)

    def start(self) -> "SnapshotServer":
        self._thread.start()
        log.info("kvroute snapshot endpoint on %s", self.endpoint)
        return self

    def _bind(self, endpoint: str) -> "zmq.Socket":
        socket = self._ctx.socket(zmq.REP)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
            socket.setsockopt(zmq.RCVHWM, _QUEUE)
            socket.setsockopt(zmq.SNDHWM, _QUEUE)
            socket.bind(endpoint)
        except Exception:
            socket.close(linger=0)
            raise
        return socket

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
            log.warning("kvroute snapshot failed: %s: %s", type(e).__name__, e)
            return msgpack.packb({"ok": False, "error": f"{type(e).__name__}: {e}"})
        reply = {"ok": True, "hashes": hashes, "count": len(hashes), "ts": time.time()}
        if self._events_port is not None:
            reply["events_port"] = self._events_port
        return msgpack.packb(reply)

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                self._serve_until_failure()
            except Exception:  # never let one bad peer end the endpoint
                log.exception("kvroute snapshot endpoint failed; making its socket again")
                self._socket.close(linger=0)
                while not self._stopping.is_set():
                    try:
                        self._socket = self._bind(self.endpoint)
                        break
                    except Exception:
                        log.exception("kvroute snapshot endpoint %s could not be bound again", self.endpoint)
                        self._stopping.wait(1.0)
        self._socket.close(linger=0)

    def _serve_until_failure(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not dict(poller.poll(_POLL_MS)):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) == 1:
                reply = self._reply(frames[0])
            else:
                reply = msgpack.packb({"ok": False, "error": "a request is one frame"})
            self._socket.send(reply)
