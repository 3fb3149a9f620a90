import hashlib

import msgpack
import zmq

from kvroute_hooks import SnapshotServer, install, tracked_pools
from kvroute_hooks.patch import endpoint_for_rank

from fakes import grouped


def ask(endpoint: str, body) -> dict:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    try:
        s.send(msgpack.packb(body))
        return msgpack.unpackb(s.recv(), raw=False)
    finally:
        s.close()


def test_serves_the_snapshot_protocol():
    server = SnapshotServer("tcp://127.0.0.1:0", lambda: {1, 2**64 - 1}).start()
    try:
        reply = ask(server.endpoint, {"op": "snapshot"})
        assert reply["ok"] is True
        assert sorted(reply["hashes"]) == [1, 2**64 - 1]
        assert reply["count"] == 2
        assert ask(server.endpoint, {"op": "nope"}) == {"ok": False, "error": "unknown op"}
    finally:
        server.stop()


def test_collector_errors_are_replies_not_crashes():
    def broken():
        raise ValueError("boom")

    server = SnapshotServer("tcp://127.0.0.1:0", broken).start()
    try:
        assert ask(server.endpoint, {"op": "snapshot"}) == {"ok": False, "error": "ValueError"}
    finally:
        server.stop()


def test_install_tracks_pools_and_serves_them():
    class BlockPool:
        def __init__(self, num_gpu_blocks: int) -> None:
            from fakes import BlockHashToBlockMap

            self.cached_block_hash_to_block = BlockHashToBlockMap()

    install(BlockPool, endpoint="tcp://127.0.0.1:0")
    install(BlockPool, endpoint="tcp://127.0.0.1:0")  # idempotent
    pool = BlockPool(8)
    assert pool in tracked_pools()
    h = hashlib.sha256(b"x").digest()
    pool.cached_block_hash_to_block.insert(grouped(h), object())
    from kvroute_hooks import patch

    assert patch._server is not None
    reply = ask(patch._server.endpoint, {"op": "snapshot"})
    assert int.from_bytes(h[-8:], "big") in reply["hashes"]


def test_rank_offsets_the_port():
    assert endpoint_for_rank("tcp://127.0.0.1:5560", 0) == "tcp://127.0.0.1:5560"
    assert endpoint_for_rank("tcp://127.0.0.1:5560", 3) == "tcp://127.0.0.1:5563"
