"""`kvmesh bench --fields`: what the per-token API fields cost, side by side on one mesh.

A live mesh (1 prefill, 1 decode, the default model). Each round has a fresh random prompt of
--fields-prompt tokens, and runs, one after the other:

- n choices: one request with n = 4 against 4 requests of n = 1 sent together (choice i of the
  first is the i-th of the others: seed + i). Printed: prompt tokens prefill computed, KV bytes
  pushed, wall seconds, and the ratios (the n = 4 request prefills and pushes once);
- per-token fields on one stream: plain decoding, with logprobs (top 5), and under a regex
  grammar (structured output's masks), each --new-tokens tokens (ignore_eos): inter-token
  latency (Final.itl_s) and the ratio to plain.

Medians over --rounds. Everything over real gRPC to the gateway, as a client sees it.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

import numpy as np

N = 4
REGEX = "[a-z ]{1,4000}"
"""A grammar that never completes within the answer: every token is masked, none ends it."""


async def _run(client, requests) -> tuple[list, float]:
    started = time.perf_counter()
    outs = await asyncio.gather(*[client.complete(r, timeout_s=600) for r in requests])
    return outs, time.perf_counter() - started


def run_fields_bench(args) -> int:
    from kvmesh.client import GatewayClient, make_request
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    rng = np.random.default_rng(11)
    tokens, new = args.fields_prompt, args.new_tokens
    print(f"fields: prompts of {tokens} tokens, {new} new tokens, {args.rounds} rounds ...", flush=True)
    shared, separate, streams = [], [], {"plain": [], "logprobs=5": [], "regex grammar": []}
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-fields-", suffix=".log") as log:
        mesh = start_mesh(1, 1, args.model, port=free_port(), log=log, env={"REDIS_URL": ""})
        try:

            async def measure():
                async with GatewayClient(mesh.gateway_address) as client:
                    warm = make_request(b"", prompt_token_ids=rng.integers(1000, 40000, 32).tolist(), max_tokens=4)
                    await client.complete(warm, timeout_s=600)
                    for k in range(args.rounds):
                        ids = rng.integers(1000, 40000, tokens).tolist()
                        common = dict(prompt_token_ids=ids, max_tokens=new, temperature=1.0, ignore_eos=True)
                        one = make_request(b"", n=N, seed=100 * k, **common)
                        shared.append(await _run(client, [one]))
                        ids2 = rng.integers(1000, 40000, tokens).tolist()  # fresh: no cache hit from above
                        each = [make_request(b"", seed=100 * k + i, **{**common, "prompt_token_ids": ids2})
                                for i in range(N)]  # fmt: skip
                        separate.append(await _run(client, each))
                        for name, extra in (
                            ("plain", {}),
                            ("logprobs=5", {"logprobs": 5}),
                            ("regex grammar", {"grammar": ("regex", REGEX)}),
                        ):
                            request = make_request(
                                b"", prompt_token_ids=rng.integers(1000, 40000, 64).tolist(), max_tokens=new,
                                ignore_eos=True, **extra,
                            )  # fmt: skip
                            out = await client.complete(request, timeout_s=600)
                            streams[name].append(out.final.itl_s)

            asyncio.run(measure())
        finally:
            mesh.stop()

    def figures(runs) -> tuple[float, float, float]:
        computed = [sum(o.final.prompt_tokens - o.final.cached_tokens for o in outs) for outs, _ in runs]
        pushed = [sum(o.final.kv_transfer.nbytes for o in outs) for outs, _ in runs]
        return statistics.median(computed), statistics.median(pushed), statistics.median(w for _, w in runs)

    one, four = figures(shared), figures(separate)
    print(f"\n{N} choices of one prompt ({tokens} tokens, {new} new each)")
    print(f"{'':>22}{'prefill tokens':>16}{'KV MB pushed':>14}{'wall s':>9}")
    print(f"{f'n={N}, one request':>22}{one[0]:>16.0f}{one[1] / 1e6:>14.2f}{one[2]:>9.2f}")
    print(f"{f'{N} requests, n=1':>22}{four[0]:>16.0f}{four[1] / 1e6:>14.2f}{four[2]:>9.2f}")
    ratios = [one[i] / four[i] if four[i] else 0.0 for i in range(3)]
    print(f"{'ratio':>22}{ratios[0]:>15.2f}x{ratios[1]:>13.2f}x{ratios[2]:>8.2f}x")
    plain = statistics.median(streams["plain"])
    print(f"\none stream, {new} tokens: inter-token latency")
    for name, itls in streams.items():
        itl = statistics.median(itls)
        print(f"{name:>22}{itl * 1000:>10.2f} ms{itl / plain:>8.2f}x")
    return 0
