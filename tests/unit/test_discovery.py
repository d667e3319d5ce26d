"""Instances found in the registry: the records' format, and the gateway's pool following
what the registry lists (gateway/discovery.py). The registry is a list the test edits; the
pool is the gateway's own, its stats polls answered by the test (no instance runs)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.gateway.config import GatewayConfig
from kvmesh.gateway.discovery import Discovery
from kvmesh.gateway.pool import InstancePool
from kvmesh.kvstore.registry import InstanceRecord


def _record(instance_id: str, role: str, address: str, page_size: int = 16) -> InstanceRecord:
    return InstanceRecord(instance_id, role, address, "fp", page_size)


def test_a_record_round_trips_and_what_is_no_record_decodes_to_none():
    r = _record("prefill-a", "prefill", "10.0.0.5:50061")
    assert InstanceRecord.decode(r.encode()) == r
    # an older prefill's lease, a missing one, and text that is no record: not registry entries
    assert InstanceRecord.decode("1") is None
    assert InstanceRecord.decode(None) is None
    assert InstanceRecord.decode("{not json") is None
    assert InstanceRecord.decode('{"instance_id": "x"}') is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(role="router"), "role must be one of"),
        (dict(address="0.0.0.0:50061"), "reachable host:port"),  # a bind address nobody can dial
        (dict(address="host-without-port"), "reachable host:port"),
        (dict(address="host:70000"), "reachable host:port"),
        (dict(instance_id=""), "instance_id must be non-empty"),
    ],
)
def test_a_record_others_could_not_use_is_refused(kwargs, message):
    fields = dict(instance_id="p", role="prefill", address="10.0.0.5:50061")
    with pytest.raises(ValueError, match=message):
        InstanceRecord(**{**fields, **kwargs})


class _Registry:
    """What the registry lists now; `down` makes reads fail as an unreachable Redis does."""

    def __init__(self) -> None:
        self.records: list[InstanceRecord] = []
        self.down = False

    async def live(self) -> list[InstanceRecord]:
        if self.down:
            raise ConnectionError("redis down")
        return list(self.records)


def _pool(prefill=(), decode=()) -> InstancePool:
    pool = InstancePool(list(prefill), list(decode), 16, None, 0.3, 0.02, rpc_timeout_s=1.0)

    async def poll(insts):  # every instance answers its stats poll with its address as its id
        for inst in insts:
            inst.reachable, inst.instance_id = True, f"id-{inst.address}"

    pool.poll = poll  # type: ignore[method-assign]
    return pool


def _addresses(insts) -> list[str]:
    return [i.address for i in insts]


def test_instances_join_when_registered_and_retire_when_they_leave():
    async def run():
        registry, pool = _Registry(), _pool()
        discovery = Discovery(registry.live, pool, interval_s=0.1)
        assert await discovery.refresh() and pool.prefills == [] and pool.decodes == []
        with pytest.raises(LookupError, match="no healthy prefill"):
            pool.check_usable()  # nothing registered yet: UNAVAILABLE, not a crash

        registry.records = [_record("p1", "prefill", "10.0.0.1:1"), _record("d1", "decode", "10.0.0.9:1")]
        assert await discovery.refresh()
        assert _addresses(pool.prefills) == ["10.0.0.1:1"] and _addresses(pool.decodes) == ["10.0.0.9:1"]
        # polled on joining: routable at once, not at the next stats poll
        assert pool.prefills[0].routable and pool.prefills[0].instance_id == "id-10.0.0.1:1"
        pool.check_usable()

        # a second prefill joins; the first one drains (its entry is deleted)
        registry.records = [_record("p2", "prefill", "10.0.0.2:1"), _record("d1", "decode", "10.0.0.9:1")]
        first = pool.prefills[0]
        first.in_flight_requests = 1  # still serving one request of this gateway
        assert await discovery.refresh()
        assert _addresses(pool.prefills) == ["10.0.0.2:1"]  # no new request goes to p1
        # ...but its stub stays for the request it serves, and closes once that ended
        assert pool.prefill_stub(first) is not None
        first.in_flight_requests = 0
        assert await pool.close_retired(linger_s=0.0) == ["10.0.0.1:1"]
        with pytest.raises(KeyError):
            pool.prefill_stub(first)
        # routing sees only the new one
        prefill, _ = pool.pick_prefill(40, {}, [])
        assert prefill.address == "10.0.0.2:1"
        await pool.close()

    asyncio.run(run())


def test_a_lease_that_comes_back_restores_the_same_instance():
    async def run():
        registry, pool = _Registry(), _pool()
        discovery = Discovery(registry.live, pool, interval_s=0.1)
        registry.records = [_record("d1", "decode", "10.0.0.9:1")]
        await discovery.refresh()
        decode = pool.decodes[0]
        decode.in_flight_requests = 2
        registry.records = []  # frozen: its lease lapsed
        await discovery.refresh()
        assert pool.decodes == []
        registry.records = [_record("d1", "decode", "10.0.0.9:1")]  # thawed: renewed again
        await discovery.refresh()
        # the same object, its accounting of the two requests intact
        assert pool.decodes == [decode] and decode.in_flight_requests == 2
        await pool.close()

    asyncio.run(run())


def test_static_instances_are_kept_and_not_doubled_by_their_records():
    async def run():
        pool = _pool(prefill=["prefill-0:50061"], decode=["decode-0:50071"])
        await pool.poll([*pool.prefills, *pool.decodes])  # learns ids id-prefill-0:50061, ...
        registry = _Registry()
        discovery = Discovery(registry.live, pool, interval_s=0.1)
        registry.records = [
            _record("p", "prefill", "prefill-0:50061"),  # the same address as a static one
            _record("id-decode-0:50071", "decode", "172.17.0.4:50071"),  # the same id, another name for it
            _record("d2", "decode", "10.0.0.3:1"),
        ]
        await discovery.refresh()
        assert _addresses(pool.prefills) == ["prefill-0:50061"]
        assert _addresses(pool.decodes) == ["decode-0:50071", "10.0.0.3:1"]
        registry.records = []  # the registry empties: the static instances stay
        await discovery.refresh()
        assert _addresses(pool.prefills) == ["prefill-0:50061"] and _addresses(pool.decodes) == ["decode-0:50071"]
        await pool.close()

    asyncio.run(run())


def test_an_unreachable_registry_changes_nothing_and_a_foreign_page_size_is_left_out():
    async def run():
        registry, pool = _Registry(), _pool()
        discovery = Discovery(registry.live, pool, interval_s=0.1)
        registry.records = [
            _record("p1", "prefill", "10.0.0.1:1"),
            _record("p32", "prefill", "10.0.0.7:1", page_size=32),  # another mesh's page size
        ]
        await discovery.refresh()
        assert _addresses(pool.prefills) == ["10.0.0.1:1"]
        registry.down, registry.records = True, []
        assert not await discovery.refresh()
        assert _addresses(pool.prefills) == ["10.0.0.1:1"] and not discovery.registry_ok
        registry.down = False
        assert await discovery.refresh() and pool.prefills == [] and discovery.registry_ok
        await pool.close()

    asyncio.run(run())


def test_a_slow_registry_read_is_bounded():
    async def run():
        async def hangs():
            await asyncio.sleep(60)
            return []

        pool = _pool()
        discovery = Discovery(hangs, pool, interval_s=0.1, timeout_s=0.05)
        started = asyncio.get_running_loop().time()
        assert not await discovery.refresh()
        assert asyncio.get_running_loop().time() - started < 5
        await pool.close()

    asyncio.run(run())


def test_gateway_config_needs_lists_only_without_discovery():
    # discovery through a registry: no list needed (Kubernetes scales the instances)
    config = GatewayConfig(redis_url="redis://redis:6379/0")
    assert config.discovers and config.prefill_addresses == ()
    with pytest.raises(ValueError, match="at least one prefill address"):
        GatewayConfig()  # no Redis, no list
    with pytest.raises(ValueError, match="at least one prefill address"):
        GatewayConfig(redis_url="redis://redis:6379/0", discover=False)
    with pytest.raises(ValueError, match="discovery_interval_s"):
        GatewayConfig(redis_url="redis://redis:6379/0", discovery_interval_s=0)
    static = GatewayConfig(prefill_addresses=("a:1",), decode_addresses=("b:2",))
    assert not static.discovers
    # `kvmesh up` starts its gateway beside its instances: SERVING only once they are
    assert static.wait_for_instances_s == 0  # by default a gateway does not wait
    with pytest.raises(ValueError, match="wait_for_instances_s must be a finite number >= 0"):
        GatewayConfig(prefill_addresses=("a:1",), decode_addresses=("b:2",), wait_for_instances_s=-1)


def test_an_instance_registers_the_address_others_dial():
    from kvmesh.decode_svc.config import DecodeConfig

    # a pod: bound to every interface, reached at its pod IP (the downward API sets it)
    assert DecodeConfig(host="0.0.0.0", advertise_host="10.244.1.7").reachable_address(50071) == "10.244.1.7:50071"
    assert DecodeConfig(host="0.0.0.0", advertise_host="fd00::7").reachable_address(50071) == "[fd00::7]:50071"
    assert DecodeConfig(host="127.0.0.1").reachable_address(4000) == "127.0.0.1:4000"
    # a wildcard is no address: the hostname stands in, and a record refuses the wildcard
    import socket

    assert DecodeConfig(host="0.0.0.0").reachable_address(1) == f"{socket.gethostname()}:1"
    with pytest.raises(ValueError):
        InstanceRecord("d", "decode", "0.0.0.0:1")
