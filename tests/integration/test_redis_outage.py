"""The prefix index going away mid-run: a real redis-server started here is stopped while the
mesh serves, then started again on the same port. No request fails; the gateway routes by
load meanwhile, says so in its log, and routes by cached prefix again once Redis is back and
the prefill instances have re-published what they hold."""

from __future__ import annotations

import time
import urllib.request

import pytest

from kvmesh.redis_server import RedisProcess, free_port
from tests.integration.meshutil import complete, running_mesh, wait_idle

SHARED = (
    "You are reviewing a long design document about a lighthouse network along a rocky coast, "
    "with keepers, supply boats, weather reports and a radio schedule that every station follows. "
) * 3


@pytest.fixture
def redis_and_mesh():
    server = RedisProcess()
    port = server.port
    holder = {"server": server}
    try:
        metrics_port = free_port()
        with running_mesh(
            2,
            1,
            prefill_args=["--lease-ttl", "1.5"],
            redis_url=server.url,
            gateway_args=["--metrics-port", str(metrics_port)],
        ) as mesh:
            mesh.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            yield mesh, holder, port
    finally:
        holder["server"].stop()


def _metric(mesh, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(mesh.metrics_url, timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(name + labels + " "))
    return float(line.split()[-1])


def _log(mesh) -> str:
    with open(mesh.log_path) as f:
        return f.read()


def test_requests_succeed_through_an_outage_and_prefix_routing_recovers(redis_and_mesh):
    mesh, holder, port = redis_and_mesh
    # before: a second prompt sharing a long prefix goes where the first was cached
    a = complete(mesh, SHARED + "Question one: who keeps the logbook?", max_tokens=2, ignore_eos=True)
    b = complete(mesh, SHARED + "Question two: when do boats arrive?", max_tokens=2, ignore_eos=True)
    assert b.final.prefill_instance == a.final.prefill_instance and b.final.cached_tokens >= 64

    holder["server"].stop()  # Redis goes away
    during = [complete(mesh, SHARED + f"Outage question {i}?", max_tokens=2, ignore_eos=True) for i in range(4)]
    assert [c.final.finish_reason for c in during] == ["length"] * 4
    assert "prefix index unreachable" in _log(mesh)
    assert _metric(mesh, "kvmesh_gateway_prefix_index_up") == 0.0
    assert _metric(mesh, "kvmesh_gateway_routed_requests_total", '{index="load_only",policy="cache_aware"}') == 4.0

    holder["server"] = RedisProcess(port=port)  # back, empty
    time.sleep(2.0)  # a heartbeat (every 0.5 s) re-registers each prefill and re-publishes its cache
    c = complete(mesh, SHARED + "Question three: what is on the radio schedule?", max_tokens=2, ignore_eos=True)
    assert "prefix index reachable again" in _log(mesh)
    assert _metric(mesh, "kvmesh_gateway_prefix_index_up") == 1.0
    # the index knows the shared prefix again (re-published, not re-computed elsewhere)
    assert c.final.cached_tokens >= 64
    assert c.final.prefill_instance == a.final.prefill_instance
    wait_idle(mesh)
