# T=rows (tokens), K=input features, N=output features, B=sequences, V=vocab, n=prompt tokens
"""fp32 against bf16 for the Llama runner (SmolLM2-135M-Instruct by default) on the CPU, one run.

    python -P -m kvmesh.bench.precision [--model NAME] [--repeats 3] [--kernel-repeats 10] [--steps 10] [--json PATH]

Each row is one measure, fp32 beside bf16, and `speedup` = how many times faster bf16 is
(fp32 time / bf16 time, or bf16 GFLOP/s / fp32 GFLOP/s). Timings are the wall clock with
PyTorch's threads, best of --repeats (GEMM, attention: --kernel-repeats) after a warm-up;
fp32 and bf16 alternate in every repeat so a noisy neighbour hits both alike.
- prefill N: one prompt of N tokens (`long_prompt_ids`) through `LlamaRunner.forward`, seconds.
- decode BxN: one step of B one-token sequences, each after N cached tokens, ms (fastest of
  --steps); the fused numba step computes in fp32 either way, reading/writing pages of the dtype.
- gemm NAME: [T, K] @ [K, N] of one of prefill's matmuls, GFLOP/s; fp32 `x @ w` (MKL) against
  bf16 `x @ w` (what prefill runs). The library table after it adds fp32 oneDNN prepacked
  (`kvmesh.kernels.dense`), bf16 `F.linear` on w [N, K], bf16 `mkldnn_linear` on a prepacked
  MKL-DNN weight (layout conversions included) and bf16 `mkldnn._linear_pointwise` on a weight
  reordered for T rows, and names the fastest.
- attention n: prefill's causal flash kernel, q [1, 9, n, 64], k/v [1, 3, n, 64] strided views
  of a [n, 15*64] projection as the model passes them (GQA inside the kernel, no expand), ms.
- logprobs: 16 chat prompts, 64 greedy tokens each from the fp32 runner; prompt + answer is then
  prefilled (`forward_all`) by both runners, and the answer tokens' fp32 log_softmax compared:
  max and p99 |logprob_bf16 - logprob_fp32|, the teacher-forced argmax agreement per position and
  per whole answer, and how many of bf16's own free-running greedy answers equal fp32's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvmesh.engine.checkpoint import load_tokenizer, long_prompt_ids
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model
from kvmesh.kernels.dense import dense_matmul, onednn_weight

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PAGE = 16
SHAPES = {"q/k/v": (576, 960), "o": (576, 576), "gate/up": (576, 3072), "down": (1536, 576)}
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give three tips for writing clear emails.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "def quicksort(xs):\n    # complete this function\n",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a linked list in C?",
    "List the planets of the solar system in order.",
    "Write a haiku about autumn rain.",
    "What does the SQL statement SELECT COUNT(*) FROM users WHERE age > 30 do?",
    "Why do cats purr?",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "What is the difference between a list and a tuple in Python?",
    "Describe photosynthesis to a ten-year-old.",
]


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of fn's fastest call of `repeats`, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _pages(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // PAGE)))


def bench_prefill(runners: dict[str, LlamaRunner], ids: list[int], repeats: int) -> dict[str, float]:
    """Seconds of one prefill of `ids` (pages from 1) per dtype, best of repeats, interleaved."""
    item = [ForwardItem(ids, 0, _pages(1, len(ids)))]
    best = {}
    for name, r in runners.items():
        r.forward(item)  # warm-up
        best[name] = float("inf")
    for _ in range(repeats):
        for name, r in runners.items():
            start = time.perf_counter()
            r.forward(item)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_decode(runners: dict[str, LlamaRunner], ids: list[int], batch: int, steps: int) -> dict[str, float]:
    """Fastest ms of a decode step of `batch` sequences, each with ids' K/V cached (ids prefilled
    once, its pages copied to every sequence); step i decodes position len(ids) + i."""
    n, per = len(ids), len(_pages(0, len(ids) + steps + 3))
    tables = [_pages(1 + b * per, n + steps + 3) for b in range(batch)]
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in runners.values():
        r.forward([ForwardItem(ids, 0, tables[0])])
        for table in tables[1:]:
            for src, dst in zip(tables[0], table, strict=True):
                r.page_buffer(dst)[:] = r.page_buffer(src)
    for i in range(steps + 3):  # three warm-up steps
        items = [ForwardItem([ids[i % n]], n + i, t) for t in tables]
        for name, r in runners.items():
            start = time.perf_counter()
            r.forward(items)
            if i >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: min(t) for name, t in times.items()}


def _gemm_contenders(k: int, n: int, rows: int) -> dict[str, Callable[[], object]]:
    """[rows, k] @ [k, n] by each library and dtype; every entry returns [rows, n]."""
    x, w = torch.randn(rows, k), torch.randn(k, n) / k**0.5
    dnn = onednn_weight(w)
    dnn = w.t().contiguous().to_mkldnn() if dnn is None else dnn  # oneDNN even where MKL is preferred
    xb, wb = x.bfloat16(), w.bfloat16()
    w_nk = wb.t().contiguous()
    mk = w_nk.to_mkldnn()
    packed = torch.ops.mkldnn._reorder_linear_weight(w_nk, rows)
    return {
        "fp32 x@w": lambda: x @ w,
        "fp32 oneDNN": lambda: dense_matmul(x, w, dnn),
        "bf16 x@w": lambda: xb @ wb,
        "bf16 F.linear": lambda: F.linear(xb, w_nk),
        "bf16 mkldnn_linear": lambda: torch._C._nn.mkldnn_linear(xb.to_mkldnn(), mk, None).to_dense(),
        "bf16 linear_pointwise": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
    }


def bench_gemm(rows: int, repeats: int) -> dict[str, dict[str, float]]:
    """GFLOP/s per shape name and contender (see `_gemm_contenders`)."""
    out = {}
    for name, (k, n) in SHAPES.items():
        fns = _gemm_contenders(k, n, rows)
        ref = fns["bf16 x@w"]().float()
        for label, fn in fns.items():  # every bf16 path must give bf16 x@w's numbers
            got = fn()
            assert label.startswith("fp32") or got.dtype == torch.bfloat16, label
            assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max(), label
        best = {label: float("inf") for label in fns}
        for _ in range(repeats):
            for label, fn in fns.items():
                best[label] = min(best[label], _best(fn, 1))
        out[name] = {label: 2.0 * rows * k * n / t / 1e9 for label, t in best.items()}
    return out


def bench_attention(n: int, repeats: int) -> dict[str, float]:
    """ms of `_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)` per dtype, the
    model's GQA views; checks it equals SDPA over k/v repeated to 9 heads (fp32)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qkv32 = torch.randn(n, 15, 64)  # [n, Q+2K, D]
    views = {}
    for name, dtype in DTYPES.items():
        qkv = qkv32.to(dtype)
        q, k, v = (t.transpose(0, 1)[None] for t in (qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]))
        views[name] = (q, k, v)
    q, k, v = views["fp32"]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert (flash(q, k, v, 0.0, True)[0] - ref).abs().max() < 1e-4, "flash kernel GQA mismatch"
    best = {name: float("inf") for name in views}
    for _ in range(repeats):
        for name, (q, k, v) in views.items():
            best[name] = min(best[name], _best(lambda q=q, k=k, v=v: flash(q, k, v, 0.0, True), 1))
    return {name: t * 1e3 for name, t in best.items()}


