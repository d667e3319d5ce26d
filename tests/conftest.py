"""Shared fixtures: a Redis URL (the machine's, or a private redis-server) and meshes.

A mesh takes 10-30 s to start on a 2-core machine (model loads, then the gateway), so
modules whose tests can share one do: `observed_mesh` serves test_mesh, test_observability
and test_http_api, `fault_mesh` test_compose and test_faults. Every test using one ends with
the mesh idle (`wait_idle`), but for test_faults' last ones, which kill its instances.
"""

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


@pytest.fixture(scope="session")
def otlp_collector():
    """An OTLP/gRPC trace receiver the observed mesh exports its spans to."""
    from tests.integration.meshutil import Collector

    collector = Collector()
    yield collector
    collector.close()


@pytest.fixture(scope="session")
def observed_mesh(otlp_collector):
    """The default model on 1 prefill and 1 decode, traced to `otlp_collector`, with JSON logs
    and /metrics on every service (tests.integration.meshutil.observed_mesh)."""
    from tests.integration.meshutil import observed_mesh

    with observed_mesh(otlp_collector) as mesh:
        yield mesh


@pytest.fixture(scope="session")
def fault_mesh(tmp_path_factory):
    """2 prefill and 2 decode with a decode nobody can push to and three more gateways beside
    them (tests.integration.meshutil.fault_mesh). test_compose uses it first and leaves it idle;
    test_faults kills its instances and then calls `close()`, which stops everything at once."""
    from contextlib import ExitStack

    from tests.integration.meshutil import fault_mesh

    with ExitStack() as stack:
        mesh = stack.enter_context(fault_mesh(str(tmp_path_factory.mktemp("faults") / "extra-services.log")))
        mesh.close = stack.close
        yield mesh


@pytest.fixture
def ns(redis_url):
    """A random Redis key namespace; every key under it is deleted after the test."""
    import uuid

    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    namespace = f"kvmesh-test-{uuid.uuid4().hex[:12]}"
    yield namespace
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)
    assert not list(client.scan_iter(match=f"{namespace}:*")), "test keys left behind"
    client.close()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module's tests (`pytest.mark.usefixtures`): a tiny
    model's ops are far too small for a thread team, and on 2 busy cores its spin-waits cost
    20x the work; where the module starts ranks, they share the cores one thread each too."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def instance_stats(address: str, kind: str):
    """GetStats of a prefill or decode instance (sync helper for tests)."""
    from protos.kvmesh.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    async def call():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = (prefill_pb2_grpc.PrefillStub if kind == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
            return await stub.GetStats(common_pb2.StatsRequest(), timeout=10)

    return asyncio.run(call())
