# B=sequences, V=vocab
"""`--quantization int8` against none for the Llama runner's decode steps (SmolLM2-135M-Instruct
by default) on the CPU, side by side in one run.

    python -P -m kvmesh.bench.quantization [--model NAME] [--dtype float32] [--repeats 3] [--steps 10]
        [--batches 1 4 16 32 64] [--json PATH]

- W4A8 instructions: layer 0's four matmuls (q/k/v, o, gate/up, down) through the W4A8 tiles at
  1-2048 rows, microseconds a layer (best of --repeats x 5, numba's threads), the integer sums on
  `vpmaddubsw` over pairs and on `vpdpbusd` over quads (kernels/quant_a8.py; plain IR where the
  CPU lacks AVX-512 VNNI, so that column then measures no instruction), alternating, and
  whether both gave the same bits (they must).

- prefill N: one prompt of N tokens (`long_prompt_ids`) through `LlamaRunner.forward`, seconds,
  best of --repeats, the two runners alternating (`kvmesh.bench.precision.bench_prefill`).
- decode BxN: one fused decode step of B one-token sequences, each after N = 512 cached tokens,
  ms, fastest of --steps after three warm-up steps; the two runners alternate step by step so a
  noisy neighbour hits both alike (`kvmesh.bench.precision.bench_decode`). Both keep --dtype's
  pages, attention and lm_head; only the layers' matmuls differ (W4A8 against --dtype's
  activations, kernels/quant_a8.py; none's prefill runs through oneDNN, decode's from the same
  Q4_1 blocks).
- logprobs: 16 chat prompts, --new-tokens greedy tokens each from the none runner (--dtype's), then
  both runners fed the same prompt (each its own prefill) and the same answer tokens one decode
  step at a time (teacher-forced): max, p99 and mean |logprob_int8 - logprob_none| of the answer
  tokens, the argmax agreement per position and per whole answer, and how many of int8's own
  free-running greedy answers equal none's.
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np
import torch

from kvmesh.bench.precision import (
    PAGE,
    _greedy,
    _pages,
    bench_decode,
    bench_prefill,
    chat_prompt_ids,
    logprob_summary,
)
from kvmesh.engine.checkpoint import load_tokenizer, long_prompt_ids
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.precision import resolve_dtype
from kvmesh.kernels.quant_a8 import A8_QUADS, make_q4_1_tile_a8, quantize_rows_q8


def _runners(model: str | None, max_batch: int, dtype: torch.dtype) -> dict[str, LlamaRunner]:
    files = resolve_model(model)
    pages = 1 + max(max_batch * len(_pages(0, 512 + 32)), 16 * 16, 2048 // PAGE)  # decode's, the prompts', prefill's
    runners = {name: LlamaRunner(files, pages, PAGE, dtype=dtype) for name in ("none", "int8")}
    for r in runners.values():
        r.warmup()
    runners["int8"].use_int8_activations()
    return runners


def _teacher_forced(r: LlamaRunner, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the logits [len(answer), V] of each answer token, fed one decode step at a time."""
    tables = [_pages(1 + b * 16, len(p) + len(a)) for b, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    rows = [[r.forward([ForwardItem(p, 0, t)])[0]] for p, t in zip(prompts, tables, strict=True)]
    for i in range(len(answers[0]) - 1):
        items = [ForwardItem([a[i]], len(p) + i, t) for p, a, t in zip(prompts, answers, tables, strict=True)]
        for seq, logits in zip(rows, r.forward(items), strict=True):
            seq.append(logits)
    return [torch.stack(seq) for seq in rows]


def bench_logprobs(runners: dict[str, LlamaRunner], tokenizer, new: int) -> dict[str, float]:
    """int8 against none (both in the runners' dtype) on the answers of none's greedy decode, teacher-forced (see module doc)."""
    prompts = chat_prompt_ids(tokenizer)
    answers = _greedy(runners["none"], prompts, new)
    forced = {name: _teacher_forced(r, prompts, answers) for name, r in runners.items()}
    diffs, agree, whole = [], 0, 0
    for b, a in enumerate(answers):
        chosen = torch.tensor(a)[:, None]
        lp = {name: torch.log_softmax(f[b], -1).gather(1, chosen)[:, 0] for name, f in forced.items()}
        diffs.append((lp["int8"] - lp["none"]).abs())
        same = forced["int8"][b].argmax(-1) == forced["none"][b].argmax(-1)
        agree, whole = agree + int(same.sum()), whole + bool(same.all())
    return logprob_summary(diffs, agree, whole, answers, _greedy(runners["int8"], prompts, new))


def _tiled(tile):
    """A matmul over every tile of a Q4_1 weight on numba's threads with `tile` (one of
    `make_q4_1_tile_a8`'s), as kernels/quant.py runs the host's."""

    @numba.njit(nogil=True, boundscheck=False, parallel=True)
    def matmul(xq, xd, xsum, qs, d, m, out):
        for t in numba.prange(qs.shape[0]):
            tile(xq, xd, xsum, qs, d, m, t, out)

    return matmul


def bench_a8_instructions(runner: LlamaRunner, rows: list[int], repeats: int) -> list[dict]:
    """Microseconds of layer 0's four W4A8 matmuls at each count of `rows`, pairs on `vpmaddubsw`
    against quads on `vpdpbusd` (see module doc), and whether their outputs are equal."""
    layer = runner.model.layers[0]
    weights = [getattr(layer, n) for n in ("q_qkv", "q_o", "q_gate_up", "q_down")]
    paths = {"vpmaddubsw": _tiled(make_q4_1_tile_a8(False)), "vpdpbusd": _tiled(make_q4_1_tile_a8(True))}
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in rows:
        inputs = [quantize_rows_q8(torch.randn(n, w.in_features, generator=gen).numpy()) for w in weights]
        outs = {p: [np.empty((n, w.qs.shape[0] * w.qs.shape[2]), np.float32) for w in weights] for p in paths}
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(repeats * 5 + 1):  # the first of each compiles and warms
            for p, matmul in paths.items():
                start = time.perf_counter()
                for w, x, o in zip(weights, inputs, outs[p], strict=True):
                    matmul(*x, w.qs, w.d, w.m, o)
                best[p] = min(best[p], time.perf_counter() - start)
        same = all(np.array_equal(a, b) for a, b in zip(*outs.values(), strict=True))
        out.append({"rows": n, **{p: best[p] * 1e6 for p in paths}, "same bits": same})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", help="both runners' --dtype (auto, float32 or bfloat16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefill repeats")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps (fastest)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64], help="decode batch sizes")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per logprob prompt")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.steps > 16 or max(args.batches) > 64:
        ap.error("--steps is at most 16 (the pages each sequence gets); --batches at most 64 (QUANTIZED_MAX_BATCH)")
    dtype = resolve_dtype(args.dtype, torch.device("cpu")).dtype
    runners = _runners(args.model, max(args.batches), dtype)
    tokenizer = load_tokenizer(resolve_model(args.model))
    host = "vpdpbusd" if A8_QUADS else "vpmaddubsw"
    print(f"W4A8 tiles, layer 0's four matmuls, us (this CPU's int8 tiles run on {host})")
    print(f"{'rows':<20}{'vpmaddubsw':>12}{'vpdpbusd':>12}{'speedup':>10}  same bits")
    instructions = bench_a8_instructions(runners["int8"], [1, 4, 16, 64, 256, 2048], args.repeats)
    for r in instructions:
        speedup = r["vpmaddubsw"] / r["vpdpbusd"]
        print(f"{r['rows']:<20}{r['vpmaddubsw']:>12.1f}{r['vpdpbusd']:>12.1f}{speedup:>9.2f}x  {r['same bits']}")
    print(f"\n--quantization none vs int8 ({dtype} pages), torch {torch.__version__}")
    print(f"{'measure':<20}{'none':>12}{'int8':>12}{'speedup':>10}  unit")
    rows = []
    for n in (135, 512, 2048):
        t = bench_prefill(runners, long_prompt_ids(tokenizer, n), args.repeats)
        rows.append({"measure": f"prefill {n}", "none": t["none"], "int8": t["int8"], "unit": "s"})
        print(f"{rows[-1]['measure']:<20}{t['none']:>12.3f}{t['int8']:>12.3f}{t['none'] / t['int8']:>9.2f}x  s")
    ctx = long_prompt_ids(tokenizer, 512)
    for b in args.batches:
        t = bench_decode(runners, ctx, b, args.steps)
        rows.append({"measure": f"decode {b}x512", "none": t["none"], "int8": t["int8"], "unit": "ms/step"})
        print(f"{rows[-1]['measure']:<20}{t['none']:>12.3f}{t['int8']:>12.3f}{t['none'] / t['int8']:>9.2f}x  ms/step")
    lp = bench_logprobs(runners, tokenizer, args.new_tokens)
    print(
        f"\nint8 against none logprobs, {dtype} (answer tokens of none's greedy decode, teacher-forced through decode steps)"
    )
    for key, value in lp.items():
        print(f"{key:<44}{value:>12.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "logprobs": lp, "instructions": instructions}, f, indent=2)


if __name__ == "__main__":
    main()
