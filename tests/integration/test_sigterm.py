"""SIGTERM under load: a service stops admitting (new requests get UNAVAILABLE), lets in-flight
streams finish within its grace period, leaves the prefix index, and exits 0."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import Completion, GatewayClient, make_request
from tests.integration.meshutil import complete, running_mesh


def _proc(mesh, name: str):
    return next(p for n, p in mesh.procs if n == name)


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition()` (a coroutine function) until true; fail after timeout_s (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


async def _stopped_serving(address: str) -> bool:
    """Whether the instance left SERVING: its grpc.health.v1 says NOT_SERVING (the first step
    of its shutdown) or it no longer answers RPCs at all."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return True
    return reply.status != health_pb2.HealthCheckResponse.SERVING


def test_decode_drains_in_flight_streams_then_exits_0():
    with running_mesh(1, 1) as mesh:

        async def run():
            async with GatewayClient(mesh.gateway_address) as client:
                outs = [Completion() for _ in range(3)]

                async def consume(i: int) -> Completion:
                    request = make_request(
                        f"Tell me a long story number {i}.", chat=True, max_tokens=40, ignore_eos=True
                    )
                    async for msg in client.stream(request, timeout_s=120):
                        if msg.HasField("delta"):
                            outs[i].token_ids.extend(msg.delta.token_ids)
                        else:
                            outs[i].final = msg.final
                    return outs[i]

                tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]

                # the three are decoding now: each streamed a token past prefill's first one
                async def decoding() -> bool:
                    return all(len(o.token_ids) >= 2 for o in outs)

                await _until(decoding, "all three streams decoding")
                assert all(o.final is None for o in outs), "a stream ended before SIGTERM: nothing to drain"
                _proc(mesh, "decode-0").send_signal(signal.SIGTERM)
                # the signal is handled once health leaves SERVING; the server stops admitting then
                await _until(lambda: _stopped_serving(mesh.decode_addresses[0]), "decode-0 to leave SERVING")
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # draining: no new work
                    await client.complete(make_request("One more?", chat=True, max_tokens=2), timeout_s=30)
                return await asyncio.gather(*tasks), refused.value.code()

        outs, code = asyncio.run(run())
        # the in-flight streams ran to their end inside the grace period
        assert [o.final.finish_reason for o in outs] == ["length"] * 3
        assert all(o.final.generated_tokens == 40 for o in outs)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert _proc(mesh, "decode-0").wait(timeout=30) == 0
        # decode kept the answers' pages and published them; leaving, it cleared its index entries
        r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
        try:
            assert not r.exists(f"kvmesh:{mesh_model()}:instance:{outs[0].final.decode_instance}:blocks")
            kinds = {(e["role"], e["type"]) for _, e in r.xrange(f"kvmesh:{mesh_model()}:kv_events")}
            assert {("decode", "stored"), ("decode", "cleared"), ("prefill", "stored")} <= kinds
        finally:
            r.close()


def test_prefill_leaves_the_index_and_exits_0():
    with running_mesh(1, 1) as mesh:
        out = complete(mesh, "Describe the tides of the North Sea in two sentences.", chat=True, max_tokens=2)
        instance = out.final.prefill_instance
        r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
        try:
            assert r.scard(f"kvmesh:{mesh_model()}:instance:{instance}:blocks") > 0
            assert r.exists(f"kvmesh:{mesh_model()}:lease:{instance}")
            _proc(mesh, "prefill-0").send_signal(signal.SIGTERM)
            assert _proc(mesh, "prefill-0").wait(timeout=30) == 0
            # its blocks, lease and registration are gone: no gateway counts them any more
            assert not r.exists(f"kvmesh:{mesh_model()}:instance:{instance}:blocks")
            assert not r.exists(f"kvmesh:{mesh_model()}:lease:{instance}")
            assert not r.sismember(f"kvmesh:{mesh_model()}:instances", instance)
            # no block names it any more; decode's own (it keeps the finished request's pages) stay
            blocks = list(r.scan_iter(match=f"kvmesh:{mesh_model()}:block:*"))
            assert not any(r.sismember(b, instance) for b in blocks)
            assert all(r.smembers(b) == {out.final.decode_instance} for b in blocks) and blocks
        finally:
            r.close()
        # with no prefill left the gateway answers UNAVAILABLE within seconds, not a hang
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            complete(mesh, "Anyone there?", chat=True, max_tokens=2)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 15


def mesh_model() -> str:
    from kvmesh.engine.loader import resolve_model

    return resolve_model(None).name
