"""Starting a real local mesh for a test module and talking to it."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from contextlib import contextmanager

from kvmesh.client import Completion, GatewayClient, make_request
from kvmesh.launcher import Mesh, start_mesh
from kvmesh.redis_server import free_port
from tests.conftest import instance_stats


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
    """A mesh with its own Redis, KV digests on; prints the services' log if start-up fails."""
    log = tempfile.NamedTemporaryFile("w+", prefix="kvmesh-test-", suffix=".log", delete=False)
    try:
        mesh = start_mesh(
            num_prefill,
            num_decode,
            model,
            port=free_port(),
            log=log,
            env={"KVMESH_KV_DIGEST": "1", "REDIS_URL": redis_url, **(env or {})},
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
