"""The gateway's scale advice (kvmesh.gateway.scale_advice) and how `kvmesh up --autoscale`
reads it from the gateway's /metrics (kvmesh.autoscale.read_desired)."""

from __future__ import annotations

from kvmesh.gateway import metrics
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.scale_advice import ScaleAdvisor
from kvmesh.gateway.slo import Slo

# 10 ms a request + 1 ms a queued token; a decode step 20 ms + 10 ms a row
PREFILL_FIT = (0.0, 0.01, 0.001, 0.0)
DECODE_FIT = (0.02, 0.01, 0.0)


def instances(role: str, n: int, **load) -> list[InstanceLoad]:
    out = []
    for i in range(n):
        inst = InstanceLoad(f"{role}-{i}:1", max_requests=64, **load)
        if role == "prefill":
            inst.prefill_fit = PREFILL_FIT
        else:
            inst.decode_fit = DECODE_FIT
        out.append(inst)
    return out


def desired_gauge(role: str) -> float | None:
    return metrics.REGISTRY.get_sample_value("kvmesh_gateway_desired_instances", {"role": role})


def test_a_long_prefill_queue_asks_for_one_more_prefill_after_it_held():
    # 2,000 queued tokens wait 2.01 s: over half the 3 s TTFT target
    prefills = instances("prefill", 1, reported_queued_tokens=2000, reported_active_requests=1)
    advisor = ScaleAdvisor(Slo(3.0, 0.5), prefills, instances("decode", 1), lambda: 0, up_after=3)
    for _ in range(2):
        advisor.update()
        assert advisor.desired["prefill"] == 1  # not yet: held for fewer than 3 polls
    advisor.update()
    assert advisor.desired == {"prefill": 2, "decode": 1}
    assert "queue wait 2.01 s" in advisor.why["prefill"]
    assert desired_gauge("prefill") == 2
    # the queue drains: the advice is the count again at once (no instance is taken away yet)
    prefills[0].reported_queued_tokens = 0
    advisor.update()
    assert advisor.desired["prefill"] == 1


def test_prefills_sharing_one_host_s_cores_wait_for_their_share_of_them():
    # 800 queued tokens each wait 0.81 s by the profile, under half the 3 s target on cores of
    # their own; two with work on one core group get half of the cores each: 1.62 s, and one more
    # is asked for
    alone = instances("prefill", 2, reported_queued_tokens=800, reported_active_requests=1)
    advisor = ScaleAdvisor(Slo(3.0, 0.5), alone, instances("decode", 1), lambda: 0, up_after=1)
    advisor.update()
    assert advisor.desired["prefill"] == 2
    shared = instances("prefill", 2, reported_queued_tokens=800, reported_active_requests=1, core_group="h:/s")
    advisor = ScaleAdvisor(Slo(3.0, 0.5), shared, instances("decode", 1), lambda: 0, up_after=1)
    advisor.update()
    assert advisor.desired["prefill"] == 3 and "queue wait 1.62 s" in advisor.why["prefill"]


def test_waiting_requests_or_slow_steps_ask_for_a_decode():
    waiting = [5]
    advisor = ScaleAdvisor(Slo(3.0, 0.5), instances("prefill", 1), instances("decode", 1), lambda: waiting[0], 1)
    advisor.update()
    assert advisor.desired["decode"] == 2 and "5 requests wait" in advisor.why["decode"]
    # 40 rows step in 0.42 s: over 0.8 x the 0.5 s ITL target
    waiting[0] = 0
    decodes = instances("decode", 1, reported_active_requests=40)
    advisor = ScaleAdvisor(Slo(3.0, 0.5), instances("prefill", 1), decodes, lambda: 0, up_after=1)
    advisor.update()
    assert advisor.desired["decode"] == 2 and "decode step 420 ms" in advisor.why["decode"]


def test_an_idle_pair_gives_one_back_only_after_it_held_and_never_the_last():
    prefills, decodes = instances("prefill", 2), instances("decode", 2, reported_active_requests=1)
    advisor = ScaleAdvisor(Slo(3.0, 0.5), prefills, decodes, lambda: 0, up_after=1, down_after=4)
    for _ in range(3):
        advisor.update()
    assert advisor.desired == {"prefill": 2, "decode": 2}
    advisor.update()
    assert advisor.desired == {"prefill": 1, "decode": 1}
    lone = ScaleAdvisor(Slo(3.0, 0.5), instances("prefill", 1), instances("decode", 1), lambda: 0, 1, 1)
    lone.update()
    assert lone.desired == {"prefill": 1, "decode": 1}


