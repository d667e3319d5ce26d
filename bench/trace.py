"""`kvmesh bench --trace TRACE.jsonl`: replay a Mooncake-format trace through a real mesh.

Each block id of the trace becomes --block-tokens token ids drawn from a generator seeded by
the id (the same id always gives the same tokens, so requests that share leading ids share
that many leading blocks, exactly as the trace says), scaled down from the trace's 512 tokens
so prompts fit the model and the machine. The first --limit requests are sent as token ids at
their trace arrival times divided by --speedup, each decoding --max-tokens tokens, to a mesh
of --prefill prefill instances (the gateway's default cache-aware routing over a real Redis
index). Printed: prefix-cache hits as the prefill services count them, per instance, next to
what `kvmesh routesim`'s simulation of the same scaled requests predicts. `--plot DIR` also
writes PNGs of both (see bench/trace_plots.py).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvmesh.bench.routing_sim import TraceRequest, load_trace, router_chooser, simulate
from kvmesh.bench.trace_plots import MeasuredRequest, write_plots
from kvmesh.progress import progress_bar


def block_tokens_of(block_id: int, n: int, vocab_lo: int = 1000, vocab_hi: int = 40000) -> list[int]:
    """The n token ids standing for trace block `block_id` (deterministic in the id)."""
    return np.random.default_rng(block_id).integers(vocab_lo, vocab_hi, size=n).tolist()


def scale_trace(trace: Sequence[TraceRequest], block_tokens: int) -> tuple[list[list[int]], list[TraceRequest]]:
    """Each request's prompt token ids (block_tokens per hash id) and the request with that length."""
    prompts = [[t for h in r.hash_ids for t in block_tokens_of(h, block_tokens)] for r in trace]
    return prompts, [TraceRequest(r.arrival_s, len(p), r.hash_ids) for r, p in zip(trace, prompts)]


async def replay(
    gateway_address: str,
    trace: Sequence[TraceRequest],
    prompts: Sequence[list[int]],
    *,
    speedup: float,
    concurrency: int,
    max_tokens: int,
    quiet: bool = False,
) -> tuple[list[MeasuredRequest], float]:
    """Send each prompt (token ids) at its arrival / speedup, at most `concurrency` in flight.

    Returns one MeasuredRequest per request, in trace order, and the replay's wall time
    (seconds). A request that fails raises its grpc.aio.AioRpcError. A progress bar counts
    finished requests on a terminal, unless `quiet`.
    """
    from kvmesh.client import GatewayClient, make_request

    async with GatewayClient(gateway_address) as client:
        start = time.perf_counter()
        slots = asyncio.Semaphore(concurrency)
        bar = progress_bar(len(prompts), "requests", quiet=quiet)

        async def one(r: TraceRequest, ids: list[int]) -> MeasuredRequest:
            await asyncio.sleep(max(0.0, r.arrival_s / speedup - (time.perf_counter() - start)))
            async with slots:  # a client with a bounded number of requests in flight
                sent = time.perf_counter() - start
                out = await client.complete(
                    make_request(prompt_token_ids=ids, ignore_eos=True, max_tokens=max_tokens), timeout_s=600
                )
            bar.update()
            f = out.final
            return MeasuredRequest(
                sent,
                f.ttft_s,
                f.itl_s,
                f.prompt_tokens,
                f.cached_tokens,
                f.prefill_instance,
                f.prefill_s,
                r.arrival_s / speedup,
            )

        try:
            outs = await asyncio.gather(*[one(r, p) for r, p in zip(trace, prompts)])
        finally:
            bar.close()
        return list(outs), time.perf_counter() - start


