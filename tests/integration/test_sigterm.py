"""SIGTERM under load: a service stops admitting (new requests get UNAVAILABLE), lets in-flight
streams finish within its grace period, leaves the prefix index, and exits 0."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import redis

from kvmesh.client import GatewayClient, make_request
from tests.integration.meshutil import complete, running_mesh


def _proc(mesh, name: str):
    return next(p for n, p in mesh.procs if n == name)


def test_decode_drains_in_flight_streams_then_exits_0():
    with running_mesh(1, 1) as mesh:

        async def run():
            async with GatewayClient(mesh.gateway_address) as client:
                reqs = [
                    client.complete(
                        make_request(f"Tell me a long story number {i}.", chat=True, max_tokens=40, ignore_eos=True),
                        timeout_s=120,
                    )
                    for i in range(3)
                ]
                tasks = [asyncio.ensure_future(r) for r in reqs]
                await asyncio.sleep(2.0)  # the three are decoding now
                _proc(mesh, "decode-0").send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # draining: no new work
                    await client.complete(make_request("One more?", chat=True, max_tokens=2), timeout_s=30)
                return await asyncio.gather(*tasks), refused.value.code()

        outs, code = asyncio.run(run())
        # the in-flight streams ran to their end inside the grace period
        assert [o.final.finish_reason for o in outs] == ["length"] * 3
        assert all(o.final.generated_tokens == 40 for o in outs)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert _proc(mesh, "decode-0").wait(timeout=30) == 0


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
            assert not list(r.scan_iter(match=f"kvmesh:{mesh_model()}:block:*"))
        finally:
            r.close()
        # with no prefill left the gateway answers UNAVAILABLE within seconds, not a hang
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            complete(mesh, "Anyone there?", chat=True, max_tokens=2)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 15


def mesh_model() -> str:
    from engine.loader import resolve_model

    return resolve_model(None).name
