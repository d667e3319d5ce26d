"""What every kvmesh service process shares: logging, uvloop, the gRPC server with the
standard health service, and one shutdown order (stop admitting, drain, stop the server
with a grace period, release resources).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

# 64 MiB: token id lists of long prompts travel in one message.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def setup_logging(name: str) -> None:
    """Configure root logging once per process (level from KVMESH_LOG_LEVEL, default INFO)."""
    level = os.environ.get("KVMESH_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


class Service:
    """A grpc.aio server plus health reporting for one kvmesh service.

    `serving_names` are the fully-qualified service names ("kvmesh.v1.Decode") whose
    health flips to SERVING once `mark_serving()` is called (after the model is warm):
    readiness is not liveness.
    """

    def __init__(self, serving_names: list[str], host: str, port: int) -> None:
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.serving_names = serving_names
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        """Start serving RPCs; health stays NOT_SERVING until mark_serving()."""
        for name in ["", *self.serving_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def mark_serving(self) -> None:
        for name in ["", *self.serving_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, then stop the server giving in-flight RPCs grace_s seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop_event)` on uvloop; SIGINT/SIGTERM set stop_event."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(runner())


async def wait_for_health(address: str, timeout_s: float, service: str = "") -> None:
    """Poll grpc.health.v1 at `address` until SERVING; TimeoutError after timeout_s seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
