"""`kvmesh bench --pull`: pulling a prefix from a peer prefill against computing it, side by side.

A live mesh of 2 prefill instances (A, B) and 1 decode on the default model. For each prompt
length, each round: prompt P (fresh token ids) is prefilled on A, which keeps its blocks; then
B is asked to prefill P naming A as the holder (`pull_from`, as the gateway does when it chose B
over the holder), and to prefill a fresh prompt Q of the same length cold. Printed per length
(medians over --rounds): B's cold compute, and with the pull the pull's seconds and the compute
of what was left, their sum against the cold compute (the ratio), the pull's GB/s, and whether
B's own estimate chose to pull (it computes where computing is the cheaper: the crossover).
Prefill-only calls (no decode leg), so the figures are prefill's alone.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile

import numpy as np


async def _prefill(address: str, ids: list[int], rid: str, **fields):
    import grpc

    from kvmesh.protos.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        request = prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=ids, sampling=common_pb2.SamplingParams(), **fields
        )
        return await prefill_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=600)


def run_pull_bench(args) -> int:
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    lengths = [int(x) for x in args.pull_lengths.split(",")]
    rng = np.random.default_rng(7)
    print(f"pull vs compute on prefill, prompts of {lengths} tokens, {args.rounds} rounds each ...", flush=True)
    rows = []
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-pull-", suffix=".log") as log:
        # pools large enough that nothing is evicted between a prompt's two prefills
        mesh = start_mesh(2, 1, args.model, port=free_port(), log=log, env={"REDIS_URL": ""},
                          extra_prefill_args=["--num-pages", "4096"])  # fmt: skip
        try:
            a, b = mesh.prefill_addresses

            async def measure():
                await _prefill(b, rng.integers(1000, 40000, 64).tolist(), "warm-b")  # B measures its rate
                for n in lengths:
                    cold, pulled = [], []
                    for k in range(args.rounds):
                        p = rng.integers(1000, 40000, n).tolist()
                        q = rng.integers(1000, 40000, n).tolist()
                        await _prefill(a, p, f"hold-{n}-{k}")
                        pulled.append(await _prefill(b, p, f"pull-{n}-{k}", pull_from=a, pull_blocks=n // 16))
                        cold.append(await _prefill(b, q, f"cold-{n}-{k}"))
                    rows.append((n, cold, pulled))

            asyncio.run(measure())
        finally:
            mesh.stop()
    print(f"\n{'prompt tokens':>14}{'cold ms':>10}{'pulled tok':>12}{'pull ms':>10}{'rest ms':>10}"
          f"{'pull+rest':>11}{'vs cold':>9}{'GB/s':>8}")  # fmt: skip
    for n, cold, pulled in rows:
        c = statistics.median(r.compute_s for r in cold) * 1000
        pull = statistics.median(r.pull_s for r in pulled) * 1000
        rest = statistics.median(r.compute_s for r in pulled) * 1000
        tokens = statistics.median(r.num_pulled_tokens for r in pulled)
        nbytes = tokens // 16 * pulled[0].kv_transfer.page_nbytes
        gbps = nbytes / (pull / 1000) / 1e9 if pull and tokens else 0.0
        print(f"{n:>14}{c:>10.1f}{tokens:>12.0f}{pull:>10.1f}{rest:>10.1f}{pull + rest:>11.1f}"
              f"{(pull + rest) / c:>8.2f}x{gbps:>8.2f}")  # fmt: skip
    return 0
