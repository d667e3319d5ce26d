"""kvmesh.redis_server.free_port: ports for the services a launcher starts, chosen where the OS
does not hand out ports itself."""

import random
import socket

import kvmesh.redis_server as redis_server
from kvmesh.redis_server import FIRST_FREE_PORT, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    start = redis_server._ephemeral_start()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert start == int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(FIRST_FREE_PORT <= p < start for p in ports), ports
    assert len(ports) > 1  # chosen at random, not the same one each time
    # and not from `random`'s state: two processes that seed it alike still pick apart
    state = random.getstate()
    try:
        random.seed(0)
        first = [free_port() for _ in range(5)]
        random.seed(0)
        assert [free_port() for _ in range(5)] != first
    finally:
        random.setstate(state)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: binds


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        used = taken.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        picks = iter([used, used, free])
        monkeypatch.setattr(redis_server._PORT_RNG, "randrange", lambda lo, hi: next(picks))
        monkeypatch.setattr(redis_server, "_ephemeral_start", lambda: 65536)
        assert free_port() == free


def test_with_no_range_below_the_ephemeral_one_the_os_picks(monkeypatch):
    monkeypatch.setattr(redis_server, "_ephemeral_start", lambda: FIRST_FREE_PORT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