def run_trace_bench(args) -> int:
    import grpc

    from kvmesh.launcher import start_mesh
    from kvmesh.protos.v1 import common_pb2, prefill_pb2_grpc
    from kvmesh.redis_server import free_port

    trace = load_trace(args.trace)[: args.limit]
    B = args.block_tokens
    prompts, scaled = scale_trace(trace, B)
    # the simulator on the same scaled requests: blocks of B tokens, unlimited caches
    predicted = simulate(scaled, args.prefill, 0, router_chooser("cache_aware", B), 1e9, "cache_aware", B)
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

            async def run() -> tuple[list[MeasuredRequest], list, float]:
                measured, wall = await replay(
                    mesh.gateway_address,
                    trace,
                    prompts,
                    speedup=args.speedup,
                    concurrency=args.concurrency,
                    max_tokens=args.max_tokens,
                )
                stats = []
                for address in mesh.prefill_addresses:
                    async with grpc.aio.insecure_channel(address) as ch:
                        stats.append(
                            await prefill_pb2_grpc.PrefillStub(ch).GetStats(common_pb2.StatsRequest(), timeout=10)
                        )
                return measured, stats, wall

            measured, stats, wall = asyncio.run(run())
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
        f"{sorted(m.ttft_s for m in measured)[len(measured) // 2] * 1000:.0f} ms; {wall:.1f} s in all"
    )
    if args.plot:
        rate = measured_prefill_rate(measured)
        # the simulation again, on the replay's clock and at the prefill rate the mesh showed,
        # so its TTFT (queue + prefill) lines up with the measured one
        paced = [TraceRequest(r.arrival_s / args.speedup, r.input_tokens, r.hash_ids) for r in scaled]
        sim = simulate(paced, args.prefill, 0, router_chooser("cache_aware", B), rate, "cache_aware", B)
        paths = write_plots(Path(args.plot), measured, sim.requests)
        print(f"plots ({rate:.0f} prefill tok/s simulated): " + ", ".join(map(str, paths)))
    return 0


def measured_prefill_rate(measured: Sequence[MeasuredRequest]) -> float:
    """Prompt tokens one prefill instance computed per second it was busy (tokens/s; > 0).

    A request's prefill ran about [first token - prefill_s, first token]; a batched prefill
    gives every request in the batch the whole batch's time, so each instance's busy time is
    the union of its requests' intervals, not their sum.
    """
    tokens, busy = 0, 0.0
    for name in {m.prefill_instance for m in measured}:
        rows = sorted((m.first_token_s - m.prefill_s, m.first_token_s) for m in measured if m.prefill_instance == name)
        tokens += sum(m.prompt_tokens - m.cached_tokens for m in measured if m.prefill_instance == name)
        end = -float("inf")
        for a, b in rows:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
    return max(tokens, 1) / max(busy, 1e-6)


def add_arguments(p) -> None:
    p.add_argument("--trace", default=None, help="replay this Mooncake-format trace instead (see bench/trace.py)")
    p.add_argument("--limit", type=int, default=100, help="with --trace: the first N requests")
    p.add_argument("--prefill", type=int, default=2, help="with --trace: prefill instances")
    p.add_argument("--decode", type=int, default=2, help="with --trace --multiturn: decode instances")
    p.add_argument("--prefill-pages", type=int, default=512, help="with --multiturn: pages of each prefill's pool")
    p.add_argument(
        "--tier-blocks", type=int, default=4096, help="with --multiturn: blocks of each prefill's second tier"
    )
    p.add_argument(
        "--sim-tokens-per-s", type=float, default=3000.0, help="with --multiturn: the simulation's prefill rate"
    )
    p.add_argument(
        "--spill",
        action="store_true",
        help="with --multiturn: route prefill round robin, so turns leave the prefill that holds them (pulls pay)",
    )
    p.add_argument(
        "--multiturn",
        action="store_true",
        help="with --trace: replay the trace's conversations (turns extending earlier prompts) with decode-side "
        "prefix reuse off, then on (bench/multiturn.py)",
    )
    p.add_argument("--block-tokens", type=int, default=16, help="with --trace: tokens per trace block (512 scaled)")
    p.add_argument("--speedup", type=float, default=2.0, help="with --trace: replay this many times faster")
    p.add_argument("--max-tokens", type=int, default=2, help="with --trace: tokens each request decodes")
    p.add_argument("--concurrency", type=int, default=16, help="with --trace: most requests in flight")
    p.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="with --trace: write TTFT/ITL CDFs, computed tokens and hit rate over time as PNGs into DIR",
    )


if __name__ == "__main__":
    sys.exit("run it as `kvmesh bench --trace TRACE.jsonl`")
