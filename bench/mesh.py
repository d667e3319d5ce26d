"""`kvmesh bench`: the mesh's decode and prefill next to transformers, llama.cpp and kvmesh's
engine alone, in one run.

Measures on the default model (or --model), greedy, EOS ignored so every request decodes
exactly --new-tokens tokens. First the peers, each in a process of its own while no mesh runs
(`kvmesh.bench.peers`: an idle mesh's threads must not slow a peer, nor a peer the mesh):
- transformers `generate` (fp32 weights): single-stream decode tokens/s, and batched decode
  of 4 and 16 prompts at once (the like-for-like baseline of the mesh's concurrent rounds),
  prefill excluded (time of N new tokens minus the time of 1); its forward over a 2K-token
  prompt (prefill tokens/s);
- llama.cpp on the same GGUF file (2 threads, when `llama_cpp` is importable: a wheel for this
  machine kind is in ../shared/wheels/; a benchmark peer, never a dependency): single-stream
  decode and prompt evaluation of the same 2K tokens;
- the engine alone (LlamaRunner, no services): single-stream decode.
Then the mesh (1 prefill, 1 decode):
- single-stream decode tokens/s ((generated-1) / (e2e - TTFT) per request), and how much of a
  token's time decode's step takes (forward + sampling, from its GetStats `step_seconds`) and
  how much goes outside it (emit, hand-off to decode's event loop, gRPC to the gateway);
- aggregate tokens/s with 4 and 16 concurrent requests (all tokens, prefill included, over
  the round's wall time);
- a 2K-token prompt: prefill tokens/s (prompt / prefill compute), the whole KV push and the
  part of it left after the compute (chunked prefill pushes each chunk while the next
  computes), from the `Final` message;
- TTFT p50 / p90 over every request of the run;
- orchestration p50 / p90 (`orchestration_s`: TTFT less the prefill queue, the prefill compute
  and the push left after it, as the `Final` message reports them: the gateway, the index
  lookup, decode's Reserve and the RPC hops), over sequential short prompts (32 tokens,
  max_tokens 1) and over the 2K-token prompts.
Every prompt is new from its first token, so no figure is a prefix-cache hit. Each level runs
--rounds times and reports the median. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time

from kvmesh.bench import peers
from kvmesh.progress import progress_bar

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how rainbows form.",
    "Describe a busy market in the morning.",
    "Write about a journey across the mountains.",
]
LONG_PROMPT_TOKENS = 2048
BATCHES = (4, 16)

SHORT_PROMPT_TOKENS = 32
ORCHESTRATION_REQUESTS = 60

_ROUNDS = iter(range(1, 1 << 30))


def orchestration_s(final) -> float:
    """Seconds of a request's TTFT outside the prefill queue, the prefill compute and the KV
    push, from its `Final` message: client -> gateway -> index lookup -> decode Reserve ->
    Prefill RPC -> first token back. The push counts only the part left in TTFT
    (`exposed_seconds`, when prefill overlaps it with a chunked compute), else all of it."""
    push_s = final.kv_transfer.exposed_seconds or final.kv_transfer.seconds
    return final.ttft_s - final.queue_s - final.prefill_s - push_s


async def _short_prompts(address: str, long_ids: list[int], count: int) -> list[float]:
    """Orchestration seconds of `count` sequential fresh 32-token prompts, max_tokens 1."""
    from kvmesh.client import GatewayClient, make_request

    out = []
    async with GatewayClient(address) as client:
        for _ in range(count):
            ids = [1000 + next(_ROUNDS) % 40000, *long_ids[1:SHORT_PROMPT_TOKENS]]
            final = (await client.complete(make_request(prompt_token_ids=ids, max_tokens=1), timeout_s=60)).final
            out.append(orchestration_s(final))
    return out


async def _round(
    address: str, concurrency: int, new_tokens: int, ttfts: list[float], cached: list[int]
) -> tuple[float, float]:
    """(aggregate tokens/s, mean per-request decode tokens/s) for `concurrency` requests at once.

    Every prompt of the run is new from its first token (a round and request tag leads it, no
    chat template), so no round is flattered by the prefix cache; `cached` collects the cached
    prompt tokens each request reports all the same."""
    from kvmesh.client import GatewayClient, make_request

    tag = next(_ROUNDS)
    async with GatewayClient(address) as client:
        reqs = [
            make_request(
                f"[{tag}.{i}] " + PROMPTS[i % len(PROMPTS)], chat=False, max_tokens=new_tokens, ignore_eos=True
            )
            for i in range(concurrency)
        ]
        start = time.perf_counter()
        outs = await asyncio.gather(*[client.complete(r, timeout_s=900) for r in reqs])
        wall = time.perf_counter() - start
    ttfts.extend(o.final.ttft_s for o in outs)
    cached.extend(o.final.cached_tokens for o in outs)
    total = sum(o.final.generated_tokens for o in outs)
    per_request = [(o.final.generated_tokens - 1) / (o.final.e2e_s - o.final.ttft_s) for o in outs]
    return total / wall, statistics.mean(per_request)


async def _long_prompt(address: str, long_ids: list[int], cached: list[int]):
    """One fresh 2K-token prompt, max_tokens 1: its Final (prefill and push timings)."""
    from kvmesh.client import GatewayClient, make_request

    ids = [1000 + next(_ROUNDS) % 40000, *long_ids[1:]]  # a new first token: no prefix hit
    async with GatewayClient(address) as client:
        out = await client.complete(make_request(prompt_token_ids=ids, max_tokens=1), timeout_s=900)
    cached.append(out.final.cached_tokens)
    return out.final


async def _decode_steps(address: str) -> tuple[int, float]:
    """(steps, wall seconds in steps) a decode instance reports in GetStats."""
    import grpc

    from kvmesh.protos.v1 import common_pb2, decode_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stats = await decode_pb2_grpc.DecodeStub(channel).GetStats(common_pb2.StatsRequest(), timeout=10)
    return stats.num_steps, stats.step_seconds


def _peers(args, say) -> dict:
    """Each peer in its own process, before the mesh starts."""
    n, rounds = args.new_tokens, args.rounds
    say("transformers, in its own process ...")
    hf = peers.measure("transformers", n, rounds, LONG_PROMPT_TOKENS, list(BATCHES), args.model)
    out = {
        "hf_tokens_per_s": hf["tokens_per_s"],
        "hf_batch_tokens_per_s": hf["batch_tokens_per_s"],
        "hf_prefill_tokens_per_s": hf["prefill_tokens_per_s"],
        "llama_cpp_tokens_per_s": None,
        "llama_cpp_prefill_tokens_per_s": None,
        "engine_tokens_per_s": None,
    }
    if args.model is None:  # llama.cpp reads the default model's GGUF file; the engine peer runs Llama
        if importlib.util.find_spec("llama_cpp") is not None:
            say("llama.cpp, in its own process ...")
            cpp = peers.measure("llama_cpp", n, rounds, LONG_PROMPT_TOKENS, [], None)
            out["llama_cpp_tokens_per_s"] = cpp["tokens_per_s"]
            out["llama_cpp_prefill_tokens_per_s"] = cpp["prefill_tokens_per_s"]
        say("the engine alone, in its own process ...")
        out["engine_tokens_per_s"] = peers.measure("engine", n, rounds, LONG_PROMPT_TOKENS, [], None)["tokens_per_s"]
    return out


def run_bench(args) -> int:
    from kvmesh.client import GatewayClient, make_request
    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import resolve_model
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    n = args.new_tokens
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    precision = peers.mesh_precision(args.model)
    say(
        f"{n} new tokens a request, {args.rounds} rounds a level; the mesh computes in {precision.name} ({precision.reason})"
    )
    result: dict = {"dtype": precision.name, **_peers(args, say)}
    long_ids = peers.long_prompt_ids(load_tokenizer(resolve_model(args.model)), LONG_PROMPT_TOKENS)
    say("starting the mesh (1 prefill, 1 decode) ...")
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-bench-", suffix=".log") as log:
        mesh = start_mesh(1, 1, args.model, port=free_port(), log=log, env={"REDIS_URL": ""})
        try:

            async def measure() -> dict:
                ttfts: list[float] = []
                cached: list[int] = []
                async with GatewayClient(mesh.gateway_address) as client:  # warm-up
                    await client.complete(make_request("Hello", chat=True, max_tokens=8))
                steps0 = await _decode_steps(mesh.decode_addresses[0])
                bar = progress_bar(args.rounds * (2 + len(BATCHES)) + 1, "rounds", desc="mesh", quiet=args.json)

                def tick(x):
                    bar.update()
                    return x

                singles = [
                    tick((await _round(mesh.gateway_address, 1, n, ttfts, cached))[1]) for _ in range(args.rounds)
                ]
                steps1 = await _decode_steps(mesh.decode_addresses[0])
                batches = {
                    b: statistics.median(
                        [tick((await _round(mesh.gateway_address, b, n, ttfts, cached))[0]) for _ in range(args.rounds)]
                    )
                    for b in BATCHES
                }
                longs = [tick(await _long_prompt(mesh.gateway_address, long_ids, cached)) for _ in range(args.rounds)]
                short = tick(await _short_prompts(mesh.gateway_address, long_ids, ORCHESTRATION_REQUESTS))
                bar.close()
                q = statistics.quantiles(ttfts, n=10)
                return {
                    "single_tokens_per_s": statistics.median(singles),
                    # the single stream's mean decode step (forward + sampling, batch 1), as decode
                    # timed it: the rest of a token's time is hand-offs and gRPC hops
                    "single_step_s": (steps1[1] - steps0[1]) / max(1, steps1[0] - steps0[0]),
                    "batch_tokens_per_s": batches,
                    "c4_tokens_per_s": batches[4],
                    "c16_tokens_per_s": batches[16],
                    "ttft_p50_s": statistics.median(ttfts),
                    "ttft_p90_s": q[8],
                    "long_prompt_tokens": longs[0].prompt_tokens,
                    "prefill_tokens_per_s": statistics.median(f.prompt_tokens / f.prefill_s for f in longs),
                    "prefill_compute_s": statistics.median(f.prefill_s for f in longs),
                    "kv_push_s": statistics.median(f.kv_transfer.seconds for f in longs),
                    "kv_push_exposed_s": statistics.median(f.kv_transfer.exposed_seconds for f in longs),
                    "kv_push_bytes": longs[0].kv_transfer.nbytes,
                    "cached_prompt_tokens": sum(cached),
                    "orchestration_p50_s": statistics.median(short),
                    "orchestration_p90_s": statistics.quantiles(short, n=10)[8],
                    "orchestration_long_p50_s": statistics.median(orchestration_s(f) for f in longs),
                }

            result.update(asyncio.run(measure()))
        finally:
            mesh.stop()
    if args.json:
        print(json.dumps(result))
        return 0
    _print_table(result)
    return 0


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def _print_table(r: dict) -> None:
    hf, cpp, engine = r["hf_tokens_per_s"], r["llama_cpp_tokens_per_s"], r["engine_tokens_per_s"]
    print(f"\nthe engine and the mesh compute in {r['dtype']} (decode from the GGUF blocks, pages in that dtype)")
    print(f"{'decode (tok/s) [weights read]':<50}{'value':>9}{'vs transformers':>17}{'vs llama.cpp':>14}")

    def row(name: str, value: float | None, base_hf: float | None, base_cpp: float | None) -> None:
        text = "-" if value is None else f"{value:.1f}"
        print(f"{name:<50}{text:>9}{_ratio(value, base_hf):>17}{_ratio(value, base_cpp):>14}")

    row("transformers generate, single stream [fp32]", hf, hf, cpp)
    row("llama.cpp, single stream [Q4_1/Q8_0]", cpp, hf, cpp)
    row("engine alone, single stream [Q4_1/Q8_0]", engine, hf, cpp)
    row("kvmesh mesh, single stream [Q4_1/Q8_0]", r["single_tokens_per_s"], hf, cpp)
    for b in BATCHES:
        base = r["hf_batch_tokens_per_s"][b]
        row(f"transformers generate, batch of {b} [fp32]", base, base, None)
        row(f"kvmesh mesh, {b} concurrent, aggregate*", r["batch_tokens_per_s"][b], base, cpp)
    print(
        "* prefill included, over the round's wall time; 'vs transformers' is to its batched generate of the "
        "same size, 'vs llama.cpp' to its single stream (it has no batched decode)"
    )
    if engine:
        print(f"mesh single stream / engine alone: {r['single_tokens_per_s'] / engine:.2f}x")
    itl_ms, step_ms = 1000 / r["single_tokens_per_s"], r["single_step_s"] * 1000
    print(
        f"a single-stream token in the mesh: {itl_ms:.2f} ms = decode step {step_ms:.2f} ms (forward + "
        f"sampling, as decode timed it{f'; the engine alone {1000 / engine:.2f} ms a token' if engine else ''}) "
        f"+ {itl_ms - step_ms:.2f} ms outside the step (emit, decode's loop, gRPC to the gateway, its loop)"
    )
    if cpp is None:
        print("llama.cpp not installed: pip install ../shared/wheels/llama_cpp_python-*.whl for its figures")
    p, hfp, cppp = r["prefill_tokens_per_s"], r["hf_prefill_tokens_per_s"], r["llama_cpp_prefill_tokens_per_s"]
    print(f"\nprefill of a {r['long_prompt_tokens']}-token prompt (tok/s) [transformers fp32, kvmesh {r['dtype']}]")
    row("transformers forward", hfp, hfp, cppp)
    row("llama.cpp prompt evaluation", cppp, hfp, cppp)
    row("kvmesh prefill (chunked)", p, hfp, cppp)
    push, exposed = r["kv_push_s"], r["kv_push_exposed_s"]
    print(
        f"its KV push: {r['kv_push_bytes'] / 1e6:.1f} MB; prefill compute {r['prefill_compute_s'] * 1000:.0f} ms, "
        f"whole push {push * 1000:.1f} ms, exposed after the compute {exposed * 1000:.1f} ms "
        f"({exposed / push:.0%} of the push)"
        if push
        else "no KV push measured"
    )
    print(f"\n{'TTFT p50 / p90 (ms)':<50}{r['ttft_p50_s'] * 1000:>7.0f} / {r['ttft_p90_s'] * 1000:.0f}")
    print(
        f"{'orchestration p50 / p90 (ms), 32-token prompts':<50}{r['orchestration_p50_s'] * 1000:>7.1f} / "
        f"{r['orchestration_p90_s'] * 1000:.1f}; {r['long_prompt_tokens']}-token prompts: p50 "
        f"{r['orchestration_long_p50_s'] * 1000:.1f}   (TTFT less prefill queue, compute and the push left after it)"
    )
    print(f"prefix-cache hits over the run: {r['cached_prompt_tokens']} prompt tokens (fresh prompts each round)")
