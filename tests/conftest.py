"""Shared fixtures: a Redis URL (the machine's, or a private redis-server) and meshes.

A mesh takes 10-30 s to start on a 2-core machine (model loads, then the gateway), so
modules whose tests can share one do: `observed_mesh` serves test_mesh, test_observability
and test_http_api, `fault_mesh` test_compose and test_faults. Every test using one ends with
the mesh idle (`wait_idle`), but for test_faults' last ones, which kill its instances.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`): most of a
mesh test's time is spent waiting on other processes, so a second worker fills the cores. A
module runs whole on one worker, in file order, and so do the modules that share a mesh
(`SHARED_MESHES`, kept true by `pytest_collection_modifyitems`).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

# The repo's folders install as kvmesh.<folder> (pyproject's package-dir); as top-level names on
# sys.path they would shadow other distributions: this checkout's kernels/ would be imported for
# Hugging Face's `kernels`, which transformers imports. `python -m pytest` (and xdist's workers,
# started with `python -c`) put the working directory first on sys.path: keep the repo root
# (tests.* is imported from there; pyproject's --import-mode=append), but last, and start every
# child Python without the working directory on its path (PYTHONSAFEPATH, as -P)
_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if p not in ("", _ROOT)] + [_ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
# Every service a test starts computes in fp32 unless the test asks for another --dtype: the suite's
# parity tests hold transformers' fp32 numbers (on a CPU with bf16, `auto` would pick bf16); the
# bf16 tests pass --dtype bfloat16 and judge by the acceptance rule (docs/precision.md)
os.environ["KVMESH_DTYPE"] = "float32"

from kvmesh.redis_server import RedisProcess, ping  # noqa: E402

SHARED_MESHES = {
    "observed_mesh": (
        "tests/integration/test_http_api.py",
        "tests/integration/test_agent_apis.py",
        "tests/integration/test_mesh.py",
        "tests/integration/test_observability.py",
    ),
    "fault_mesh": ("tests/integration/test_compose.py", "tests/integration/test_faults.py"),
}
"""Session fixtures that several modules share, and those modules (in collection order)."""
_MESH_OF_MODULE = {module: mesh for mesh, modules in SHARED_MESHES.items() for module in modules}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the modules of one shared mesh as one unit: they run on one
    worker in collection order, so the mesh starts once, and test_compose asks the fault mesh
    before test_faults kills its instances. (xdist's own `loadgroup` would do it with marks,
    but pytest 9.2 no longer reads the node id it rewrites.) Units go out in collection order,
    not most tests first: tests/integration (long mesh modules of few tests) before
    tests/unit (many short tests), so the short ones fill the end and the workers finish
    together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class SharedMeshScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return _MESH_OF_MODULE.get(module, module)

    return SharedMeshScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """Fail the run if a module uses a shared mesh that `SHARED_MESHES` does not list it under:
    on another worker it would start a second one, or find the fault mesh's instances killed."""
    for item in items:
        module = item.nodeid.split("::")[0]
        for mesh in SHARED_MESHES:
            if mesh in item.fixturenames and _MESH_OF_MODULE.get(module) != mesh:
                raise pytest.UsageError(f"{module} uses {mesh}: add it to SHARED_MESHES in tests/conftest.py")


def pytest_configure(config) -> None:
    """Under xdist: OpenMP threads wait passively (libgomp's default spin-wait takes the cores
    from the other worker and the services; see meshutil.SHARED_CORES_ENV), set in the
    controller so that the workers inherit it, and each worker's torch gets its share of the
    cores."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput["workercount"])))
    elif getattr(config.option, "numprocesses", None):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_sessionstart(session) -> None:
    """On the xdist controller: compile the default model's GGUF block kernels before the
    workers start, so that on a cold numba cache (a fresh clone) they are compiled once, not
    once a worker (tests.integration.meshutil.compile_block_kernels)."""
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from tests.integration.meshutil import compile_block_kernels

        compile_block_kernels()


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
    from kvmesh.protos.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    async def call():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = (prefill_pb2_grpc.PrefillStub if kind == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
            return await stub.GetStats(common_pb2.StatsRequest(), timeout=10)

    return asyncio.run(call())
