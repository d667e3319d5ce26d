"""`kvmesh bench --trace TRACE.jsonl`: replay a Mooncake-format trace through a real mesh.

Each block id of the trace becomes --block-tokens token ids drawn from a generator seeded by
the id (the same id always gives the same tokens, so requests that share leading ids share
that many leading blocks, exactly as the trace says), scaled down from the trace's 512 tokens
so prompts fit the model and the machine. The first --limit requests are sent as token ids at
their trace arrival times divided by --speedup, each decoding --max-tokens tokens, to a mesh
of --prefill prefill instances (the gateway's default cache-aware routing over a real Redis
index). Printed: prefix-cache hits as the prefill services count them, per instance, next to
what `kvmesh routesim`'s simulation of the same scaled requests predicts.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time

import numpy as np


def block_tokens(block_id: int, n: int, vocab_lo: int = 1000, vocab_hi: int = 40000) -> list[int]:
    """The n token ids standing for trace block `block_id` (deterministic in the id)."""
    return np.random.default_rng(block_id).integers(vocab_lo, vocab_hi, size=n).tolist()


def run_trace_bench(args) -> int:
    import grpc

    from kvmesh.client import GatewayClient, make_request
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port
    from kvmesh.routesim import TraceRequest, load_trace, router_chooser, simulate
    from protos.kvmesh.v1 import common_pb2, prefill_pb2_grpc

    trace = load_trace(args.trace)[: args.limit]
    B = args.block_tokens
    prompts = [[t for h in r.hash_ids for t in block_tokens(h, B)] for r in trace]
    # the simulator on the same scaled requests: blocks of B tokens, unlimited caches
    scaled = [TraceRequest(r.arrival_s, len(p), r.hash_ids) for r, p in zip(trace, prompts)]
    predicted = simulate(scaled, args.prefill, 0, router_chooser("cache_aware"), 1e9, "cache_aware")
    print(
        f"replaying {len(trace)} requests ({sum(map(len, prompts))} prompt tokens, blocks of {B} tokens) "
        f"through {args.prefill} prefill + 1 decode, {args.speedup:g}x the trace's pace ...",
        flush=True,
    )
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-trace-", suffix=".log") as log:
        # decode reserves a request's pages before its prefill: room for --concurrency long prompts
        mesh = start_mesh(
            args.prefill,
            1,
            args.model,
            port=free_port(),
            log=log,
            env={"REDIS_URL": ""},
            extra_decode_args=["--num-pages", "4096"],
        )
        try:

            async def replay() -> tuple[list, list, float]:
                async with GatewayClient(mesh.gateway_address) as client:
                    start = time.perf_counter()
                    slots = asyncio.Semaphore(args.concurrency)

                    async def one(r: TraceRequest, ids: list[int]):
                        await asyncio.sleep(max(0.0, r.arrival_s / args.speedup - (time.perf_counter() - start)))
                        async with slots:  # a client with a bounded number of requests in flight
                            return await client.complete(
                                make_request(prompt_token_ids=ids, ignore_eos=True, max_tokens=args.max_tokens),
                                timeout_s=600,
                            )

                    outs = await asyncio.gather(*[one(r, p) for r, p in zip(trace, prompts)])
                    wall = time.perf_counter() - start
                stats = []
                for address in mesh.prefill_addresses:
                    async with grpc.aio.insecure_channel(address) as ch:
                        stats.append(
                            await prefill_pb2_grpc.PrefillStub(ch).GetStats(common_pb2.StatsRequest(), timeout=10)
                        )
                return outs, stats, wall

            outs, stats, wall = asyncio.run(replay())
        finally:
            mesh.stop()
    cached = sum(s.num_prompt_tokens_cached for s in stats)
    computed = sum(s.num_prompt_tokens_computed for s in stats)
    per = [s.num_prompt_tokens_computed for s in stats]
    print(f"\n{'':<34}{'measured':>10}{'simulated':>11}")
    print(
        f"{'prefix-cache hit rate (tokens)':<34}{cached / max(cached + computed, 1):>10.3f}{predicted.hit_rate:>11.3f}"
    )
    print(
        f"{'balancedness (computed tokens)':<34}{sum(per) / len(per) / max(max(per), 1):>10.3f}"
        f"{predicted.balancedness:>11.3f}"
    )
    print(
        f"computed tokens per prefill instance: {per}; TTFT p50 "
        f"{sorted(o.final.ttft_s for o in outs)[len(outs) // 2] * 1000:.0f} ms; {wall:.1f} s in all"
    )
    return 0


def add_arguments(p) -> None:
    p.add_argument(
        "--trace", default=None, help="replay this Mooncake-format trace instead (see kvmesh/bench_trace.py)"
    )
    p.add_argument("--limit", type=int, default=100, help="with --trace: the first N requests")
    p.add_argument("--prefill", type=int, default=2, help="with --trace: prefill instances")
    p.add_argument("--block-tokens", type=int, default=16, help="with --trace: tokens per trace block (512 scaled)")
    p.add_argument("--speedup", type=float, default=2.0, help="with --trace: replay this many times faster")
    p.add_argument("--max-tokens", type=int, default=2, help="with --trace: tokens each request decodes")
    p.add_argument("--concurrency", type=int, default=16, help="with --trace: most requests in flight")


if __name__ == "__main__":
    sys.exit("run it as `kvmesh bench --trace TRACE.jsonl`")