def test_without_an_slo_the_advice_is_the_count():
    prefills = instances("prefill", 1, reported_queued_tokens=100_000)
    advisor = ScaleAdvisor(Slo(), prefills, instances("decode", 3), lambda: 9, up_after=1, down_after=1)
    advisor.update()
    assert advisor.desired == {"prefill": 1, "decode": 3}


def test_unroutable_instances_are_not_counted():
    prefills = instances("prefill", 3)
    prefills[2].reachable = False
    advisor = ScaleAdvisor(Slo(3.0, 0.5), prefills, instances("decode", 1), lambda: 0)
    advisor.update()
    assert metrics.REGISTRY.get_sample_value("kvmesh_gateway_instances", {"role": "prefill"}) == 2


def test_the_launcher_reads_the_advice_from_the_gateways_metrics():
    from prometheus_client import start_http_server

    from kvmesh.autoscale import read_desired
    from kvmesh.redis_server import free_port

    metrics.DESIRED_INSTANCES.labels("prefill").set(3)
    metrics.DESIRED_INSTANCES.labels("decode").set(2)
    port = free_port("127.0.0.1")
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.REGISTRY)
    try:
        assert read_desired(f"http://127.0.0.1:{port}/metrics") == {"prefill": 3, "decode": 2}
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert read_desired(f"http://127.0.0.1:{port}/metrics", timeout_s=1) == {}  # gone: no advice


class _Mesh:
    """What the autoscaler uses of kvmesh.launcher.Mesh, with processes that stand in for instances
    (`sleep`-like Pythons with the instance's `--port`) and a real grpc.health.v1 server where a
    started instance answers (or nothing, for one that never serves)."""

    def __init__(self, serving_address: str, ignore_sigterm: bool = False) -> None:
        self.prefill_addresses, self.decode_addresses, self.procs = [], [], []
        self.serving_address, self.ignore_sigterm = serving_address, ignore_sigterm
        for kind, address in (("prefill", "127.0.0.1:1"), ("decode", "127.0.0.1:2")):
            self.addresses(kind).append(address)
            self.procs.append((f"{kind}-0", self.process(address)))

    def addresses(self, kind: str) -> list[str]:
        return self.prefill_addresses if kind == "prefill" else self.decode_addresses

    def process(self, address: str):
        import subprocess
        import sys

        code = "import signal, time\n"
        if self.ignore_sigterm:
            code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        code += "print('up', flush=True)\ntime.sleep(120)"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "--port", address.rsplit(":", 1)[1]], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline() == "up\n"  # its SIGTERM handling is set
        return proc

    def start_instance(self, kind: str):
        return f"{kind}-new", self.process(self.serving_address), self.serving_address


