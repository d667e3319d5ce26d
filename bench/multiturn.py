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

Printed, for reuse off and on: MB and pages pushed per request, the pages decode held already,
the push's seconds (p50), prefill tokens computed, TTFT p50/p90, and how evenly the decode
instances were loaded (balancedness: mean / max requests); then what the ideal holds: a
request's parent's blocks (what one decode of unlimited size that saw every turn would hold of
its prompt), and the bound the issue sets, pages pushed <= pages decode lacked + 1.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.routing_sim import BLOCK_TOKENS, TraceRequest, load_trace
from bench.trace import scale_trace
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
    """One replayed turn, as its Final message reported it."""

    prompt_tokens: int
    prefill_cached_tokens: int
    pages: int
    decode_cached_pages: int
    nbytes: int
    push_s: float
    ttft_s: float
    decode_instance: str


async def replay(address: str, turns: Sequence[Turn], prompts: Sequence[list[int]], concurrency: int, max_tokens: int):
    """Send every turn once its parent answered (token ids, ignore_eos), at most `concurrency` at
    once; returns one Answered per turn, in order. A failed request raises its AioRpcError."""
    from kvmesh.client import GatewayClient, make_request

    answered = [asyncio.Event() for _ in turns]
    slots = asyncio.Semaphore(concurrency)
    bar = progress_bar(len(turns), "turns")
    async with GatewayClient(address) as client:

        async def one(i: int) -> Answered:
            parent = turns[i].parent
            if parent is not None:
                await answered[parent].wait()
            async with slots:
                out = await client.complete(
                    make_request(prompt_token_ids=prompts[i], ignore_eos=True, max_tokens=max_tokens), timeout_s=600
                )
            answered[i].set()
            bar.update()
            f, kv = out.final, out.final.kv_transfer
            return Answered(
                f.prompt_tokens,
                f.cached_tokens,
                kv.num_pages,
                kv.decode_cached_pages,
                kv.nbytes,
                kv.seconds,
                f.ttft_s,
                f.decode_instance,
            )

        try:
            return await asyncio.gather(*[one(i) for i in range(len(turns))])
        finally:
            bar.close()


def _pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_multiturn_bench(args) -> int:
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    B = args.block_tokens
    turns = conversations(load_trace(args.trace), args.limit)
    if not turns:
        print("error: no conversation of two turns or more in the trace", flush=True)
        return 2
    prompts, _ = scale_trace([t.request for t in turns], B)
    # the ideal: every block a turn shares with its parent's whole prompt (scaled: all its blocks
    # are full) is held by the decode it reaches, short of its last token's page
    ideal = [
        min(len(turns[t.parent].request.hash_ids), t.shared_blocks, (len(p) - 1) // B) if t.parent is not None else 0
        for t, p in zip(turns, prompts)
    ]
    n_conv = sum(t.parent is None for t in turns)
    print(
        f"{len(turns)} turns of {n_conv} conversations ({sum(map(len, prompts))} prompt tokens, blocks of {B} "
        f"tokens) through {args.prefill} prefill + {args.decode} decode, reuse off then on ...",
        flush=True,
    )
    results: dict[str, list[Answered]] = {}
    walls: dict[str, float] = {}
    for mode in ("off", "on"):
        with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-multiturn-", suffix=".log") as log:
            decode_args = ["--num-pages", "4096"] + ([] if mode == "on" else ["--no-prefix-caching"])
            mesh = start_mesh(
                args.prefill, args.decode, args.model, port=free_port(), log=log, env={"REDIS_URL": ""},
                extra_decode_args=decode_args,
            )  # fmt: skip
            try:
                started = time.perf_counter()
                results[mode] = asyncio.run(
                    replay(mesh.gateway_address, turns, prompts, args.concurrency, args.max_tokens)
                )
                walls[mode] = time.perf_counter() - started
            finally:
                mesh.stop()
    _print(results, walls, ideal, B)
    return 0


def _print(
    results: dict[str, list[Answered]], walls: dict[str, float], ideal: list[int], B: int, min_blocks: int = 4
) -> None:
    def row(name: str, fn, fmt: str = "{:>10.2f}") -> None:
        off, on = fn(results["off"]), fn(results["on"])
        ratio = f"{on / off:>8.2f}x" if off else f"{'':>9}"
        print(f"{name:<40}{fmt.format(off)}{fmt.format(on)}{ratio}")

    def balancedness(rs: list[Answered]) -> float:
        counts: dict[str, int] = {}
        for r in rs:
            counts[r.decode_instance] = counts.get(r.decode_instance, 0) + 1
        return statistics.mean(counts.values()) / max(counts.values())

    print(f"\n{'':<40}{'reuse off':>10}{'reuse on':>10}{'on/off':>9}")
    row("MB pushed per turn (mean)", lambda rs: statistics.mean(r.nbytes for r in rs) / 1e6)
    row("pages pushed per turn (mean)", lambda rs: statistics.mean(r.pages for r in rs))
    row("pages decode held per turn (mean)", lambda rs: statistics.mean(r.decode_cached_pages for r in rs))
    row("push seconds per turn (p50, ms)", lambda rs: _pct([r.push_s for r in rs], 0.5) * 1000)
    row("prefill tokens computed (all turns)", lambda rs: sum(r.prompt_tokens - r.prefill_cached_tokens for r in rs),
        "{:>10.0f}")  # fmt: skip
    row("TTFT p50 (ms)", lambda rs: _pct([r.ttft_s for r in rs], 0.5) * 1000, "{:>10.0f}")
    row("TTFT p90 (ms)", lambda rs: _pct([r.ttft_s for r in rs], 0.9) * 1000, "{:>10.0f}")
    row("decode balancedness (requests)", balancedness)
    print(f"{'wall seconds':<40}{walls['off']:>10.1f}{walls['on']:>10.1f}")
    on = results["on"]
    lacked = [(r.prompt_tokens + B - 1) // B - h for r, h in zip(on, ideal)]
    over = [h for r, lack, h in zip(on, lacked, ideal) if r.pages > lack + 1]
    held = sum(r.decode_cached_pages for r in on)
    print(
        f"\nideal (each turn's parent's blocks, held by the decode it reaches): {statistics.mean(ideal):.2f} pages "
        f"per turn; held {held} of {sum(ideal)} ({held / max(sum(ideal), 1):.2f})\nturns pushing more than the "
        f"pages decode lacked + 1: {len(over)} of {len(on)} ({sum(h < min_blocks for h in over)} of them share fewer "
        f"than --decode-reuse-min-blocks = {min_blocks} blocks with their parent)"
    )
