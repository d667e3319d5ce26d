"""The gateway's scale advice (kvmesh.gateway.scale_advice) and how `kvmesh up --autoscale`
reads it from the gateway's /metrics (kvmesh.autoscale.read_desired)."""

from __future__ import annotations

from kvmesh.gateway import metrics
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.scale_advice import ScaleAdvisor
from kvmesh.gateway.slo import Slo

# 10 ms a request + 1 ms a queued token; a decode step 20 ms + 10 ms a row
PREFILL_FIT = (0.01, 0.001, 0.0)
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
