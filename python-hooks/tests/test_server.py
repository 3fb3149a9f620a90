import hashlib

import msgpack
import pytest
import zmq

from kvroute_hooks import SnapshotServer, install, tracked_pools
from kvroute_hooks.patch import disabled, endpoint_for_rank

from fakes import grouped


def req(endpoint: str, timeout_ms: int = 5000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.connect(endpoint)
    return s


def ask(endpoint: str, body) -> dict:
    s = req(endpoint)
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
        assert ask(server.endpoint, {"op": "snapshot"}) == {"ok": False, "error": "ValueError: boom"}
    finally:
        server.stop()


def test_a_request_of_several_frames_is_answered_and_the_endpoint_lives_on():
    # A REP that replied before reading every frame would be stuck (EFSM),
    # and its thread died: no snapshot until the engine restarted.
    server = SnapshotServer("tcp://127.0.0.1:0", lambda: {7}).start()
    try:
        s = req(server.endpoint)
        s.send_multipart([msgpack.packb({"op": "snapshot"}), b"more"])
        assert msgpack.unpackb(s.recv(), raw=False) == {"ok": False, "error": "a request is one frame"}
        s.close()
        assert ask(server.endpoint, {"op": "snapshot"})["hashes"] == [7]
    finally:
        server.stop()


def test_an_oversized_request_is_dropped_and_the_endpoint_lives_on():
    server = SnapshotServer("tcp://127.0.0.1:0", lambda: {7}).start()
    try:
        s = req(server.endpoint, timeout_ms=1000)
        s.send(b"\0" * (1 << 20))
        with pytest.raises(zmq.Again):
            s.recv()  # libzmq closed that connection: no answer
        s.close()
        assert ask(server.endpoint, {"op": "snapshot"})["hashes"] == [7]
    finally:
        server.stop()


def test_every_answer_is_read_when_its_request_arrives():
    # The sidecar drops what a snapshot does not list unless it was stored
    # after it asked: an answer kept from an earlier request (a cache, to
    # spare the engine's GIL) dropped blocks stored in between.
    calls = []

    def collect():
        calls.append(1)
        return {len(calls)}

    server = SnapshotServer("tcp://127.0.0.1:0", collect).start()
    try:
        replies = [ask(server.endpoint, {"op": "snapshot"})["hashes"] for _ in range(3)]
        assert replies == [[1], [2], [3]]
    finally:
        server.stop()


def test_a_malformed_endpoint_never_raises_into_the_engine(monkeypatch):
    from fakes import BlockPool
    from kvroute_hooks import install_scheduler, patch

    class ParallelConfig:
        data_parallel_index = 1

    class KVCacheManager:
        def __init__(self) -> None:
            self.block_pool = BlockPool()

    class Scheduler:
        def __init__(self) -> None:
            self.parallel_config = ParallelConfig()
            self.kv_cache_manager = KVCacheManager()

    monkeypatch.setenv("KVROUTE_SNAPSHOT_ENDPOINT", "tcp://127.0.0.1")  # no port
    monkeypatch.setattr(patch, "_server", None)
    install_scheduler(Scheduler)
    sched = Scheduler()  # rank 1 offsets the port: this raised ValueError here
    assert sched.kv_cache_manager.block_pool in tracked_pools()
    assert patch._server is None


def test_install_tracks_pools_and_serves_them():
    class BlockPool:
        def __init__(self, num_gpu_blocks: int) -> None:
            from fakes import BlockHashToBlockMap

            self.cached_block_hash_to_block = BlockHashToBlockMap()

    original = BlockPool.__init__
    install(BlockPool, endpoint="tcp://127.0.0.1:0")
    install(BlockPool, endpoint="tcp://127.0.0.1:0")  # idempotent
    assert BlockPool.__init__.__wrapped__ is original, "wrapped twice"
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


def _free_port() -> int:
    # The snapshot endpoint is given as a base port that rank r offsets, so the
    # test needs a concrete one: take a free port from the OS.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_scheduler_hook_serves_the_gpu_pool_on_port_plus_dp_index(monkeypatch):
    from fakes import BlockPool
    from kvroute_hooks import install_scheduler, patch

    class ParallelConfig:
        data_parallel_rank = 0  # vLLM resets this for independent dense ranks
        data_parallel_index = 1  # ... and offsets its event ports by this one

    class KVCacheManager:
        def __init__(self) -> None:
            self.block_pool = BlockPool()

    class KVEventsConfig:
        endpoint = "tcp://*:5557"

    class Scheduler:
        def __init__(self, vllm_config) -> None:
            self.parallel_config = ParallelConfig()
            self.kv_cache_manager = KVCacheManager()
            self.kv_events_config = KVEventsConfig()

    base = _free_port() - 1  # rank 1 binds base + 1: a port known to be free
    monkeypatch.setenv("KVROUTE_SNAPSHOT_ENDPOINT", f"tcp://127.0.0.1:{base}")
    monkeypatch.setattr(patch, "_server", None)
    install_scheduler(Scheduler)
    sched = Scheduler(vllm_config=None)
    try:
        assert sched.kv_cache_manager.block_pool in tracked_pools()
        assert patch._server is not None
        assert patch._server.endpoint == f"tcp://127.0.0.1:{base + 1}"
        h = hashlib.sha256(b"y").digest()
        sched.kv_cache_manager.block_pool.cached_block_hash_to_block.insert(grouped(h), object())
        reply = ask(patch._server.endpoint, {"op": "snapshot"})
        assert int.from_bytes(h[-8:], "big") in reply["hashes"]
        # The events port of rank 1 (base + 1), which the sidecar checks.
        assert reply["events_port"] == 5558
    finally:
        patch._server.stop()
        patch._server = None


def test_block_pool_hook_ignores_cpu_pools(monkeypatch):
    from kvroute_hooks import patch

    class BlockPool:
        def __init__(self, medium: str = "GPU") -> None:
            from fakes import BlockHashToBlockMap

            self.medium = medium
            self.cached_block_hash_to_block = BlockHashToBlockMap()

    monkeypatch.setattr(patch, "_ensure_server", lambda endpoint: None)
    install(BlockPool)
    cpu = BlockPool(medium="CPU")
    gpu = BlockPool()
    assert gpu in tracked_pools()
    assert cpu not in tracked_pools()


def test_the_disable_switch_reads_words_as_people_write_them(caplog):
    # `=false` switched the hook off: any value but "" and "0" did.
    for on in (None, "", "0", "false", "No", " off "):
        assert not disabled(on), on
    for off in ("1", "true", "YES", "on"):
        assert disabled(off), off
    assert disabled("maybe") and "maybe" in caplog.text
