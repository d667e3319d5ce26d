"""KV events leave prefill's model thread at once, whatever Redis does."""

from __future__ import annotations

import threading
import time

from kvmesh.kvstore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.kvstore.kv_publisher import KVEventPublisher


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_events_are_written_in_order():
    written = []
    pub = KVEventPublisher(written.extend)
    events = [BlockStored((bytes([i]),)) for i in range(50)] + [BlockRemoved((b"\x00",))]
    for e in events:
        pub.publish([e])
    pub.close()
    assert written == events and not pub.needs_resync


def test_a_stuck_redis_never_blocks_publish_and_overflow_asks_for_a_resync():
    gate = threading.Event()
    written = []

    def write(batch):
        gate.wait()  # Redis stopped: the write hangs
        written.extend(batch)

    pub = KVEventPublisher(write, max_buffered_events=10)
    pub.publish([BlockStored((b"a",))])  # taken by the writer, which now hangs
    _wait(lambda: not pub._buffer)
    # the model thread publishes 25 batches while the write still hangs: it never waited on
    # Redis (had it waited, it would be waiting yet: the gate opens only below)
    model_thread = threading.Thread(target=lambda: [pub.publish([BlockStored((bytes([i]),))]) for i in range(25)])
    model_thread.start()
    model_thread.join(30)
    assert not model_thread.is_alive(), "publish waited on the stuck write"
    assert not gate.is_set() and written == []
    assert pub.needs_resync and pub.num_dropped == 15
    # the heartbeat resyncs from a snapshot taken on the worker thread: it replaces the backlog
    # (one BlockStored a medium; an empty one is left out)
    pub.resync([BlockStored((b"x", b"y")), BlockStored((b"t",), "disk"), BlockStored((), "host")])
    assert not pub.needs_resync
    gate.set()
    pub.close()
    assert written == [
        BlockStored((b"a",)),
        AllBlocksCleared(),
        BlockStored((b"x", b"y")),
        BlockStored((b"t",), "disk"),
    ]


def test_a_failed_write_drops_the_batch_and_asks_for_a_resync():
    calls = []

    def write(batch):
        calls.append(batch)
        raise ConnectionError("redis down")

    pub = KVEventPublisher(write)
    pub.publish([BlockStored((b"a",))])
    _wait(lambda: pub.needs_resync)
    assert pub.num_dropped == 1
    pub.close()
