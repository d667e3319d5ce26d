"""Shared fixtures: a Redis URL (the machine's, or a private redis-server) and meshes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.redis_server import RedisProcess, ping


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL, else the Redis on 127.0.0.1:6379, else a private redis-server for the session."""
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    if ping(url):
        yield url
        return
    proc = RedisProcess()
    try:
        yield proc.url
    finally:
        proc.stop()


def instance_stats(address: str, kind: str):
    """GetStats of a prefill or decode instance (sync helper for tests)."""
    from protos.kvmesh.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    async def call():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = (prefill_pb2_grpc.PrefillStub if kind == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
            return await stub.GetStats(common_pb2.StatsRequest(), timeout=10)

    return asyncio.run(call())
