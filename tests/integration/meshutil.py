"""Starting a real local mesh for a test module and talking to it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh.client import Completion, GatewayClient, make_request
from kvmesh.launcher import Mesh, start_mesh
from kvmesh.redis_server import free_port
from tests.conftest import instance_stats

SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment of the model services a test starts: they share the machine's cores, and
OpenMP threads that spin while they wait for work (libgomp's default) take the cores from the
other services' threads; waiting passively, a 2+2 mesh on 2 cores ran its decode bursts ~4x
faster, and prefill as fast as with spinning."""


@contextmanager
def running_mesh(
    num_prefill: int = 1,
    num_decode: int = 1,
    prefill_args=None,
    decode_args=None,
    gateway_args=None,
    model: str | None = None,
    redis_url: str = "",
    env: dict[str, str] | None = None,
):
    """A mesh with its own Redis, KV digests on, cores shared (`SHARED_CORES_ENV`); prints
    the services' log if start-up fails."""
    log = tempfile.NamedTemporaryFile("w+", prefix="kvmesh-test-", suffix=".log", delete=False)
    try:
        mesh = start_mesh(
            num_prefill,
            num_decode,
            model,
            port=free_port(),
            log=log,
            env={
                "KVMESH_KV_DIGEST": "1",
                **SHARED_CORES_ENV,
                "REDIS_URL": redis_url,
                **(env or {}),
            },
            extra_prefill_args=prefill_args,
            extra_decode_args=decode_args,
            extra_gateway_args=gateway_args,
        )
    except Exception:
        log.seek(0)
        print(log.read()[-6000:])
        raise
    mesh.log_path = log.name  # tests read what the services logged
    try:
        yield mesh
    except BaseException:
        print(f"service logs kept in {log.name}")
        raise
    else:
        if os.environ.get("KVMESH_KEEP_TEST_LOGS") == "1":  # to read after a failed test
            print(f"service logs kept in {log.name}")
        else:
            os.unlink(log.name)
    finally:
        mesh.stop()
        log.close()


def spawn_service(
    kind: str, args: list[str], log_path: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """An extra `kvmesh serve KIND --port P ARGS` beside a module's mesh, its output appended
    to log_path, cores shared (`SHARED_CORES_ENV`); (process, its address). Wait for it with
    runtime.service's wait_for_health."""
    port = free_port()
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", kind, "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **SHARED_CORES_ENV, **(env or {})},
        )
    return proc, f"127.0.0.1:{port}"


def log_size(mesh: Mesh) -> int:
    """Bytes the services have logged so far: read_log(mesh, since=...) returns what follows."""
    return os.path.getsize(mesh.log_path)


def read_log(mesh: Mesh, since: int = 0) -> str:
    with open(mesh.log_path, errors="replace") as f:
        f.seek(since)
        return f.read()


def wait_for_log(mesh: Mesh, needle: str, since: int = 0, count: int = 1, timeout_s: float = 30.0) -> None:
    """Wait until the services have logged `needle` `count` times after byte `since`."""
    deadline = time.monotonic() + timeout_s
    while read_log(mesh, since).count(needle) < count:
        assert time.monotonic() < deadline, f"{needle!r} not logged {count} times within {timeout_s:.0f} s"
        time.sleep(0.1)


def complete(mesh: Mesh, prompt, **kwargs) -> Completion:
    async def run() -> Completion:
        async with GatewayClient(mesh.gateway_address) as client:
            return await client.complete(make_request(prompt, **kwargs), timeout_s=300)

    return asyncio.run(run())


def complete_many(mesh: Mesh, requests: list[dict]) -> list[Completion]:
    """Send all requests at once (concurrently) and return their completions in order."""

    async def run() -> list[Completion]:
        async with GatewayClient(mesh.gateway_address) as client:
            return await asyncio.gather(*[client.complete(make_request(**r), timeout_s=600) for r in requests])

    return asyncio.run(run())


def wait_idle(mesh: Mesh, timeout_s: float = 20.0) -> None:
    """Wait until every decode pool is fully free and no prefill page is referenced; check integrity."""
    deadline = time.monotonic() + timeout_s
    while True:
        decs = [instance_stats(a, "decode") for a in mesh.decode_addresses]
        pres = [instance_stats(a, "prefill") for a in mesh.prefill_addresses]
        idle = all(d.num_free_pages == d.num_pages and d.num_active_requests == 0 for d in decs) and all(
            p.num_referenced_pages == 0 and p.num_active_requests == 0 for p in pres
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for s in [*decs, *pres]:
        assert s.integrity_error == "", s.integrity_error
    for d in decs:
        assert d.num_free_pages == d.num_pages and d.num_active_requests == 0, d
    for p in pres:
        assert p.num_referenced_pages == 0 and p.num_active_requests == 0, p


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on a free loopback port (`endpoint`) keeping every span it
    is sent, with its service name; `close()` stops it."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, span) for span in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_hex: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(s, sp) for s, sp in self.spans if sp.trace_id.hex() == trace_hex]

    def close(self) -> None:
        self.server.stop(0)


@contextmanager
def observed_mesh(collector: Collector):
    """1 prefill and 1 decode of the default model, traces sent to `collector`, JSON logs and
    Prometheus /metrics on every service (`mesh.metrics`: kind -> URL)."""
    ports = {k: free_port() for k in ("gateway", "prefill", "decode")}
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "KVMESH_LOG_FORMAT": "json",
    }
    with running_mesh(
        1,
        1,
        env=env,
        prefill_args=["--metrics-port", str(ports["prefill"])],
        decode_args=["--metrics-port", str(ports["decode"])],
        gateway_args=["--metrics-port", str(ports["gateway"])],
    ) as m:
        m.metrics = {k: f"http://127.0.0.1:{p}/metrics" for k, p in ports.items()}
        yield m
