"""Expert parallelism across hosts (issue 28, part 5): decode's EP ranks each on a host of its
own (bench/hosts.py), sharing no memory with rank 0: pages and state slots move over
torch.distributed (gloo on the hosts' link), the control over an authenticated TCP link.

- A tiny DeepSeek-V4 decoded by EP 2 and EP 4 worlds whose ranks 1..3 are `kvmesh serve ep-rank`
  processes on three hosts (rank 0: this process, on the client link) equals one process, logits
  and greedy tokens, while sequences come and go and move between ranks (the churn of
  tests/integration/test_expert_parallel.py). The exchanges' time per step is reported.
- The same model through a mesh whose decode runs EP 2 with its rank 1 on another host:
  greedy tokens equal transformers'; then the decode-rank link is cut mid-stream: the step fails
  within --ep-timeout naming rank 1, the stream ends UNAVAILABLE, decode's health says
  NOT_SERVING, and a new request gets a clear status at once.

Runs in `make test-multihost`, after tests/multihost/test_multihost.py (one cluster at a time).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.hosts import Cluster
from kvmesh.client import GatewayClient, make_request
from kvmesh.engine.ep.runner import ExpertParallelRunner
from kvmesh.redis_server import ping
from kvmesh.runtime.service import wait_for_health
from tests.conftest import instance_stats
from tests.integration.meshutil import compile_block_kernels, stream_flowing
from tests.integration.test_expert_parallel import _churn, _runner, churned, files  # noqa: F401 (fixtures)
from tests.multihost.hosts import running_cluster

HOSTS = ["front", "decode", "rank1", "rank2", "rank3"]
SECRET = "kvmesh-multihost-ep-secret-0123"
EP_PORT = 29500
EP_TIMEOUT_S = 5.0
REPORT: dict[str, dict] = {}
"""Per EP world: the exchanges' milliseconds per step; per fault: seconds to a clear status
(written to $KVMESH_MULTIHOST_REPORT_EP when set)."""


def _write_report() -> None:
    path = os.environ.get("KVMESH_MULTIHOST_REPORT_EP")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)


def _env(**extra: str) -> dict[str, str]:
    # gloo binds to the host's link (its hostname resolves nowhere in a host of its own)
    return {**os.environ, "KVMESH_EP_SECRET": SECRET, "GLOO_SOCKET_IFNAME": "eth0", **extra}


def _kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", *args]


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(HOSTS, "kvmesh-multihost-ep-") as (c, log):
        compile_block_kernels()
        c.log = log  # type: ignore[attr-defined]
        yield c


def _world_on_hosts(c: Cluster, files, num_ranks: int, monkeypatch) -> ExpertParallelRunner:  # noqa: F811
    """Rank 0 here (on the client link), ranks 1..num_ranks-1 on hosts rank1.. (each `kvmesh serve
    ep-rank`, joining over the bridge)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", c.client_link)
    for r in range(1, num_ranks):
        argv = _kvmesh("serve", "ep-rank", "--ep-init-addr", f"{c.client_address}:{EP_PORT}", "--rank", str(r))
        c.spawn(f"rank{r}", [*argv, "--model", str(files.checkpoint_dir), "--torch-threads", "1"], _env(), c.log)
    return ExpertParallelRunner(
        _runner(files),
        files,
        num_ranks,
        timeout_s=20,
        torch_threads=1,
        init_addr=(c.client_address, EP_PORT),
        authkey=SECRET.encode(),
        start_timeout_s=300,
    )


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_ep_ranks_on_separate_hosts_equal_one_process(cluster, files, churned, num_ranks, monkeypatch):  # noqa: F811
    ep = _world_on_hosts(cluster, files, num_ranks, monkeypatch)
    try:
        ref_logits, ref_tokens = churned
        logits, tokens = _churn(ep)
        for step, (a, b) in enumerate(zip(logits, ref_logits)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
        assert tokens == ref_tokens
        times = ep.times.per_step_ms()
        assert times["pages_s"] > 0 and times["dispatch_s"] > 0 and times["combine_s"] > 0, times
        REPORT[f"EP {num_ranks} on {num_ranks - 1} other hosts, ms per step"] = times
        _write_report()
    finally:
        ep.close()
    for r in range(1, num_ranks):  # STOP ended their world: each exits 0 on its own
        proc = cluster.hosts[f"rank{r}"].procs[-1]
        assert proc.wait(60) == 0, f"rank {r} exited with {proc.returncode}"
    cluster.log.flush()
    with open(cluster.log.name) as f:
        log = f.read()
    assert log.count("held here (a mirror of rank 0's)") >= num_ranks - 1  # no memory shared with rank 0


@pytest.fixture(scope="module")
def ep_mesh(cluster, files):  # noqa: F811
    """Redis, prefill and gateway on host front; decode (EP rank 0) on host decode; its rank 1
    on host rank1."""
    c = cluster
    front, decode = c.hosts["front"].address, c.hosts["decode"].address
    redis_url = f"redis://{front}:6379"
    model = str(files.checkpoint_dir)
    procs = {
        "redis": c.spawn(
            "front",
            ["redis-server", "--bind", front, "--port", "6379", "--save", "", "--appendonly", "no"]
            + ["--protected-mode", "no"],
            _env(),
            c.log,
        )
    }
    deadline = time.monotonic() + 30
    while not ping(redis_url):
        assert time.monotonic() < deadline, "redis did not answer on its host"
        time.sleep(0.1)
    common = ["--redis-url", redis_url, "--model", model, "--torch-threads", "1"]
    addresses = {"prefill": f"{front}:50051", "decode": f"{decode}:50051", "gateway": f"{front}:50052"}
    procs["decode"] = c.spawn(
        "decode",
        _kvmesh("serve", "decode", "--host", decode, "--port", "50051", *common, "--kv-port", "7100")
        + ["--ep", "2", "--ep-init-addr", f"{decode}:{EP_PORT}", "--ep-timeout", str(EP_TIMEOUT_S)],
        _env(),
        c.log,
    )
    procs["rank1"] = c.spawn(
        "rank1",
        _kvmesh("serve", "ep-rank", "--ep-init-addr", f"{decode}:{EP_PORT}", "--rank", "1", "--model", model),
        _env(),
        c.log,
    )
    procs["prefill"] = c.spawn(
        "front",
        _kvmesh("serve", "prefill", "--host", front, "--port", "50051", *common, "--kv-port", "7100"),
        _env(),
        c.log,
    )
    procs["gateway"] = c.spawn(
        "front",
        _kvmesh("serve", "gateway", "--host", front, "--port", "50052", "--redis-url", redis_url, "--model", model)
        + [f"--prefill={addresses['prefill']}", f"--decode={addresses['decode']}", "--wait-for-instances", "600"],
        _env(),
        c.log,
    )

    async def ready() -> None:
        await asyncio.gather(*(wait_for_health(addresses[n], 600) for n in ("decode", "prefill", "gateway")))

    asyncio.run(ready())
    return addresses, procs


def _hf_greedy(files, prompt_ids: list[int], new_tokens: int) -> list[int]:  # noqa: F811
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return resp.status


def test_a_mesh_with_an_ep_rank_on_another_host_then_its_link_cut(cluster, files, ep_mesh):  # noqa: F811
    addresses, procs = ep_mesh
    prompt = [5, 17, 230, 4111, 90, 7, 7, 301, 12, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]

    async def scenario():
        async with GatewayClient(addresses["gateway"]) as client:
            got = await client.complete(make_request(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True), 300)
            flowing = asyncio.Semaphore(0)
            tokens: list[int] = []
            long = make_request(prompt_token_ids=prompt[::-1], max_tokens=4000, ignore_eos=True)
            task = asyncio.ensure_future(stream_flowing(client, long, tokens, flowing))
            await asyncio.wait_for(flowing.acquire(), 120)
            await asyncio.to_thread(cluster.cut, "decode", "rank1")
            cut_at = time.monotonic()
            result = await task
            ended = time.monotonic() - cut_at
            health = await _health(addresses["decode"])
            try:  # a new request: no healthy decode now, said at once
                started = time.monotonic()
                await client.complete(make_request(prompt_token_ids=prompt, max_tokens=4), 60)
                after = ("OK", None, time.monotonic() - started)
            except grpc.aio.AioRpcError as exc:
                after = (exc.code().name, exc.details(), time.monotonic() - started)
            return got, result, ended, health, after

    try:
        got, result, ended, health, after = asyncio.run(scenario())
    finally:
        cluster.restore("decode", "rank1")
    # EP 2 across hosts, through the mesh: transformers' tokens
    assert got.token_ids == _hf_greedy(files, prompt, 24)
    assert got.final.kv_transfer.prefill_digest == got.final.kv_transfer.decode_digest
    # the cut: the step failed within --ep-timeout (and one step), naming rank 1 and its host
    code, details = result
    assert code == "UNAVAILABLE", result
    assert f"rank 1 (host {cluster.hosts['rank1'].address})" in details, details
    assert ended <= EP_TIMEOUT_S + 5.0, (ended, details)
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert after[0] == "UNAVAILABLE" and after[2] < 10.0, after
    REPORT["decode-rank1 cut mid-stream"] = {"status": code, "seconds": round(ended, 2), "next_request": after[0]}
    _write_report()
    with pytest.raises(grpc.RpcError) as info:  # gateways see it down: GetStats says why
        instance_stats(addresses["decode"], "decode")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "rank 1" in info.value.details()
    # prefill gave every page back
    deadline = time.monotonic() + 60
    while instance_stats(addresses["prefill"], "prefill").num_queued_tokens:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # rank 1's own step timed out too: it said so (to nobody) and left with status 1
    assert procs["rank1"].wait(120) == 1
