"""The warming gate (kvmesh.runtime.warming_gate) on a real grpc.aio server over loopback: before a
service admits work, every RPC but health checks ends UNAVAILABLE / INSTANCE_LOST, unary and
streamed alike; once it admits, the same calls reach their handlers. Before the gate, a
restarted decode took a Reserve while its warm-up still wrote page 0 (issue 45's wrong answers)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.engine.outcomes import FailureCause
from kvmesh.runtime.service import Service
from kvmesh.runtime.wire import cause_of, retry_after_of

SERVICE = "kvmesh.test.Echo"


async def _echo(request: bytes, context) -> bytes:
    return request


async def _echo_twice(request: bytes, context):
    yield request
    yield request


def _echo_service() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_echo),
            "Stream": grpc.unary_stream_rpc_method_handler(_echo_twice),
        },
    )


async def _calls(address: str) -> tuple[bytes, list[bytes], int]:
    """Both echo calls' answers and the health status, over a fresh channel."""
    async with grpc.aio.insecure_channel(address) as ch:
        unary = await ch.unary_unary(f"/{SERVICE}/Unary")(b"ping", timeout=10)
        stream = [m async for m in ch.unary_stream(f"/{SERVICE}/Stream")(b"pong", timeout=10)]
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        return unary, stream, health.status


async def _refusals(address: str) -> list[grpc.aio.AioRpcError]:
    errors = []
    async with grpc.aio.insecure_channel(address) as ch:
        for call in (
            ch.unary_unary(f"/{SERVICE}/Unary")(b"ping", timeout=10),
            ch.unary_stream(f"/{SERVICE}/Stream")(b"x", timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if isinstance(call, grpc.aio.UnaryStreamCall):
                    _ = [m async for m in call]
                else:
                    await call
            errors.append(info.value)
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # health answers while the gate is shut
    return errors


def test_rpcs_are_refused_until_the_service_admits_then_served() -> None:
    async def main() -> None:
        svc = Service([SERVICE], "127.0.0.1", 0)
        svc.server.add_generic_rpc_handlers([_echo_service()])
        await svc.start()
        try:
            for error in await _refusals(svc.address):
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert cause_of(error) == FailureCause.INSTANCE_LOST
                assert retry_after_of(error) == 1.0
                assert "is starting" in error.details() and svc.address in error.details()
            await svc.mark_serving()
            unary, stream, health = await _calls(svc.address)
            assert (unary, stream, health) == (b"ping", [b"pong", b"pong"], health_pb2.HealthCheckResponse.SERVING)
        finally:
            await svc.stop(0)

    asyncio.run(main())
