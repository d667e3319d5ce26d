"""`kvmesh bench`: decode speed of the mesh next to transformers, in one run.

Measures on the default model (or --model), greedy, EOS ignored so every request decodes
exactly --new-tokens tokens:
- transformers `generate` single-stream decode tokens/s (time of N new tokens minus the
  time of 1, over N-1, so prefill is excluded), in this process, before the mesh starts;
- kvmesh single-stream decode tokens/s ((generated-1) / (e2e - TTFT) per request);
- kvmesh aggregate tokens/s with 4 and 16 concurrent requests (all tokens, prefill
  included, over the wall time of the round);
- TTFT p50 / p90 over every kvmesh request of the run;
- llama.cpp's single-stream decode tokens/s on the same GGUF file (greedy, 2 threads, EOS
  ignored, prefill excluded), in a process of its own before the mesh starts, when
  `llama_cpp` is importable (a wheel for this machine kind is in ../shared/wheels/; it is a
  benchmark peer, never a dependency).
Each level runs --rounds times and reports the median. transformers' rounds interleave with
kvmesh's single-stream rounds (the mesh idles meanwhile), so a shared machine's slow spells
skew both alike. Run it on an otherwise idle machine; it prints the ratios the README quotes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how rainbows form.",
    "Describe a busy market in the morning.",
    "Write about a journey across the mountains.",
]


def _hf_bench(model_name: str | None, new_tokens: int) -> Callable[[], float]:
    """Load transformers' model; return a function that measures one round of its decode tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import load_tokenizer
    from engine.loader import resolve_model

    files = resolve_model(model_name)
    tok = load_tokenizer(files)
    model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    timed(4)  # warm-up
    return lambda: (new_tokens - 1) / (timed(new_tokens) - timed(1))


_ROUNDS = iter(range(1, 1 << 30))


_LLAMA_CPP = """
import sys, time
from llama_cpp import Llama
path, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=2, n_ctx=1024, verbose=False)
prompt = llm.tokenize(
    b"<|im_start|>user\\nTell me a story about a lighthouse keeper.<|im_end|>\\n<|im_start|>assistant\\n",
    special=True,
)
def timed(k):
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        if i + 1 >= k:
            break
    return time.perf_counter() - start
timed(4)
runs = sorted((n - 1) / (timed(n) - timed(1)) for _ in range(rounds))
print(runs[len(runs) // 2])
"""


def _llama_cpp_tokens_per_s(new_tokens: int, rounds: int) -> float | None:
    """llama.cpp's greedy single-stream decode tokens/s on the default model's GGUF file, in a
    process of its own (median of `rounds`); None when llama_cpp is not installed."""
    import importlib.util
    import subprocess

    from engine.loader import default_gguf_path

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    out = subprocess.run(
        [sys.executable, "-c", _LLAMA_CPP, str(default_gguf_path()), str(new_tokens), str(rounds)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(out.stdout.strip().splitlines()[-1])


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


def run_bench(args) -> int:
    from kvmesh.client import GatewayClient, make_request
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    n = args.new_tokens
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    say(f"loading transformers' model; {n} new tokens a request ...")
    hf_round = _hf_bench(args.model, n)
    llama_cpp = None
    if args.model is None:  # llama.cpp reads the default model's GGUF file
        say("llama.cpp single stream, in its own process ...")
        llama_cpp = _llama_cpp_tokens_per_s(n, args.rounds)
    say("starting the mesh (1 prefill, 1 decode) ...")
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-bench-", suffix=".log") as log:
        mesh = start_mesh(1, 1, args.model, port=free_port(), log=log, env={"REDIS_URL": ""})
        try:

            async def measure() -> dict[str, float]:
                ttfts: list[float] = []
                cached: list[int] = []
                async with GatewayClient(mesh.gateway_address) as client:  # warm-up
                    await client.complete(make_request("Hello", chat=True, max_tokens=8))
                # each level runs `rounds` times; the median damps a shared machine's hiccups
                hfs, singles = [], []
                for _ in range(args.rounds):  # interleaved, one of each at a time
                    hfs.append(hf_round())
                    singles.append((await _round(mesh.gateway_address, 1, n, ttfts, cached))[1])
                c4 = [(await _round(mesh.gateway_address, 4, n, ttfts, cached))[0] for _ in range(args.rounds)]
                c16 = [(await _round(mesh.gateway_address, 16, n, ttfts, cached))[0] for _ in range(args.rounds)]
                q = statistics.quantiles(ttfts, n=10)
                return {
                    "hf_tokens_per_s": statistics.median(hfs),
                    "single_tokens_per_s": statistics.median(singles),
                    "c4_tokens_per_s": statistics.median(c4),
                    "c16_tokens_per_s": statistics.median(c16),
                    "ttft_p50_s": statistics.median(ttfts),
                    "ttft_p90_s": q[8],
                    "cached_prompt_tokens": sum(cached),
                }

            result = asyncio.run(measure())
        finally:
            mesh.stop()
    result["llama_cpp_tokens_per_s"] = llama_cpp
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{'measure':<42}{'value':>12}{'vs transformers':>18}")
    rows = [
        ("transformers generate, single stream (tok/s)", result["hf_tokens_per_s"]),
        ("kvmesh single stream decode (tok/s)", result["single_tokens_per_s"]),
        ("kvmesh 4 concurrent, aggregate (tok/s)", result["c4_tokens_per_s"]),
        ("kvmesh 16 concurrent, aggregate (tok/s)", result["c16_tokens_per_s"]),
    ]
    for name, value in rows:
        print(f"{name:<42}{value:>12.1f}{value / result['hf_tokens_per_s']:>17.2f}x")
    if llama_cpp is not None:
        print(
            f"{'llama.cpp single stream (tok/s)':<42}{llama_cpp:>12.1f}"
            f"{llama_cpp / result['hf_tokens_per_s']:>17.2f}x   kvmesh single stream / llama.cpp: "
            f"{result['single_tokens_per_s'] / llama_cpp:.2f}x, 16 concurrent / llama.cpp: "
            f"{result['c16_tokens_per_s'] / llama_cpp:.2f}x"
        )
    else:
        print("llama.cpp not installed: pip install ../shared/wheels/llama_cpp_python-*.whl for its column")
    print(f"{'TTFT p50 / p90 (ms)':<42}{result['ttft_p50_s'] * 1000:>7.0f} / {result['ttft_p90_s'] * 1000:.0f}")
    print(f"prefix-cache hits over the run: {result['cached_prompt_tokens']} prompt tokens (fresh prompts each round)")
    return 0
