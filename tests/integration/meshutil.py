"""Starting a real local mesh for a test module and talking to it."""

from __future__ import annotations

import asyncio
import os
import signal
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
from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.kvstore.redis_index import RedisKVIndex
from kvmesh.launcher import Mesh, start_mesh
from kvmesh.redis_server import free_port
from kvmesh.runtime.service import wait_for_health
from tests.conftest import instance_stats

SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment of the model services a test starts: they share the machine's cores, and
OpenMP threads that spin while they wait for work (libgomp's default) take the cores from the
other services' threads; waiting passively, a 2+2 mesh on 2 cores ran its decode bursts ~4x
faster, and prefill as fast as with spinning."""


_block_kernels_compiled = False


def compile_block_kernels() -> None:
    """Compile the default model's GGUF block kernels in this process, once a session, before a
    test starts services of that model (`kvmesh warm`). numba keeps them in kvmesh's shared
    cache (kernels/numba_cache.py), but services that start together on a cold cache (the
    first run after an edit to the kernels) each compile them, ~40 s of CPU apiece: the two
    `kvmesh up` of test_cli_and_failures took 207 s instead of 35 s. Compiled here they load in
    well under a second; on a warm cache this costs a model load and a warm-up step (~2 s)."""
    global _block_kernels_compiled
    if _block_kernels_compiled:
        return
    from kvmesh.warm import warm

    warm()
    _block_kernels_compiled = True


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
    if model is None:
        compile_block_kernels()
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
    kvmesh.runtime.service's wait_for_health."""
    if kind != "gateway" and "--model" not in args:
        compile_block_kernels()
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


def complete(mesh: Mesh, prompt, address: str | None = None, **kwargs) -> Completion:
    """One request through the mesh's gateway (or the gateway at `address`), to its end."""

    async def run() -> Completion:
        async with GatewayClient(address or mesh.gateway_address) as client:
            return await client.complete(make_request(prompt, **kwargs), timeout_s=300)

    return asyncio.run(run())


async def stream_flowing(client: GatewayClient, request, tokens: list[int], flowing: asyncio.Semaphore) -> tuple:
    """Stream `request`, appending its token ids to `tokens` and releasing `flowing` once it has
    3 of them (or, with fewer, when it ends), so a test can strike while streams run. Returns
    ('OK', final), (status name, details), or ('NO_FINAL', None)."""
    result: tuple = ("NO_FINAL", None)
    released = False
    try:
        async for msg in client.stream(request, timeout_s=120):
            tokens.extend(msg.delta.token_ids)
            if len(tokens) >= 3 and not released:
                released = True
                flowing.release()
            if msg.HasField("final"):
                result = ("OK", msg.final)
    except grpc.aio.AioRpcError as exc:
        result = (exc.code().name, exc.details())
    if not released:
        flowing.release()
    return result


def complete_many(mesh: Mesh, requests: list[dict]) -> list[Completion]:
    """Send all requests at once (concurrently) and return their completions in order."""

    async def run() -> list[Completion]:
        async with GatewayClient(mesh.gateway_address) as client:
            return await asyncio.gather(*[client.complete(make_request(**r), timeout_s=600) for r in requests])

    return asyncio.run(run())


def wait_indexed(mesh: Mesh, address: str, kind: str, token_ids: list[int], model_name: str, timeout_s: float = 30.0):
    """Wait until the prefix index says the instance at `address` holds every full block of
    `token_ids` (hashed without a tenant, 16 tokens a block): its KV events went out after the
    answer that filled them. Returns the number of blocks; AssertionError past timeout_s."""
    instance_id = instance_stats(address, kind).instance_id
    hashes = hash_blocks(token_ids, 16)
    index = RedisKVIndex(mesh.redis_url, model=model_name)
    try:
        deadline = time.monotonic() + timeout_s
        while index.longest_prefix(hashes, [instance_id])[instance_id] < len(hashes):
            assert time.monotonic() < deadline, f"{instance_id}'s KV events did not reach the index"
            time.sleep(0.05)
    finally:
        index.close()
    return len(hashes)


def wait_idle(mesh: Mesh, timeout_s: float = 60.0) -> None:
    """Wait until every decode pool is fully free and no prefill page is referenced (a bound for
    a busy machine; no cost when idle); check integrity."""
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
    Prometheus /metrics on every service (`mesh.metrics`: kind -> URL). KV pushes take the
    `staged` path (through host buffers, as for GPU pages UCX cannot move), so its copies carry
    every page of these modules' requests; fault_mesh's move pages in place."""
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
        prefill_args=["--metrics-port", str(ports["prefill"]), "--kv-push-path", "staged"],
        decode_args=["--metrics-port", str(ports["decode"]), "--kv-push-path", "staged"],
        gateway_args=["--metrics-port", str(ports["gateway"])],
    ) as m:
        m.metrics = {k: f"http://127.0.0.1:{p}/metrics" for k, p in ports.items()}
        yield m


FAULT_MESH_DECODE_SLOTS = 8
"""Requests each decode of `fault_mesh` batches (--max-batch-size)."""


def serving(services: list[tuple[subprocess.Popen, str]]) -> None:
    """Wait until every service is SERVING (they start in parallel)."""

    async def wait_all():
        await asyncio.gather(*(wait_for_health(address, 300) for _, address in services))

    asyncio.run(wait_all())


def terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process still running (once: `reap` waits for them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def reap(procs: list[subprocess.Popen]) -> None:
    """Wait for terminated processes; SIGKILL one still running after 20 s."""
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gateway_args(mesh: Mesh, *extra: str) -> list[str]:
    """A gateway's flags for every instance of `mesh` and its Redis, then `extra`."""
    return [
        *(f"--prefill={a}" for a in mesh.prefill_addresses),
        *(f"--decode={a}" for a in mesh.decode_addresses),
        "--redis-url",
        mesh.redis_url,
        *extra,
    ]


@contextmanager
def fault_mesh(log_path: str):
    """2 prefill and 2 decode of FAULT_MESH_DECODE_SLOTS slots each, and beside them (`mesh.extra`,
    name -> address): a decode advertising a KV address nobody can push to, a gateway routing to
    it, a gateway whose queue holds 4 requests and one with page size 32 (their output appended
    to log_path). Prefill leases last 1.5 s (a heartbeat every 0.5 s), and the gateway serves
    /metrics (`mesh.metrics_url`). test_compose and test_faults share it (tests/conftest.py)."""
    extra: list[tuple[subprocess.Popen, str]] = []
    signalled = False
    try:
        # the extra decode loads its model while the mesh's instances load theirs
        extra.append(
            spawn_service(
                "decode",
                ["--advertise-host", "127.0.0.2", "--kv-port", str(free_port()), "--instance-id", "decode-unreachable"],
                log_path,
            )
        )
        metrics_port = free_port()
        with running_mesh(
            2,
            2,
            prefill_args=["--lease-ttl", "1.5"],
            decode_args=["--max-batch-size", str(FAULT_MESH_DECODE_SLOTS)],
            gateway_args=["--metrics-port", str(metrics_port)],
        ) as m:
            m.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            try:
                bad_address = extra[0][1]
                gateway_flags = {
                    "queue-of-4": gateway_args(m, "--max-queued-requests", "4"),
                    "page-size-32": gateway_args(m, "--page-size", "32"),
                    "with-unreachable-decode": [
                        f"--prefill={m.prefill_addresses[0]}",
                        f"--decode={m.decode_addresses[0]}",
                        f"--decode={bad_address}",
                        "--redis-url",
                        m.redis_url,
                        "--no-discover",  # exactly these instances, not the mesh's others
                        "--wait-for-instances",  # the extra decode may still be loading
                        "300",
                    ],
                }
                gateways = {name: spawn_service("gateway", flags, log_path) for name, flags in gateway_flags.items()}
                extra.extend(gateways.values())
                serving(extra)
                m.extra = {"unreachable-decode": bad_address, **{n: a for n, (_, a) in gateways.items()}}
                m.extra_procs = [p for p, _ in extra]
                yield m
            finally:
                terminate([p for p, _ in extra])  # they stop while the mesh stops
                signalled = True
    finally:
        if not signalled:  # the mesh did not start
            terminate([p for p, _ in extra])
        reap([p for p, _ in extra])
