"""`kvmesh bench --trace TRACE.jsonl --multiturn`: conversations from a Mooncake-format trace
replayed through a live mesh with decode-side prefix reuse off, then on, side by side.

A request continues a conversation when an earlier request's whole prompt (its full 512-token
blocks, `input_length // 512` leading hash ids) is a prefix of its own; the longest such earlier
request is its parent (in the public conversation trace ~30% of all prompt blocks are such a
parent's). The first conversations of at least two turns, up to --limit requests, are scaled
as `kvmesh bench --trace` scales (one hash id -> --block-tokens token ids, the same id always
the same tokens) and replayed in trace order: a turn is sent once its parent's answer came
back (the user read it), at most --concurrency in flight, each decoding --max-tokens tokens.
The mesh: --prefill prefill and --decode decode instances on the default model, its own Redis.

Four runs, each adding one part of the KV cache system (MODES): all off; decode-side reuse;
pulls between prefill instances; a second tier on each prefill (--prefill-pages small enough
that pools evict). Printed side by side: MB and pages pushed per turn, the pages decode held
already, the push's seconds (p50), tokens pulled, where TTFT goes (queue, pull, compute, the
push left in TTFT, the rest: lookup and RPCs), TTFT p50/p90, prefill tokens computed and how
evenly prefill and decode were loaded (balancedness: mean / max); then what the ideal holds (a
turn's parent's blocks, at the decode it reaches) against the bound pages pushed <= pages
decode lacked + 1; and `kvmesh routesim`'s simulation of the same turns beside the measured
prefill tokens computed, with the oracle (one cache of the mesh's whole size). `--spill` routes
prefill round robin in every run, so turns leave the instance that holds their conversation (as
load spill does at scale), which is where pulls pay.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.bench.routing_sim import BLOCK_TOKENS, TraceRequest, load_trace
from kvmesh.bench.trace import scale_trace
from kvmesh.progress import progress_bar


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: its trace row, its parent's index in the replay (None for
    a first turn) and how many leading blocks it shares with the parent's whole prompt."""

    request: TraceRequest
    parent: int | None
    shared_blocks: int


