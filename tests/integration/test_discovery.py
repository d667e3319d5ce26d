"""Scaling without a gateway restart: a gateway given no instance list finds them in the Redis
registry, takes in the ones that start while traffic runs, and stops sending to one that
drains (SIGTERM), while no request fails.

One mesh for the module: `kvmesh up`'s launcher starts Redis, one prefill and one decode (they
register there); beside it runs a gateway with only `--redis-url` (as in Kubernetes), and the
test starts a second prefill and a second decode while requests flow."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from types import SimpleNamespace

import grpc
import pytest

from kvmesh.client import Completion, GatewayClient, make_request
from kvmesh.redis_server import RedisProcess
from kvmesh.runtime.service import wait_for_health
from tests.integration.meshutil import reap, serving, spawn_service, terminate

DISCOVERY_INTERVAL_S = 0.2
FAST_LEASE = ["--lease-ttl", "1.5"]  # renewed every 0.5 s: a frozen instance drops out quickly


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """Redis, prefill-0, decode-0 and a gateway given only `--redis-url`, started at once
    (the gateway finds the instances as they register); `mesh.spawn(kind, args)` starts another
    service. Everything stops with the module."""
    mesh = SimpleNamespace(log_path=str(tmp_path_factory.mktemp("discovery") / "services.log"), procs={})
    redis_proc = RedisProcess()
    mesh.redis_url = redis_proc.url

    def spawn(kind: str, args: list[str]) -> tuple[subprocess.Popen, str]:
        proc, address = spawn_service(
            kind, ["--redis-url", mesh.redis_url, *args], mesh.log_path, env={"KVMESH_KV_DIGEST": "1"}
        )
        mesh.procs[address] = proc
        return proc, address

    mesh.spawn = spawn
    try:
        gateway = spawn("gateway", ["--discovery-interval", str(DISCOVERY_INTERVAL_S)])
        prefill = spawn("prefill", ["--instance-id", "prefill-0"])
        services = [gateway, prefill, spawn("decode", ["--instance-id", "decode-0"])]
        mesh.gateway = gateway[1]
        mesh.prefill_0, mesh.prefill_0_address = prefill

        async def routing() -> None:
            # SERVING instances register in Redis; the gateway sees them at its next discovery
            # refresh, and until then answers UNAVAILABLE ("none registered yet"): wait for that
            deadline = time.monotonic() + 60
            async with GatewayClient(mesh.gateway) as client:
                while True:
                    try:
                        await client.complete(make_request(prompt_token_ids=[1, 2, 3], max_tokens=1), timeout_s=30)
                        return
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(DISCOVERY_INTERVAL_S)

        try:
            serving(services)
            asyncio.run(routing())
        except BaseException:
            print(open(mesh.log_path).read()[-6000:])
            raise
        yield mesh
    finally:
        procs = list(mesh.procs.values())
        terminate(procs)
        reap(procs)
        redis_proc.stop()


def test_instances_that_start_take_traffic_and_one_that_drains_fails_no_request(mesh):
    done: list[tuple[float, Completion]] = []  # (monotonic time sent, completion)
    failed: list[BaseException] = []

    async def run() -> None:
        stop_traffic = asyncio.Event()

        async def worker(client: GatewayClient, w: int) -> None:
            k = 0
            while not stop_traffic.is_set():
                k += 1
                ids = [100 + w * 1000 + k % 500 + j for j in range(24)]  # no two requests share a block
                sent = time.monotonic()
                try:
                    out = await client.complete(
                        make_request(prompt_token_ids=ids, max_tokens=3, ignore_eos=True), timeout_s=60
                    )
                    done.append((sent, out))
                except grpc.aio.AioRpcError as exc:
                    failed.append(exc)

        async def until(condition, what: str, timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while not condition():
                assert not failed, f"a request failed while waiting for {what}: {failed[0]}"
                assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
                await asyncio.sleep(0.05)

        def served(field: str, instance_id: str, since: float = 0.0) -> int:
            return sum(1 for sent, c in done if sent >= since and getattr(c.final, field) == instance_id)

        async with GatewayClient(mesh.gateway) as client:
            workers = [asyncio.ensure_future(worker(client, w)) for w in range(2)]
            try:
                # the registry's first two instances serve: the gateway was given no list
                await until(lambda: len(done) >= 3, "traffic through the discovering gateway", 60)
                first_prefill = done[0][1].final.prefill_instance
                assert first_prefill == "prefill-0"

                # a second prefill and a second decode start while traffic runs
                new_prefill, _ = mesh.spawn("prefill", ["--instance-id", "prefill-new"])
                new_decode, address = mesh.spawn("decode", ["--instance-id", "decode-new", *FAST_LEASE])
                mesh.new_decode = (new_decode, address)
                await until(
                    lambda: (
                        served("prefill_instance", "prefill-new") >= 2 and served("decode_instance", "decode-new") >= 2
                    ),
                    "the new prefill and decode taking traffic",
                    120,
                )

                # the first prefill drains: in-flight prefills finish, new ones go to prefill-new
                drained = mesh.prefill_0
                drained.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(drained.wait, 30) == 0
                gone_at = time.monotonic() + DISCOVERY_INTERVAL_S
                await until(lambda: served("prefill_instance", "prefill-new", since=gone_at) >= 4, "traffic after", 60)
            finally:
                stop_traffic.set()
                await asyncio.gather(*workers)
        assert new_prefill.poll() is None and new_decode.poll() is None

        # after it left, nothing more went to the drained prefill
        after = [c for sent, c in done if sent >= gone_at]
        assert {c.final.prefill_instance for c in after} == {"prefill-new"}, after

    asyncio.run(run())
    assert not failed, failed
    assert all(c.final.finish_reason == "length" and c.final.generated_tokens == 3 for _, c in done)
    # every KV push landed intact, wherever it went
    assert all(c.final.kv_transfer.prefill_digest == c.final.kv_transfer.decode_digest for _, c in done)
    log = open(mesh.log_path).read()
    assert "joined through the registry" in log and "left the registry" in log


def test_a_frozen_instance_drops_out_when_its_lease_lapses_and_rejoins_when_it_thaws(mesh):
    if getattr(mesh, "new_decode", None) is None:  # the test above did not run
        proc, address = mesh.spawn("decode", ["--instance-id", "decode-new", *FAST_LEASE])
        asyncio.run(wait_for_health(address, 300))
        mesh.new_decode = (proc, address)
    proc, address = mesh.new_decode

    def logged(needle: str) -> int:
        with open(mesh.log_path, errors="replace") as f:
            return f.read().count(needle)

    def wait_logged(needle: str, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while logged(needle) < count:
            assert time.monotonic() < deadline, f"{needle!r} not logged {count} times within {timeout_s:.0f} s"
            time.sleep(0.05)

    left, joined = f"decode {address} left the registry", f"decode decode-new ({address}) joined through the registry"
    left_before, joined_before = logged(left), logged(joined)
    proc.send_signal(signal.SIGSTOP)  # frozen: it stops renewing, its lease lapses 1.5 s later
    try:
        wait_logged(left, left_before + 1)
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_logged(joined, joined_before + 1)  # the next renewal brings it back, no restart

    async def ask() -> Completion:
        async with GatewayClient(mesh.gateway) as client:
            return await client.complete(
                make_request(prompt_token_ids=list(range(300, 340)), max_tokens=2, ignore_eos=True), 60
            )

    assert asyncio.run(ask()).final.generated_tokens == 2
