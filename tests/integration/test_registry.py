"""The instance registry against a real Redis: entries in, live records out, leases that
lapse, and a service's Registration (renew, leave). Each test writes under a random
namespace and deletes every key of it afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader, RedisKVIndex
from kvmesh.kvstore.registry import AsyncRegistryReader, InstanceRecord, InstanceRegistry
from kvmesh.runtime.registration import Registration

MODEL = "tiny-model"


def _live(redis_url: str, ns: str) -> list[InstanceRecord]:
    async def read():
        reader = AsyncRegistryReader(redis_url, MODEL, namespace=ns)
        try:
            return await reader.live()
        finally:
            await reader.close()

    return asyncio.run(read())


def test_live_lists_registered_records_until_they_leave_or_lapse(redis_url, ns):
    registry = InstanceRegistry.from_url(redis_url, MODEL, namespace=ns)
    p = InstanceRecord("prefill-a", "prefill", "10.0.0.1:50061", "fp", 16)
    d = InstanceRecord("decode-a", "decode", "10.0.0.2:50071", "fp", 16)
    try:
        assert _live(redis_url, ns) == []
        assert registry.heartbeat(p.instance_id, 30.0, p) is True  # new: the caller re-publishes
        assert registry.heartbeat(p.instance_id, 30.0, p) is False  # renewed
        # a lease long enough to read it back on a busy machine (a fresh reader connects first)
        beat_at = time.monotonic()
        assert registry.heartbeat(d.instance_id, 1.0, d) is True
        assert _live(redis_url, ns) == [d, p]  # by instance id
        # the decode stops renewing (dead or frozen): its lease lapses, and only p is listed
        deadline = beat_at + 30
        while (live := _live(redis_url, ns)) != [p] and time.monotonic() < deadline:
            time.sleep(0.05)
        # gone, and not before its TTL ran out (less a few ms: Redis keeps its own clock)
        assert live == [p] and time.monotonic() - beat_at > 0.95, live
        registry.leave(p.instance_id)  # drained
        assert _live(redis_url, ns) == []
        with pytest.raises(ValueError, match="record of"):
            registry.heartbeat("someone-else", 30.0, p)
    finally:
        registry.close()


def test_the_prefix_index_lease_is_the_registry_entry(redis_url, ns):
    index = RedisKVIndex(redis_url, MODEL, namespace=ns)
    record = InstanceRecord("prefill-b", "prefill", "10.0.0.3:50061", "fp", 16)
    try:
        index.heartbeat("prefill-b", 30.0, record)
        index.heartbeat("old-prefill", 30.0)  # an older prefill: a lease that is no record
        # the registry finds the one with a record, the index counts both as alive
        assert _live(redis_url, ns) == [record]

        async def reap():
            reader = AsyncRedisKVIndexReader(redis_url, MODEL, namespace=ns)
            try:
                return await reader.reap_expired()
            finally:
                await reader.close()

        assert asyncio.run(reap()) == []
        index.leave("prefill-b")
        assert _live(redis_url, ns) == []
    finally:
        index.close()


def test_registration_renews_until_it_leaves(redis_url, ns):
    record = InstanceRecord("decode-c", "decode", "10.0.0.4:50071", "fp", 16)
    lost_flags: list[bool] = []

    async def run():
        registry = InstanceRegistry.from_url(redis_url, MODEL, namespace=ns)

        async def after_beat(lost: bool) -> None:
            lost_flags.append(lost)

        # renewed every 0.5 s, a 1.5 s lease survives a renewal delayed by a second on a busy machine
        registration = Registration(registry, record, ttl_s=1.5, after_beat=after_beat)
        registration.start()
        try:
            deadline = time.monotonic() + 30
            while registration.renewals < 4:  # renewed every 0.5 s: outlives its 1.5 s TTL
                assert time.monotonic() < deadline, "the lease was not renewed"
                await asyncio.sleep(0.05)
            reader = AsyncRegistryReader(redis_url, MODEL, namespace=ns)
            assert await reader.live() == [record]
            started = time.monotonic()
            await registration.leave(timeout_s=3.0)
            assert time.monotonic() - started < 3.0
            assert await reader.live() == []  # gone at once, not after the TTL
            await asyncio.sleep(0.5)
            assert await reader.live() == []  # and no renewal brought it back
            await reader.close()
        finally:
            registry.close()

    asyncio.run(run())
    assert lost_flags[0] is True and not any(lost_flags[1:]), lost_flags


def test_registration_survives_an_unreachable_redis_and_leave_is_bounded():
    # a port nobody listens on: every renewal fails (logged once), leave() still returns
    record = InstanceRecord("decode-d", "decode", "10.0.0.5:50071")
    registry = InstanceRegistry.from_url(
        "redis://127.0.0.1:1/0?socket_timeout=0.2&socket_connect_timeout=0.2", MODEL, namespace="unused"
    )

    async def run():
        registration = Registration(registry, record, ttl_s=0.3)
        registration.start()
        await asyncio.sleep(0.5)
        assert registration.renewals == 0
        started = time.monotonic()
        await registration.leave(timeout_s=1.0)
        return time.monotonic() - started

    try:
        assert asyncio.run(run()) < 3.0
    finally:
        registry.close()
