"""The Redis prefix index against a real Redis: events in, longest prefixes out.

Redis comes from the session's `redis_url` fixture (tests/conftest.py: REDIS_URL, the
machine's Redis, or a private redis-server), so these tests never skip for want of one.
Each test writes under a random namespace and deletes every key of it afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis

from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.kvstore.block_pool import BlockPool
from kvmesh.kvstore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader, RedisKVIndex

MODEL = "tiny-model"
T = TypeVar("T")
BS = 4


@pytest.fixture
def raw(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def index(redis_url, ns):
    idx = RedisKVIndex(redis_url, MODEL, namespace=ns)
    yield idx
    idx.close()


PROMPT = hash_blocks(list(range(6 * BS)), BS)  # 6 chained block hashes


def _live(index: RedisKVIndex, *ids: str, ttl_s: float = 60.0) -> None:
    """Give instances a lease: readers count only instances that heartbeat."""
    for i in ids:
        index.heartbeat(i, ttl_s)


def _holders(raw: redis.Redis, ns: str, block_hash: bytes) -> set[str]:
    """The instance ids the index stores under a block (its `block:{hash}` set)."""
    return raw.smembers(f"{ns}:{MODEL}:block:{block_hash.hex()}")


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll `condition` until it holds; fail after timeout_s seconds (a hang guard, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def _reader(redis_url: str, ns: str, calls: Callable[[AsyncRedisKVIndexReader], Awaitable[T]]) -> T:
    """Run `calls(reader)` (a coroutine function) against a fresh async reader (a gateway's)."""

    async def run():
        reader = AsyncRedisKVIndexReader(redis_url, MODEL, namespace=ns)
        try:
            return await calls(reader)
        finally:
            await reader.close()

    return asyncio.run(run())


def test_stored_removed_cleared_update_sets_and_stream(index, ns, raw):
    index.publish("p0", [BlockStored(tuple(PROMPT[:3]))])
    assert _holders(raw, ns, PROMPT[0]) == {"p0"}
    assert raw.smembers(f"{ns}:{MODEL}:instance:p0:blocks") == {h.hex() for h in PROMPT[:3]}

    # p0 evicts block 2; the block set empties and Redis deletes it
    index.publish("p0", [BlockRemoved((PROMPT[2],))])
    assert _holders(raw, ns, PROMPT[2]) == set()
    assert not raw.exists(f"{ns}:{MODEL}:block:{PROMPT[2].hex()}")
    assert raw.smembers(f"{ns}:{MODEL}:instance:p0:blocks") == {h.hex() for h in PROMPT[:2]}

    # p1 holds block 0 too; p0 clears its cache: block 0 keeps p1 only, block 1 is gone
    index.publish("p1", [BlockStored((PROMPT[0],))])
    index.publish("p0", [AllBlocksCleared()])
    assert _holders(raw, ns, PROMPT[0]) == {"p1"}
    assert not raw.exists(f"{ns}:{MODEL}:block:{PROMPT[1].hex()}")
    assert not raw.exists(f"{ns}:{MODEL}:instance:p0:blocks")

    # the stream recorded every event in order with its fields
    entries = raw.xrange(f"{ns}:{MODEL}:kv_events")
    assert [(e["instance"], e["seq"], e["type"]) for _, e in entries] == [
        ("p0", "1", "stored"),
        ("p0", "2", "removed"),
        ("p1", "1", "stored"),
        ("p0", "3", "cleared"),
    ]
    assert entries[0][1]["hashes"] == ",".join(h.hex() for h in PROMPT[:3])
    assert entries[3][1]["hashes"] == ""


def test_events_in_one_batch_apply_in_order(index, ns, raw):
    # stored then removed then stored again in one publish: the last one wins
    index.publish(
        "p0",
        [
            BlockStored((PROMPT[0], PROMPT[1])),
            BlockRemoved((PROMPT[0],)),
            AllBlocksCleared(),
            BlockStored((PROMPT[1],)),
        ],
    )
    assert _holders(raw, ns, PROMPT[0]) == set()
    assert _holders(raw, ns, PROMPT[1]) == {"p0"}


def test_longest_prefix_for_two_instances(index):
    # p0 holds blocks 0..3; p1 holds 0, 1 and 3 (2 was evicted: the run stops there)
    index.publish("p0", [BlockStored(tuple(PROMPT[:4]))])
    index.publish("p1", [BlockStored((PROMPT[0], PROMPT[1], PROMPT[3]))])
    _live(index, "p0", "p1", "p2")
    assert index.longest_prefix(PROMPT, ["p0", "p1", "p2"]) == {"p0": 4, "p1": 2, "p2": 0}
    # a different prompt sharing nothing
    other = hash_blocks(list(range(1000, 1000 + 3 * BS)), BS)
    assert index.longest_prefix(other, ["p0", "p1"]) == {"p0": 0, "p1": 0}
    assert index.longest_prefix([], ["p0"]) == {"p0": 0}
    assert index.longest_prefix(PROMPT, []) == {}


def test_clear_instance_removes_every_entry(index, ns, raw):
    index.publish("p0", [BlockStored(tuple(PROMPT))])
    index.publish("p1", [BlockStored(tuple(PROMPT[:2]))])
    _live(index, "p0", "p1")
    index.clear_instance("p0")
    assert index.longest_prefix(PROMPT, ["p0", "p1"]) == {"p0": 0, "p1": 2}
    assert not raw.exists(f"{ns}:{MODEL}:instance:p0:blocks")
    # only p1's two blocks remain as block sets
    assert len(list(raw.scan_iter(match=f"{ns}:{MODEL}:block:*"))) == 2
    index.clear_instance("p0")  # idempotent


def test_models_are_separate(redis_url, ns):
    a = RedisKVIndex(redis_url, "model-a", namespace=ns)
    b = RedisKVIndex(redis_url, "model-b", namespace=ns)
    try:
        a.publish("p0", [BlockStored(tuple(PROMPT[:2]))])
        _live(a, "p0")
        _live(b, "p0")
        assert b.longest_prefix(PROMPT, ["p0"]) == {"p0": 0}
        assert a.longest_prefix(PROMPT, ["p0"]) == {"p0": 2}
    finally:
        a.close()
        b.close()


def test_pool_events_drive_the_index(index, ns, raw):
    # a real pool publishing through the index: what the index says == what the pool holds
    _live(index, "p0")
    pool = BlockPool(4, BS, on_events=lambda events: index.publish("p0", events))
    ids = pool.allocate(3).block_ids
    pool.cache_blocks(ids, PROMPT[:3])
    pool.free(reversed(ids))  # eviction queue [2, 1, 0]
    pool.allocate(3)  # block 3, then evicts 2 and 1
    assert index.longest_prefix(PROMPT, ["p0"]) == {"p0": 1}
    held = {h for h in PROMPT if _holders(raw, ns, h)}
    assert held == pool.cached_hashes() == {PROMPT[0]}
    pool.check_integrity()


def test_async_reader_agrees_with_sync(redis_url, index, ns):
    index.publish("p0", [BlockStored(tuple(PROMPT[:5]))])
    index.publish("p1", [BlockStored(tuple(PROMPT[:1]))])
    index.publish("p2", [BlockStored(tuple(PROMPT[1:]))])  # no block 0: matches nothing
    ids = ["p0", "p1", "p2", "p3"]
    _live(index, *ids)

    async def read(reader):
        return await reader.longest_prefix(PROMPT, ids), await reader.longest_prefix([], ids)

    got, empty = _reader(redis_url, ns, read)
    assert got == index.longest_prefix(PROMPT, ids) == {"p0": 5, "p1": 1, "p2": 0, "p3": 0}
    assert empty == dict.fromkeys(ids, 0)


def test_async_reader_raises_connection_error_when_redis_is_down():
    async def read():
        # nothing listens on port 1
        reader = AsyncRedisKVIndexReader("redis://127.0.0.1:1/0", MODEL)
        try:
            await reader.longest_prefix(PROMPT, ["p0"])
        finally:
            await reader.close()

    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(read())


def test_lease_expiry_drops_an_instance_at_once_and_reaping_cleans_up(redis_url, index, ns, raw):
    # p0 and p1 hold the same 4 blocks; p0's lease lapses, p1 keeps heartbeating
    index.publish("p0", [BlockStored(tuple(PROMPT[:4]))])
    index.publish("p1", [BlockStored(tuple(PROMPT[:4]))])
    _live(index, "p1")
    _live(index, "p0", ttl_s=1.0)
    assert index.longest_prefix(PROMPT, ["p0", "p1"]) == {"p0": 4, "p1": 4}
    # its blocks stop counting when the lease lapses, before anyone cleans up
    _wait_for(lambda: index.longest_prefix(PROMPT, ["p0"]) == {"p0": 0}, "p0's lease to lapse")
    assert not raw.exists(f"{ns}:{MODEL}:lease:p0")
    assert _holders(raw, ns, PROMPT[0]) == {"p0", "p1"}  # nothing reaped yet
    assert index.longest_prefix(PROMPT, ["p0", "p1"]) == {"p0": 0, "p1": 4}

    # two readers (two gateways) agree; the first one reaps p0, the second finds nothing to do
    async def reap(reader):
        return await reader.longest_prefix(PROMPT, ["p0", "p1"]), await reader.reap_expired()

    seen, reaped = _reader(redis_url, ns, reap)
    assert seen == {"p0": 0, "p1": 4} and reaped == ["p0"]
    assert _holders(raw, ns, PROMPT[0]) == {"p1"}
    assert all(_holders(raw, ns, h) == {"p1"} for h in PROMPT[:4])
    assert not raw.exists(f"{ns}:{MODEL}:instance:p0:blocks")
    assert raw.smembers(f"{ns}:{MODEL}:instances") == {"p1"}
    assert _reader(redis_url, ns, lambda reader: reader.reap_expired()) == []  # idempotent


def test_restarted_instance_leaves_no_stale_entries(redis_url, index, ns, raw):
    index.publish("p0", [BlockStored(tuple(PROMPT[:5]))])
    # the process restarts: a new writer clears the old entries first (as prefill_svc does),
    # then its new cache fills with other blocks; its event numbers start again at 1
    restarted = RedisKVIndex(redis_url, MODEL, namespace=ns)
    try:
        restarted.clear_instance("p0")
        other = hash_blocks(list(range(500, 500 + 2 * BS)), BS)
        restarted.publish("p0", [BlockStored(tuple(other))])
        _live(restarted, "p0")
        assert restarted.longest_prefix(PROMPT, ["p0"]) == {"p0": 0}
        assert restarted.longest_prefix(other, ["p0"]) == {"p0": 2}
        assert raw.smembers(f"{ns}:{MODEL}:instance:p0:blocks") == {h.hex() for h in other}
        seqs = [(e["seq"], e["type"]) for _, e in raw.xrange(f"{ns}:{MODEL}:kv_events")]
        assert seqs == [("1", "stored"), ("1", "cleared"), ("2", "stored")]
        restarted.leave("p0")  # a clean shutdown: no entries, no lease, not registered
        assert not raw.exists(f"{ns}:{MODEL}:instance:p0:blocks")
        assert not raw.exists(f"{ns}:{MODEL}:lease:p0")
        assert not raw.sismember(f"{ns}:{MODEL}:instances", "p0")
    finally:
        restarted.close()


def test_second_tier_blocks_are_kept_apart_and_read_with_the_pool_s(redis_url, index, ns, raw):
    """A tier's events (medium disk) fill the tier sets, not the pool's; the tiered lookup gives
    each instance's run in its pool and its run in pool or tier; a clear empties both."""
    index.publish("p0", [BlockStored(tuple(PROMPT[:2])), BlockStored(tuple(PROMPT[2:5]), "disk")])
    index.publish("p1", [BlockStored(tuple(PROMPT[:1]), "host"), BlockStored(tuple(PROMPT[1:3]))])
    _live(index, "p0", "p1", "p2")
    assert _holders(raw, ns, PROMPT[2]) == {"p1"}  # p0 holds it in its tier only
    assert raw.smembers(f"{ns}:{MODEL}:tier:{PROMPT[2].hex()}") == {"p0"}
    assert raw.smembers(f"{ns}:{MODEL}:instance:p0:tier") == {h.hex() for h in PROMPT[2:5]}
    # the pool-only lookup (a gateway with no tier in sight) is as before
    assert index.longest_prefix(PROMPT, ["p0", "p1"]) == {"p0": 2, "p1": 0}

    async def read(reader):
        return await reader.longest_prefix_tiered(PROMPT, ["p0", "p1", "p2"])

    # p1's pool run is 0 (block 0 is in its host tier), its run in either is 3
    assert _reader(redis_url, ns, read) == {"p0": (2, 5), "p1": (0, 3), "p2": (0, 0)}
    index.publish("p0", [BlockRemoved((PROMPT[3],), "disk")])
    assert _reader(redis_url, ns, read)["p0"] == (2, 3)
    media = [(e["type"], e["medium"]) for _, e in raw.xrange(f"{ns}:{MODEL}:kv_events")]
    assert media == [("stored", "device"), ("stored", "disk"), ("stored", "host"), ("stored", "device"),
                     ("removed", "disk")]  # fmt: skip
    index.publish("p0", [AllBlocksCleared()])
    assert not raw.exists(f"{ns}:{MODEL}:instance:p0:tier") and not raw.exists(f"{ns}:{MODEL}:instance:p0:blocks")
    assert raw.smembers(f"{ns}:{MODEL}:tier:{PROMPT[0].hex()}") == {"p1"}
    with pytest.raises(ValueError, match="medium must be one of"):
        index.publish("p0", [BlockStored((PROMPT[0],), "tape")])