def _ticks(scaler, until, bound_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + bound_s
    while not until():
        assert time.monotonic() < deadline, "the autoscaler did not get there"
        scaler.tick()


def test_the_launcher_adds_then_drains_one_and_bounds_a_stuck_drain_and_a_start_that_never_serves():
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from prometheus_client import start_http_server

    from kvmesh.autoscale import Autoscaler
    from kvmesh.redis_server import free_port

    health_port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{health_port}")
    server.start()
    http, thread = start_http_server(metrics_port, addr="127.0.0.1", registry=metrics.REGISTRY)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    meshes = []
    try:
        # the advice asks for a second prefill: started, and it joins once it serves
        mesh = _Mesh(f"127.0.0.1:{health_port}")
        meshes.append(mesh)
        scaler = Autoscaler(mesh, url, {"prefill": (1, 2), "decode": (1, 1)}, interval_s=0)
        metrics.DESIRED_INSTANCES.labels("prefill").set(2)
        metrics.DESIRED_INSTANCES.labels("decode").set(1)
        _ticks(scaler, lambda: len(scaler.events) == 1)
        assert mesh.prefill_addresses == ["127.0.0.1:1", f"127.0.0.1:{health_port}"]
        assert scaler.events[0]["action"] == "up" and ("prefill-new", mesh.procs[-1][1]) in mesh.procs
        # past the bound (2) the advice is not followed further
        metrics.DESIRED_INSTANCES.labels("prefill").set(5)
        scaler.tick()
        assert len(mesh.prefill_addresses) == 2 and scaler._pending is None
        # one fewer: the newest drains (SIGTERM) and leaves the mesh's processes at once
        metrics.DESIRED_INSTANCES.labels("prefill").set(1)
        newest = mesh.procs[-1][1]
        _ticks(scaler, lambda: len(scaler.events) == 2)
        assert scaler.events[1]["action"] == "down" and newest.returncode == -15
        assert mesh.prefill_addresses == ["127.0.0.1:1"] and all(p is not newest for _, p in mesh.procs)
        # a decode that ignores SIGTERM is killed once the drain bound passes
        stuck = _Mesh(f"127.0.0.1:{health_port}", ignore_sigterm=True)
        meshes.append(stuck)
        stuck.decode_addresses.append("127.0.0.1:3")
        stuck.procs.append(("decode-1", stuck.process("127.0.0.1:3")))
        scaler = Autoscaler(stuck, url, {"prefill": (1, 1), "decode": (1, 2)}, interval_s=0, drain_bound_s=0.5)
        _ticks(scaler, lambda: len(scaler.events) == 1)
        assert stuck.procs[-1][0] == "decode-0" and stuck.decode_addresses == ["127.0.0.1:2"]
        # an instance that never serves is stopped once the start bound passes, and nothing joins
        silent = _Mesh(f"127.0.0.1:{free_port('127.0.0.1')}")
        meshes.append(silent)
        scaler = Autoscaler(silent, url, {"prefill": (1, 2), "decode": (1, 1)}, interval_s=0, start_bound_s=0.5)
        metrics.DESIRED_INSTANCES.labels("prefill").set(2)
        scaler.tick()
        started = scaler._pending.proc
        _ticks(scaler, lambda: scaler._pending is None)
        assert started.returncode == -15 and silent.prefill_addresses == ["127.0.0.1:1"] and not scaler.events
    finally:
        for mesh in meshes:
            for _, proc in mesh.procs:
                proc.kill()
                proc.wait()
        http.shutdown()
        thread.join(timeout=10)
        server.stop(None)
        metrics.DESIRED_INSTANCES.labels("prefill").set(0)
        metrics.DESIRED_INSTANCES.labels("decode").set(0)


def test_a_lost_instance_leaves_the_mesh_and_closing_kills_a_frozen_drain():
    from kvmesh.autoscale import Autoscaler

    mesh = _Mesh("127.0.0.1:9", ignore_sigterm=True)  # no advice is read in this test
    try:
        mesh.decode_addresses.append("127.0.0.1:3")
        mesh.procs.append(("decode-1", mesh.process("127.0.0.1:3")))
        scaler = Autoscaler(mesh, "http://127.0.0.1:9/metrics", {"prefill": (1, 2), "decode": (1, 2)})
        # kill -9 of an instance: it leaves the mesh (and its addresses), which goes on
        name, proc = mesh.procs[-1]
        proc.kill()
        proc.wait()
        scaler.lost(name, proc)
        assert mesh.decode_addresses == ["127.0.0.1:2"] and [n for n, _ in mesh.procs] == ["prefill-0", "decode-0"]
        # a drain under way that ignores its SIGTERM: closing the scaler kills it (no orphan)
        mesh.decode_addresses.append("127.0.0.1:4")
        mesh.procs.append(("decode-2", mesh.process("127.0.0.1:4")))
        scaler._drain("decode", 2, advised_at=0.0)
        draining = scaler._pending.proc
        assert draining.poll() is None  # SIGTERM ignored
        scaler.close()
        assert draining.returncode == -9
    finally:
        for _, proc in mesh.procs:
            proc.kill()
            proc.wait()


def test_requests_with_no_prompt_tokens_queued_are_no_prefill_wait():
    # 40 requests reported active (pushing, or a count that lags) but no token queued: 40 x 10 ms
    # of per-request cost is no reason to add a prefill
    prefills = instances("prefill", 1, reported_queued_tokens=0, reported_active_requests=40)
    advisor = ScaleAdvisor(Slo(0.5, 0.5), prefills, instances("decode", 1), lambda: 0, up_after=1)
    advisor.update()
    assert advisor.desired["prefill"] == 1
    prefills[0].reported_queued_tokens = 400  # 0.4 s of tokens + 0.4 s of requests: over 0.25 s
    advisor.update()
    assert advisor.desired["prefill"] == 2