def _greedy(r: LlamaRunner, prompts: list[list[int]], new: int) -> list[list[int]]:
    """`new` greedy tokens per prompt (all prompts one batch; EOS not special), sequence b in
    pages from 1 + b * 16."""
    tables = [_pages(1 + b * 16, len(p) + new) for b, p in enumerate(prompts)]
    logits = r.forward([ForwardItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    out: list[list[int]] = [[] for _ in prompts]
    for i in range(new):
        for seq, tok in zip(out, logits.argmax(-1).tolist(), strict=True):
            seq.append(tok)
        if i + 1 < new:
            items = [ForwardItem([s[-1]], len(p) + i, t) for p, s, t in zip(prompts, out, tables, strict=True)]
            logits = r.forward(items)
    return out


def chat_prompt_ids(tokenizer) -> list[list[int]]:
    """PROMPTS as one-turn chats, each with its generation prompt, as token ids."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def bench_logprobs(runners: dict[str, LlamaRunner], tokenizer, new: int) -> dict[str, float]:
    """bf16 against fp32 on the answers of fp32's greedy decode, teacher-forced (see module doc)."""
    prompts = chat_prompt_ids(tokenizer)
    answers = _greedy(runners["fp32"], prompts, new)
    diffs, agree, whole = [], 0, 0
    for p, a in zip(prompts, answers, strict=True):
        seq, rows = p + a, slice(len(p) - 1, len(p) + len(a) - 1)  # rows predicting the answer
        chosen = torch.tensor(a)[:, None]
        lp, top = {}, {}
        for name, r in runners.items():
            logits = r.forward_all([ForwardItem(seq, 0, _pages(1, len(seq)))])[rows]  # [new, V] fp32
            lp[name] = torch.log_softmax(logits.float(), -1).gather(1, chosen)[:, 0]
            top[name] = logits.argmax(-1)
        diffs.append((lp["bf16"] - lp["fp32"]).abs())
        same = top["bf16"] == top["fp32"]
        agree, whole = agree + int(same.sum()), whole + bool(same.all())
    return logprob_summary(diffs, agree, whole, answers, _greedy(runners["bf16"], prompts, new))


def logprob_summary(
    diffs: list[torch.Tensor], agree: int, whole: int, answers: list[list[int]], free: list[list[int]]
) -> dict[str, float]:
    """The figures of a teacher-forced comparison: diffs, each answer's |logprob difference| per
    token; agree, the positions whose argmax agreed; whole, the answers that agreed throughout;
    answers and free, the reference's and the other side's own greedy answers."""
    d = torch.cat(diffs)
    return {
        "max |dlogprob|": d.max().item(),
        "p99 |dlogprob|": d.quantile(0.99).item(),
        "mean |dlogprob|": d.mean().item(),
        "teacher-forced argmax agree per position": agree / d.numel(),
        "teacher-forced answers agreeing throughout": whole,
        "free-running greedy answers identical": sum(x == y for x, y in zip(answers, free, strict=True)),
        "sequences": len(answers),
        "tokens compared": d.numel(),
    }


def _row(label: str, fp32: float, bf16: float, unit: str, faster_is_higher: bool = False) -> dict:
    speedup = bf16 / fp32 if faster_is_higher else fp32 / bf16
    print(f"{label:<28}{fp32:>12.3f}{bf16:>12.3f}{speedup:>9.2f}x  {unit}")
    return {"measure": label, "fp32": fp32, "bf16": bf16, "speedup": speedup, "unit": unit}


def _print_gemm_table(gemm: dict[str, dict[str, float]], rows: int) -> None:
    labels = list(next(iter(gemm.values())))
    print(f"\nGEMM GFLOP/s by library, [{rows}, K] @ [K, N]")
    print(f"{'matmul':<9}" + "".join(f"{label:>23}" for label in labels) + "   fastest bf16")
    for name, g in gemm.items():
        fastest = max((label for label in labels if label.startswith("bf16")), key=g.__getitem__)
        ratio = g[fastest] / g["bf16 x@w"]
        print(f"{name:<9}" + "".join(f"{g[label]:>23.1f}" for label in labels) + f"   {fastest} ({ratio:.2f}x x@w)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefill repeats")
    ap.add_argument("--kernel-repeats", type=int, default=10, help="timed repeats of GEMM and attention")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps (fastest)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per logprob prompt")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    files = resolve_model(args.model)
    tokenizer = load_tokenizer(files)
    runners = {name: LlamaRunner(files, 16 * 40 + 1, PAGE, dtype=dt) for name, dt in DTYPES.items()}
    for r in runners.values():
        r.warmup()
    print(f"fp32 vs bf16, {torch.get_num_threads()} threads, torch {torch.__version__}; speedup = bf16 vs fp32")
    print(f"{'measure':<28}{'fp32':>12}{'bf16':>12}{'speedup':>10}  unit")
    rows = []
    for n in (512, 2048):
        t = bench_prefill(runners, long_prompt_ids(tokenizer, n), args.repeats)
        rows.append(_row(f"prefill {n}", t["fp32"], t["bf16"], "s"))
    ctx = long_prompt_ids(tokenizer, 512)
    for b in (1, 4, 16):
        t = bench_decode(runners, ctx, b, args.steps)
        rows.append(_row(f"decode {b}x512", t["fp32"], t["bf16"], "ms/step"))
    gemm = bench_gemm(2048, args.kernel_repeats)
    for name, g in gemm.items():
        rows.append(_row(f"gemm {name} (x @ w)", g["fp32 x@w"], g["bf16 x@w"], "GFLOP/s", True))
    t = bench_attention(2048, args.kernel_repeats)
    rows.append(_row("attention 2048", t["fp32"], t["bf16"], "ms"))
    _print_gemm_table(gemm, 2048)
    lp = bench_logprobs(runners, tokenizer, args.new_tokens)
    print("\nbf16 against fp32 logprobs (answer tokens of fp32's greedy decode, teacher-forced)")
    for key, value in lp.items():
        print(f"{key:<44}{value:>12.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "gemm_gflops": gemm, "logprobs": lp}, f, indent=2)


if __name__ == "__main__":
    main()
