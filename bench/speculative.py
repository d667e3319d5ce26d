"""`kvmesh bench --speculative`: single-stream decode with and without speculation, in one run, on
prompts that quote their input and on prompts that do not.

Meshes in turn (1 prefill, 1 decode): without speculation, with `--speculative ngram
--num-draft-tokens K`, and, for a DeepSeek-V4 checkpoint that carries an MTP module
(`--model PATH`, e.g. one `kvmesh make-tiny-model` wrote), with `--speculative mtp`; the same
greedy requests on each (so the same tokens: speculation does not change greedy output), EOS
ignored so each decodes --new-tokens tokens. Per prompt kind:
decode tokens/s ((generated - 1) / (e2e - TTFT), median over the prompts and --rounds), the
ratio, and the acceptance the traffic gave (kept drafts / drafted, and tokens per step:
generated tokens over decode steps, from decode's GetStats). Every prompt is new each round
(a round tag leads it), so prefill is never a cache hit.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile

QUOTING = [
    "Repeat the following text exactly, word for word: The lighthouse keeper climbed the spiral stairs "
    "every evening, lit the great lamp, and watched the ships pass safely through the narrow channel.",
    "Rewrite this Python function with the variable `total` renamed to `acc`, changing nothing else:\n"
    "def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total\n",
    "Copy this list back to me in the same order: apples, pears, plums, cherries, grapes, lemons, limes, "
    "oranges, peaches, mangoes.",
]
PLAIN = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how rainbows form.",
    "Describe a busy market in the morning.",
]


async def _single(address: str, decode: str, prompts: list[str], tag: int, n: int) -> dict:
    from kvmesh.bench.mesh import _decode_steps
    from kvmesh.client import GatewayClient, make_request

    speeds, drafted, accepted, generated = [], 0, 0, 0
    steps0 = await _decode_steps(decode)
    async with GatewayClient(address) as client:
        for i, prompt in enumerate(prompts):
            req = make_request(f"[{tag}.{i}] {prompt}", chat=True, max_tokens=n, ignore_eos=True)
            f = (await client.complete(req, timeout_s=600)).final
            speeds.append((f.generated_tokens - 1) / (f.e2e_s - f.ttft_s))
            drafted, accepted, generated = (
                drafted + f.drafted_tokens,
                accepted + f.accepted_tokens,
                generated + f.generated_tokens - 1,
            )
    steps1 = await _decode_steps(decode)
    return {
        "speeds": speeds,
        "drafted": drafted,
        "accepted": accepted,
        "generated": generated,
        "steps": steps1[0] - steps0[0],
    }


def _has_mtp(model: str | None) -> bool:
    """Whether the model is a DeepSeek-V4 checkpoint with a multi-token-prediction module."""
    from kvmesh.engine.checkpoint import architecture, checkpoint_tensor_names
    from kvmesh.engine.loader import resolve_model

    files = resolve_model(model)
    if architecture(files) != "DeepseekV4ForCausalLM":
        return False
    from kvmesh.engine.deepseek_v4.weights import has_mtp

    return has_mtp([name for _, name in checkpoint_tensor_names(files.checkpoint_dir)])


def _measure(method: str, args, say) -> dict:
    from kvmesh.client import GatewayClient, make_request
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    decode_args = (
        None if method == "off" else ["--speculative", method, "--num-draft-tokens", str(args.num_draft_tokens)]
    )
    say(f"starting a mesh ({'no speculation' if method == 'off' else method + ' speculation'}) ...")
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-bench-spec-", suffix=".log") as log:
        mesh = start_mesh(
            1, 1, args.model, port=free_port(), log=log, env={"REDIS_URL": ""}, extra_decode_args=decode_args
        )
        try:

            async def run() -> dict:
                async with GatewayClient(mesh.gateway_address) as client:  # warm-up
                    await client.complete(make_request("Hello", chat=True, max_tokens=8))
                out: dict = {}
                for kind, prompts in (("quoting", QUOTING), ("plain", PLAIN)):
                    runs = [
                        await _single(mesh.gateway_address, mesh.decode_addresses[0], prompts, r, args.new_tokens)
                        for r in range(args.rounds)
                    ]
                    out[kind] = {
                        "tokens_per_s": statistics.median(s for run in runs for s in run["speeds"]),
                        "drafted": sum(r["drafted"] for r in runs),
                        "accepted": sum(r["accepted"] for r in runs),
                        "tokens_per_step": sum(r["generated"] for r in runs) / max(1, sum(r["steps"] for r in runs)),
                    }
                return out

            return asyncio.run(run())
        finally:
            mesh.stop()


def run_speculative_bench(args) -> int:
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    methods = ["ngram", "mtp"] if _has_mtp(args.model) else ["ngram"]
    off = _measure("off", args, say)
    result: dict = {"num_draft_tokens": args.num_draft_tokens, "off": off, "ngram": None, "mtp": None}
    for method in methods:
        result[method] = _measure(method, args, say)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"\nsingle-stream decode, {args.new_tokens} tokens a request, greedy, drafts of up to {args.num_draft_tokens}"
    )
    print(
        f"{'prompts':<10}{'drafts':<8}{'off tok/s':>11}{'on tok/s':>10}{'ratio':>8}{'kept/drafted':>15}{'tokens/step':>13}"
    )
    for kind in ("quoting", "plain"):
        for method in methods:
            a, b = off[kind], result[method][kind]
            kept = f"{b['accepted']}/{b['drafted']}" if b["drafted"] else "0/0"
            print(
                f"{kind:<10}{method:<8}{a['tokens_per_s']:>11.1f}{b['tokens_per_s']:>10.1f}"
                f"{b['tokens_per_s'] / a['tokens_per_s']:>7.2f}x{kept:>15}{b['tokens_per_step']:>13.2f}"
            )
    if "mtp" not in methods:
        print(
            "(no mtp row: the model carries no multi-token-prediction module; --model a DeepSeek-V4 checkpoint with one)"
        )
    return 0
