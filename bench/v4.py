"""`kvmesh bench-v4`: DeepSeek-V4 on a tiny config, the mesh next to transformers, in one run.

Makes the tiny checkpoint of `kvmesh make-tiny-model --arch deepseek_v4` in a temporary folder
(or takes --model DIR) and prints, greedy, EOS ignored:
- transformers `generate` single-stream decode tokens/s (t(N) - t(1) over N - 1 tokens) and
  transformers' prefill tokens/s for one --prefill-tokens prompt (one forward);
- kvmesh aggregate decode tokens/s with --concurrency requests at once (tokens generated after
  each one's first token, over the time from the last first token to the last token), and
  kvmesh prefill tokens/s for the same long prompt (computed tokens over the prefill service's
  compute time, which the gateway reports as Final.prefill_s);
- the ratios, against targets 3x (decode) and 1x (prefill).
transformers' rounds interleave with kvmesh's, each level runs --rounds times, the median counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

WORDS = "the lighthouse keeper walked along the cliff and counted every ship in the channel".split()


def _text(n_words: int, salt: int) -> str:
    return f"{salt} " + " ".join(WORDS[(i + salt) % len(WORDS)] for i in range(n_words))


def run_bench_v4(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    from kvmesh.bench.tiny_models import make_tiny_model
    from kvmesh.client import GatewayClient, make_request
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    with tempfile.TemporaryDirectory(prefix="kvmesh-v4-") as tmp:
        model_dir = args.model or str(make_tiny_model("deepseek_v4", tmp))
        tok = AutoTokenizer.from_pretrained(model_dir)
        hf = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        n = args.new_tokens
        short = torch.tensor([tok.encode(_text(30, 0), add_special_tokens=False)])
        long_text = _text(args.prefill_tokens, 1)
        long_ids = tok.encode(long_text, add_special_tokens=False)
        while len(long_ids) > args.prefill_tokens:  # trim words until the prompt fits exactly-ish
            long_text = long_text.rsplit(" ", 1)[0]
            long_ids = tok.encode(long_text, add_special_tokens=False)

        def hf_decode() -> float:
            def timed(k: int) -> float:
                start = time.perf_counter()
                with torch.inference_mode():
                    hf.generate(short, max_new_tokens=k, min_new_tokens=k, do_sample=False)
                return time.perf_counter() - start

            return (n - 1) / (timed(n) - timed(1))

        def hf_prefill() -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                hf(torch.tensor([long_ids]), logits_to_keep=1)
            return len(long_ids) / (time.perf_counter() - start)

        hf_decode(), hf_prefill()  # warm-up
        say(f"starting the mesh on {model_dir} ...")
        with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
            mesh = start_mesh(1, 1, model_dir, port=free_port(), log=log, env={"REDIS_URL": ""})
            try:

                async def mesh_decode(round_: int) -> float:
                    """Aggregate decode tokens/s while every request decodes: tokens that arrive
                    (client clock) between the last request's first token and the first request's
                    end, over that interval; the tokens and the time are the same interval's."""
                    arrivals: list[list[float]] = [[] for _ in range(args.concurrency)]

                    async def one(client: GatewayClient, i: int) -> None:
                        req = make_request(
                            _text(10 + 23 * i, 100 * round_ + i), chat=False, max_tokens=n, ignore_eos=True
                        )
                        async for msg in client.stream(req, timeout_s=600):
                            if msg.HasField("delta"):
                                arrivals[i].extend([time.perf_counter()] * len(msg.delta.token_ids))

                    async with GatewayClient(mesh.gateway_address) as client:
                        await asyncio.gather(*[one(client, i) for i in range(args.concurrency)])
                    start = max(a[0] for a in arrivals)  # from here on every request is decoding
                    end = min(a[-1] for a in arrivals)  # ... until the first one ends
                    tokens = sum(1 for a in arrivals for t in a if start < t <= end)
                    return tokens / (end - start)

                async def mesh_prefill(round_: int) -> float:
                    async with GatewayClient(mesh.gateway_address) as client:
                        # a new first word each round: no prefix-cache hit
                        out = await client.complete(
                            make_request(f"{round_} {long_text}", chat=False, max_tokens=1), timeout_s=600
                        )
                    f = out.final
                    return (f.prompt_tokens - f.cached_tokens) / f.prefill_s

                async def measure() -> dict:
                    await mesh_decode(99)
                    await mesh_prefill(99)  # warm-up
                    rows: dict[str, list[float]] = {"hf_decode": [], "c_decode": [], "hf_prefill": [], "prefill": []}
                    for r in range(args.rounds):
                        rows["hf_decode"].append(hf_decode())
                        rows["c_decode"].append(await mesh_decode(r))
                        rows["hf_prefill"].append(hf_prefill())
                        rows["prefill"].append(await mesh_prefill(r))
                    return {k: statistics.median(v) for k, v in rows.items()}

                m = asyncio.run(measure())
            finally:
                mesh.stop()
    result = {
        "hf_decode_tokens_per_s": m["hf_decode"],
        f"c{args.concurrency}_decode_tokens_per_s": m["c_decode"],
        "decode_ratio": m["c_decode"] / m["hf_decode"],
        "hf_prefill_tokens_per_s": m["hf_prefill"],
        "prefill_tokens_per_s": m["prefill"],
        "prefill_ratio": m["prefill"] / m["hf_prefill"],
        "prefill_prompt_tokens": len(long_ids),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{'DeepSeek-V4 tiny config':<48}{'tok/s':>10}{'vs transformers':>18}")
    print(f"{'transformers generate, single stream decode':<48}{m['hf_decode']:>10.1f}{1:>17.2f}x")
    print(
        f"{f'kvmesh {args.concurrency} concurrent, aggregate decode':<48}{m['c_decode']:>10.1f}"
        f"{result['decode_ratio']:>17.2f}x   (target 3x)"
    )
    print(f"{f'transformers prefill, {len(long_ids)}-token prompt':<48}{m['hf_prefill']:>10.1f}{1:>17.2f}x")
    print(
        f"{f'kvmesh prefill, {len(long_ids)}-token prompt':<48}{m['prefill']:>10.1f}"
        f"{result['prefill_ratio']:>17.2f}x   (target 1x)"
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a DeepSeek-V4 checkpoint folder (default: make the tiny one)")
    p.add_argument("--concurrency", type=int, default=8, help="requests decoding at once (default 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each request decodes (default 64)")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="length of the prefill prompt (default 2048)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per measure; the median counts (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