def conversations(
    trace: Sequence[TraceRequest], limit: int, min_shared_blocks: int = 2, max_blocks: int = 64
) -> list[Turn]:
    """The turns of the first whole conversations of >= 2 turns (none with a prompt over
    `max_blocks` blocks), in trace order, at most `limit` turns in all.

    A request's parent is the latest earlier request whose full blocks (input_tokens // 512
    leading hash ids) are the longest prefix of its hash ids, of at least `min_shared_blocks`
    blocks (the shared system prompt, block 0, alone makes no conversation)."""
    whole: dict[tuple[int, ...], int] = {}
    parent: list[tuple[int | None, int]] = []
    for i, r in enumerate(trace):
        found: tuple[int | None, int] = (None, 0)
        for k in range(len(r.hash_ids), min_shared_blocks - 1, -1):
            if r.hash_ids[:k] in whole:
                found = (whole[r.hash_ids[:k]], k)
                break
        parent.append(found)
        whole[r.hash_ids[: r.input_tokens // BLOCK_TOKENS]] = i
    root = list(range(len(trace)))
    members: dict[int, list[int]] = {}
    for i, (p, _) in enumerate(parent):
        if p is not None:
            root[i] = root[p]
        members.setdefault(root[i], []).append(i)
    chosen: list[int] = []
    for first in sorted(members):  # conversations in the order they begin, each whole
        turns = members[first]
        if len(turns) < 2 or max(len(trace[i].hash_ids) for i in turns) > max_blocks:
            continue
        if len(chosen) + len(turns) > limit:
            break
        chosen += turns
    chosen.sort()
    position = {i: n for n, i in enumerate(chosen)}
    return [
        Turn(trace[i], position.get(parent[i][0]) if parent[i][0] is not None else None, parent[i][1]) for i in chosen
    ]


@dataclass(frozen=True)
class Answered:
    """One replayed turn, as its Final message reported it (seconds from the replay's start for
    sent_s; the rest as Final says)."""

    sent_s: float
    prompt_tokens: int
    prefill_cached_tokens: int
    pulled_tokens: int
    pages: int
    decode_cached_pages: int
    nbytes: int
    push_s: float
    exposed_push_s: float
    pull_s: float
    queue_s: float
    compute_s: float
    ttft_s: float
    prefill_instance: str
    decode_instance: str


async def replay(address: str, turns: Sequence[Turn], prompts: Sequence[list[int]], concurrency: int, max_tokens: int):
    """Send every turn once its parent answered (token ids, ignore_eos), at most `concurrency` at
    once; returns one Answered per turn, in order. A failed request raises its AioRpcError."""
    from kvmesh.client import GatewayClient, make_request

    answered = [asyncio.Event() for _ in turns]
    slots = asyncio.Semaphore(concurrency)
    bar = progress_bar(len(turns), "turns")
    started = time.perf_counter()
    async with GatewayClient(address) as client:

        async def one(i: int) -> Answered:
            parent = turns[i].parent
            if parent is not None:
                await answered[parent].wait()
            async with slots:
                sent = time.perf_counter() - started
                out = await client.complete(
                    make_request(prompt_token_ids=prompts[i], ignore_eos=True, max_tokens=max_tokens), timeout_s=600
                )
            answered[i].set()
            bar.update()
            f, kv = out.final, out.final.kv_transfer
            return Answered(
                sent,
                f.prompt_tokens,
                f.cached_tokens,
                f.pulled_tokens,
                kv.num_pages,
                kv.decode_cached_pages,
                kv.nbytes,
                kv.seconds,
                kv.exposed_seconds,
                f.pull_s,
                f.queue_s,
                f.prefill_s,
                f.ttft_s,
                f.prefill_instance,
                f.decode_instance,
            )

        try:
            return await asyncio.gather(*[one(i) for i in range(len(turns))])
        finally:
            bar.close()


def _pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


MODES = ("off", "decode reuse", "+ pull", "+ tier")
"""Each run adds one part: decode-side reuse, then pulls between prefills, then a second tier."""


def _mesh_args(mode: str, args, tier_dir: str) -> tuple[list[str], list[str], list[str]]:
    """(prefill, decode, gateway) flags of one mode's mesh."""
    n = MODES.index(mode)
    prefill = ["--num-pages", str(args.prefill_pages)] + ([] if n >= 2 else ["--no-kv-pull"])
    if n >= 3:
        prefill += ["--kv-tier-blocks", str(args.tier_blocks), "--kv-tier-dir", tier_dir]
    decode = ["--num-pages", "4096"] + ([] if n >= 1 else ["--no-prefix-caching"])
    gateway = [] if n >= 2 else ["--pull-min-blocks", "0"]
    if args.spill:  # every turn to either prefill in turn, wherever its conversation is: all load spill
        gateway += ["--routing-policy", "round_robin"]
    return prefill, decode, gateway


def run_multiturn_bench(args) -> int:
    import grpc

    from kvmesh.launcher import start_mesh
    from kvmesh.protos.v1 import common_pb2, prefill_pb2_grpc
    from kvmesh.redis_server import free_port

    B = args.block_tokens
    turns = conversations(load_trace(args.trace), args.limit)
    if not turns:
        print("error: no conversation of two turns or more in the trace", flush=True)
        return 2
    prompts, scaled = scale_trace([t.request for t in turns], B)
    # the ideal: every block a turn shares with its parent's whole prompt (scaled: all its blocks
    # are full) is held by the decode it reaches, short of its last token's page
    ideal = [
        min(len(turns[t.parent].request.hash_ids), t.shared_blocks, (len(p) - 1) // B) if t.parent is not None else 0
        for t, p in zip(turns, prompts)
    ]
    n_conv = sum(t.parent is None for t in turns)
    print(
        f"{len(turns)} turns of {n_conv} conversations ({sum(map(len, prompts))} prompt tokens, blocks of {B} "
        f"tokens) through {args.prefill} prefill ({args.prefill_pages} pages each) + {args.decode} decode"
        f"{', prefill routed round robin (--spill)' if args.spill else ''}; modes: {', '.join(MODES)} ...",
        flush=True,
    )
    results: dict[str, list[Answered]] = {}
    per_prefill: dict[str, list[int]] = {}
    for mode in MODES:
        with (
            tempfile.NamedTemporaryFile("w+", prefix="kvmesh-multiturn-", suffix=".log") as log,
            tempfile.TemporaryDirectory(prefix="kvmesh-tier-") as tier_dir,
        ):
            prefill_args, decode_args, gateway_args = _mesh_args(mode, args, tier_dir)
            mesh = start_mesh(
                args.prefill, args.decode, args.model, port=free_port(), log=log, env={"REDIS_URL": ""},
                extra_prefill_args=prefill_args, extra_decode_args=decode_args, extra_gateway_args=gateway_args,
            )  # fmt: skip
            try:
                results[mode] = asyncio.run(
                    replay(mesh.gateway_address, turns, prompts, args.concurrency, args.max_tokens)
                )

                async def computed(addresses: list[str]) -> list[int]:
                    out = []
                    for address in addresses:
                        async with grpc.aio.insecure_channel(address) as ch:
                            stub = prefill_pb2_grpc.PrefillStub(ch)
                            s = await stub.GetStats(common_pb2.StatsRequest(), timeout=10)
                            out.append(s.num_prompt_tokens_computed)
                    return out

                per_prefill[mode] = asyncio.run(computed(mesh.prefill_addresses))
            finally:
                mesh.stop()
    _print(results, per_prefill, ideal, B, args)
    _print_simulated(scaled, results, args)
    return 0


def _print(
    results: dict[str, list[Answered]], per_prefill: dict[str, list[int]], ideal: list[int], B: int, args
) -> None:
    modes = list(results)

    def row(name: str, fn, fmt: str = "{:>14.2f}") -> None:
        print(f"{name:<38}" + "".join(fmt.format(fn(results[m], m)) for m in modes))

    def balancedness(counts: Sequence[float]) -> float:
        return statistics.mean(counts) / max(max(counts), 1e-9)

    def decode_balance(rs: list[Answered], _m: str) -> float:
        counts: dict[str, int] = {}
        for r in rs:
            counts[r.decode_instance] = counts.get(r.decode_instance, 0) + 1
        return balancedness(list(counts.values()))

    print(f"\n{'per turn (mean, or p50 where it says)':<38}" + "".join(f"{m:>14}" for m in modes))
    row("MB pushed", lambda rs, m: statistics.mean(r.nbytes for r in rs) / 1e6)
    row("pages pushed", lambda rs, m: statistics.mean(r.pages for r in rs))
    row("pages decode held already", lambda rs, m: statistics.mean(r.decode_cached_pages for r in rs))
    row("push ms (p50)", lambda rs, m: _pct([r.push_s for r in rs], 0.5) * 1000)
    row("prefill tokens pulled", lambda rs, m: statistics.mean(r.pulled_tokens for r in rs))
    print("where TTFT goes (ms, mean)")
    # queue_s runs from the request's arrival at prefill to its compute: the pull (and the wait
    # for the worker to allocate its pages) lies inside it
    row("  prefill queue (less the pull)", lambda rs, m: statistics.mean(r.queue_s - r.pull_s for r in rs) * 1000)
    row("  pull", lambda rs, m: statistics.mean(r.pull_s for r in rs) * 1000)
    row("  compute", lambda rs, m: statistics.mean(r.compute_s for r in rs) * 1000)
    row("  push left in TTFT", lambda rs, m: statistics.mean(r.exposed_push_s for r in rs) * 1000)
    row(
        "  the rest (lookup, RPCs)",
        lambda rs, m: statistics.mean(r.ttft_s - r.queue_s - r.compute_s - r.exposed_push_s for r in rs) * 1000,
    )
    row("TTFT p50 ms", lambda rs, m: _pct([r.ttft_s for r in rs], 0.5) * 1000, "{:>14.0f}")
    row("TTFT p90 ms", lambda rs, m: _pct([r.ttft_s for r in rs], 0.9) * 1000, "{:>14.0f}")
    print("whole replay")
    row("prefill tokens computed", lambda rs, m: sum(per_prefill[m]), "{:>14.0f}")
    row("prefill balancedness (computed)", lambda rs, m: balancedness(per_prefill[m]))
    row("decode balancedness (requests)", decode_balance)
    on = results[modes[-1]]
    lacked = [(r.prompt_tokens + B - 1) // B - h for r, h in zip(on, ideal)]
    over = [h for r, lack, h in zip(on, lacked, ideal) if r.pages > lack + 1]
    held = sum(r.decode_cached_pages for r in on)
    print(
        f"\ndecode reuse ({modes[-1]}): held {held} of the {sum(ideal)} pages the ideal holds (each turn's parent's "
        f"blocks, at the decode it reaches): {held / max(sum(ideal), 1):.2f}; turns pushing more than the pages "
        f"decode lacked + 1: {len(over)} of {len(on)} ({sum(h < 4 for h in over)} of them share fewer than 4 blocks "
        f"with their parent, below --decode-reuse-min-blocks)"
    )


def _print_simulated(scaled: Sequence[TraceRequest], results: dict[str, list[Answered]], args) -> None:
    """`kvmesh routesim`'s simulation of the same turns, sent when the replay sent them, beside the
    measured prefill tokens computed: the same router, pools of --prefill-pages blocks."""
    from kvmesh.bench.routing_sim import router_chooser, simulate

    B = args.block_tokens
    policy = "round_robin" if args.spill else "cache_aware"
    print(f"\n{'prefill tokens computed':<38}{'measured':>14}{'simulated':>14}{'oracle':>14}{'sim/oracle':>12}")
    for mode, tier, pull in (("decode reuse", 0, 0), ("+ pull", 0, 4), ("+ tier", args.tier_blocks, 4)):
        rs = results[mode]
        timed = [TraceRequest(r.sent_s, t.input_tokens, t.hash_ids) for r, t in zip(rs, scaled)]
        order = sorted(range(len(timed)), key=lambda k: timed[k].arrival_s)
        sim = simulate(
            [timed[k] for k in order], args.prefill, args.prefill_pages, router_chooser(policy, B),
            args.sim_tokens_per_s, policy, B, tier_blocks=tier, pull_min_blocks=pull,
        )  # fmt: skip
        measured = sum(r.prompt_tokens - r.prefill_cached_tokens for r in rs)
        print(
            f"{mode:<38}{measured:>14.0f}{sim.computed_tokens:>14.0f}{sim.oracle_computed_tokens:>14.0f}"
            f"{sim.computed_tokens / max(sim.oracle_computed_tokens, 1):>12.3f}"
        )
