"""Seeing into a real mesh: one OpenTelemetry trace per request (collected by a real OTLP gRPC
receiver, meshutil.Collector), Prometheus metrics scraped from every service, JSON logs
carrying the request and trace ids, gRPC health and reflection."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.client import GatewayClient, make_request
from kvmesh.protos.v1 import gateway_pb2_grpc
from tests.integration.meshutil import complete, wait_idle
from tests.integration.prometheus import NEEDS_A_FEATURE, has_data, prometheus, scrapes

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector(otlp_collector):
    return otlp_collector


@pytest.fixture(scope="module")
def mesh(observed_mesh):
    """Shared with test_mesh (tests/conftest.py): traced, JSON logs, /metrics everywhere."""
    return observed_mesh


def _generate_with_traceparent(mesh, prompt: str):
    async def run():
        async with grpc.aio.insecure_channel(mesh.gateway_address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(
                make_request(prompt, chat=True, max_tokens=6, ignore_eos=True, request_id="traced-1"),
                metadata=[("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")],
                timeout=120,
            )
            return [msg async for msg in call]

    return asyncio.run(run())


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value or v.int_value or v.double_value or v.bool_value
    return out


def test_one_trace_gateway_prefill_decode(mesh, collector):
    msgs = _generate_with_traceparent(mesh, "Tell me one fact about lighthouses.")
    assert msgs[-1].final.generated_tokens == 6
    # spans reach the collector as each service's exporter sends them (every 100 ms): wait for
    # all of them, bounded generously for a busy machine (no cost when they come at once)
    deadline = time.monotonic() + 60
    names: set[str] = set()
    want = {
        "gateway.generate",
        "gateway.tokenize",
        "gateway.route",
        "decode.reserve",
        "prefill",
        "prefill.queue",
        "prefill.forward",
        "prefill.kv_push",
        "decode.generate",
        "decode.kv_receive",
        "decode.admission",
    }
    while time.monotonic() < deadline and not want <= names:
        time.sleep(0.2)
        names = {sp.name for _, sp in collector.of_trace(CALLER_TRACE)}
    spans = {sp.name: (svc, sp) for svc, sp in collector.of_trace(CALLER_TRACE)}
    assert want <= set(spans), sorted(spans)
    # every span of the request is in the caller's trace; the gateway continues the caller's span
    assert all(sp.trace_id.hex() == CALLER_TRACE for _, sp in spans.values())
    by_id = {sp.span_id: name for name, (_, sp) in spans.items()}
    parent = {name: by_id.get(sp.parent_span_id) for name, (_, sp) in spans.items()}
    assert spans["gateway.generate"][1].parent_span_id.hex() == CALLER_SPAN
    # the chain gateway -> prefill -> (its KV push) -> decode
    assert parent["prefill"] == "gateway.generate"
    assert parent["prefill.kv_push"] == "prefill" and parent["prefill.forward"] == "prefill"
    assert parent["decode.generate"] == "prefill.kv_push"
    assert parent["decode.kv_receive"] == "decode.generate" and parent["decode.admission"] == "decode.generate"
    assert parent["decode.reserve"] == "gateway.generate" and parent["gateway.route"] == "gateway.generate"
    # each service names itself
    assert spans["gateway.generate"][0] == "kvmesh-gateway"
    assert spans["prefill"][0] == "kvmesh-prefill" and spans["decode.generate"][0] == "kvmesh-decode"
    final = msgs[-1].final
    route = _attrs(spans["gateway.route"][1])
    assert route["kvmesh.prefill.instance"] == final.prefill_instance
    assert "kvmesh.index_cached_tokens" in route
    push = _attrs(spans["prefill.kv_push"][1])
    assert (
        push["kvmesh.kv.bytes"] == final.kv_transfer.nbytes and push["kvmesh.kv.pages"] == final.kv_transfer.num_pages
    )
    assert push["kvmesh.kv.seconds"] > 0
    fwd = _attrs(spans["prefill.forward"][1])
    assert fwd["kvmesh.prompt_tokens"] == final.prompt_tokens
    dec = spans["decode.generate"][1]
    assert _attrs(dec)["kvmesh.decode.generated_tokens"] == 5 and _attrs(dec)["kvmesh.finish_reason"] == "length"
    # the summary and the status are set before decode's last message: the gateway's cancel of
    # the finished call, which on a busy machine closes the stream at that message, is no error
    assert dec.status.code == dec.status.STATUS_CODE_OK, dec.status
    assert [e.name for e in dec.events] == ["first_token"]
    gen = _attrs(spans["gateway.generate"][1])
    assert gen["kvmesh.generated_tokens"] == 6 and gen["kvmesh.request_id"] == "traced-1"
    # JSON log lines of this request carry its request id and trace id, in every service
    with open(mesh.log_path) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    ours = [ln for ln in lines if ln["request_id"] == "traced-1"]
    assert {ln["service"] for ln in ours} == {"gateway", "prefill", "decode"}
    assert all(ln["trace_id"] == CALLER_TRACE for ln in ours)
    assert any("request finished" in ln["message"] for ln in ours)
    wait_idle(mesh)


def _scrape(url: str) -> dict[str, float]:
    out = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_metrics_move_by_what_the_requests_did(mesh):
    before = {k: _scrape(u) for k, u in mesh.metrics.items()}
    prompts = [f"Give me fact number {i} about the moon." for i in range(3)]
    outs = [complete(mesh, p, chat=True, max_tokens=5, ignore_eos=True) for p in prompts]
    wait_idle(mesh)
    after = {k: _scrape(u) for k, u in mesh.metrics.items()}

    def moved(kind: str, key: str) -> float:
        return after[kind].get(key, 0.0) - before[kind].get(key, 0.0)

    g = 'kvmesh_requests_total{finish_reason="length",status="OK"}'
    assert moved("gateway", g) == 3
    assert moved("gateway", "kvmesh_request_ttft_seconds_count") == 3
    assert moved("gateway", "kvmesh_request_itl_seconds_count") == 3
    assert moved("gateway", "kvmesh_request_e2e_seconds_count") == 3
    assert moved("gateway", 'kvmesh_gateway_routed_requests_total{index="prefix",policy="cache_aware"}') == 3
    assert moved("prefill", "kvmesh_prefill_requests_total") == 3
    assert moved("prefill", "kvmesh_prefix_cache_hit_tokens_total") == sum(o.final.cached_tokens for o in outs)
    assert moved("prefill", "kvmesh_prefill_computed_tokens_total") == sum(
        o.final.prompt_tokens - o.final.cached_tokens for o in outs
    )
    assert moved("prefill", "kvmesh_kv_transfer_bytes_total") == sum(o.final.kv_transfer.nbytes for o in outs)
    assert moved("prefill", "kvmesh_kv_transfer_seconds_count") == 3
    assert moved("prefill", "kvmesh_engine_step_cpu_seconds_count") >= 1
    assert after["prefill"]["kvmesh_prefill_queue_depth"] == 0 and after["prefill"]["kvmesh_kv_pages_used"] == 0
    assert moved("decode", "kvmesh_decode_generated_tokens_total") == 3 * 4  # the first token is prefill's
    assert moved("decode", "kvmesh_decode_steps_total") >= 4
    assert moved("decode", "kvmesh_engine_step_cpu_seconds_count") == moved("decode", "kvmesh_decode_steps_total")
    assert after["decode"]["kvmesh_kv_pages_used"] == 0
    assert after["decode"]["kvmesh_kv_pages_free"] == after["decode"]["kvmesh_kv_pages_used"] + 1024
    assert after["decode"]["kvmesh_decode_running_batch_size"] == 0


def test_health_serving_and_reflection_lists_the_services(mesh):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address, name in (
        (mesh.gateway_address, "kvmesh.v1.Gateway"),
        (mesh.prefill_addresses[0], "kvmesh.v1.Prefill"),
        (mesh.decode_addresses[0], "kvmesh.v1.Decode"),
    ):
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            listed = {s.name for r in replies for s in r.list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= listed


def test_a_real_prometheus_scrapes_the_mesh_and_every_dashboard_query_returns_data(mesh, tmp_path):
    from tests.unit.test_dashboards import _generator

    targets = [u.removeprefix("http://").removesuffix("/metrics") for u in mesh.metrics.values()]
    with prometheus(targets, tmp_path) as url:
        scrapes(url, targets, 1, timeout_s=120)
        # traffic between scrapes: rates are over two samples at least, one before it

        async def send() -> None:
            async with GatewayClient(mesh.gateway_address) as client:
                # with an SLO (met): until the instances' profiles give predictions (4 forwards
                # at most), and two more with them
                predicted = 0
                for i in range(20):
                    request = make_request(f"Name planet number {i}.", chat=True, max_tokens=4, ignore_eos=True)
                    request.slo_ttft_ms, request.slo_itl_ms = 60_000, 60_000
                    done = await client.complete(request, timeout_s=120)
                    predicted += done.final.predicted_ttft_s > 0
                    if predicted == 2:
                        break
                assert predicted == 2, "no TTFT prediction in 20 requests"
                # and an error, for the errors panel
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.complete(make_request("Hi", max_tokens=10**6), timeout_s=60)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        asyncio.run(send())
        wait_idle(mesh)
        scrapes(url, targets, 2)
        empty = []
        for expr in _generator().queries():
            if not has_data(url, expr):
                empty.append(expr)
    expected = sorted(e for e in empty if any(part in e for part in NEEDS_A_FEATURE))
    assert sorted(empty) == expected, f"dashboard queries without data: {sorted(set(empty) - set(expected))}"
    # and those are exactly the ones needing a feature this mesh does not run
    assert all(any(part in e for e in empty) for part in NEEDS_A_FEATURE), (empty, NEEDS_A_FEATURE)
