# V=vocab, H=hidden, B=sequences in a decode step
"""Where the time of one decode step of B sequences goes: in milliseconds a step and % of it.

    python -m kvmesh.bench.profile_decode [--model NAME_OR_PATH] [--steps 64] [--repeats 3] [--batch 1]
        [--quantization none|int8]

Runs LlamaRunner greedy decode (forward + `kvmesh.engine.sampler.sample`) of --batch sequences (the chat
prompt each, in pages of its own) after their prefills and times each part of the step with `time.perf_counter` around the model's
parts: the quantized (or fp32) matmuls grouped by projection (q/k/v, o, MLP gate/up, MLP down,
lm_head), attention over pages (K/V write and SDPA), RMSNorm, RoPE, SiLU*up, the step's setup
(positions, attention metadata), sampling, and the rest (embedding, residual adds, views and
the Python between them: the step's time less every timed part). A decode step of a model with
GGUF blocks (up to `QUANTIZED_MAX_BATCH` sequences) is one numba call
(`kvmesh.engine.llama.step.decode_step`), which counts its own parts' CPU cycles
(`LlamaModel.step_cycles`, converted here at the counter's measured rate); it applies SiLU*up
inside the gate/up matmul's tiles, so that row reads 0 and gate/up includes it. The timers are a profiling
hook: they replace the module-level functions `kvmesh.engine.llama.model` calls (`_mm`, `_lm_head`,
`rms_norm`, `apply_rotary`, `paged_attention`, `silu_and_mul`) for the profiled steps only and
put them back after, so the served hot path carries no timer. The step is also timed without
the hook, which shows what the timers themselves cost.

Also printed: the weight bytes one decode step reads (every matmul weight once, in the format
the step uses: GGUF blocks as packed for `kvmesh.kernels.quant`, or fp32; norms and one embedding row
included) and the GB/s that implies over the whole step and over the matmuls alone.
Of --repeats runs of --steps steps, the one with the fastest timed step is reported (and the
fastest untimed step), so background load distorts them least. Units: ms per step (B tokens), % of
the hooked step, bytes, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

import kvmesh.engine.llama.model as llama
import kvmesh.engine.llama.step as llama_step
from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.precision import QUANTIZATION_CHOICES, apply_quantization
from kvmesh.engine.sampler import sample
from kvmesh.engine.sampling_params import SamplingParams

MATMULS = ("matmul q/k/v", "matmul o", "matmul MLP gate/up", "matmul MLP down", "matmul lm_head")
PARTS = (
    *MATMULS,
    "attention over pages",
    "RMSNorm",
    "RoPE",
    "SiLU*up",
    "step setup (positions, metadata)",
    "sampling (greedy)",
)
SETUP, SAMPLING = PARTS[-2:]
_MODEL = "model forward"
REST = "rest (embedding, residual adds, Python)"


@dataclass(frozen=True)
class Profile:
    """Mean milliseconds per decode step (`batch` tokens) of each part (`PARTS`, then `REST`), the
    hooked step (`step_ms`), the step without the hook (`plain_step_ms`), and weight bytes read per step."""

    ms: dict[str, float]
    step_ms: float
    plain_step_ms: float
    weight_bytes: int
    batch: int = 1

    @property
    def matmul_ms(self) -> float:
        return sum(self.ms[k] for k in MATMULS)


def _nbytes(w: object) -> int:
    """Bytes of a weight as the step reads it: a tensor, or a packed GGUF weight's arrays."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(a.nbytes for a in vars(w).values() if isinstance(a, np.ndarray))


def weight_bytes_per_token(model: llama.LlamaModel, quantized: bool) -> int:
    """Weight bytes one batch-1 decode step reads: each matmul weight (its blocks when
    `quantized`, else fp32), the norms, and one embedding row (bytes)."""
    total = model.embed[0].numel() * model.embed.element_size() + _nbytes(model.norm)
    for w in model.layers:
        total += _nbytes(w.input_norm) + _nbytes(w.post_norm)
        for fp32, q in ((w.w_qkv, w.q_qkv), (w.w_o, w.q_o), (w.w_gate_up, w.q_gate_up), (w.w_down, w.q_down)):
            total += _nbytes(q if quantized and q is not None else fp32)
    head = model.q_lm_head if quantized and model.q_lm_head is not None else model.lm_head
    return total + _nbytes(head)


@contextmanager
def _hooked(model: llama.LlamaModel, ms: dict[str, float]) -> Iterator[None]:
    """Time the model's parts into ms (accumulated seconds, by part name) while inside."""
    groups: dict[int, str] = {}
    for w in model.layers:
        for name, ws in zip(
            MATMULS, ((w.w_qkv, w.q_qkv), (w.w_o, w.q_o), (w.w_gate_up, w.q_gate_up), (w.w_down, w.q_down))
        ):
            groups.update({id(x): name for x in ws if x is not None})

    def timed(name: str | None, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            key = name if name is not None else groups[id(args[2] if args[2] is not None else args[1])]
            ms[key] += time.perf_counter() - start
            return out

        return wrapper

    saved = {
        n: getattr(llama, n) for n in ("_mm", "_lm_head", "rms_norm", "apply_rotary", "paged_attention", "silu_and_mul")
    }
    patches = {
        "_mm": timed(None, saved["_mm"]),
        "_lm_head": timed("matmul lm_head", saved["_lm_head"]),
        "rms_norm": timed("RMSNorm", saved["rms_norm"]),
        "apply_rotary": timed("RoPE", saved["apply_rotary"]),
        "paged_attention": timed("attention over pages", saved["paged_attention"]),
        "silu_and_mul": timed("SiLU*up", saved["silu_and_mul"]),
    }
    for n, f in patches.items():
        setattr(llama, n, f)
    model.forward = timed(_MODEL, model.forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(llama, n, f)
        del model.forward


def pages_needed(prompt: list[int], steps: int, page_size: int, batch: int = 1) -> int:
    """Pages `profile` uses: each of `batch` sequences holds len(prompt) + steps tokens."""
    return batch * ((len(prompt) + steps + page_size) // page_size)


def _decode(runner: LlamaRunner, prompt: list[int], steps: int, batch: int, ms: dict[str, float] | None) -> float:
    """Prefill `prompt` for `batch` sequences (untimed), then `steps` greedy decode steps of all of
    them together; returns those steps' seconds.

    With `ms`, also accumulates the seconds of sampling and of the step's setup (the runner's
    forward less the model's) into it; the hook times the model's parts."""
    greedy, gens = [SamplingParams()] * batch, [None] * batch
    each = pages_needed(prompt, steps, runner.page_size)
    tables = [list(range(b * each, (b + 1) * each)) for b in range(batch)]
    toks = [sample(runner.forward([ForwardItem(prompt, 0, t)]), greedy[:1], gens[:1])[0] for t in tables]
    if ms is not None:
        ms.update(dict.fromkeys(ms, 0.0))  # the prefills went through the hook too
        runner.model.step_cycles[:] = 0
    n = len(prompt)
    total = 0.0
    for _ in range(steps):
        items = [ForwardItem([tok], n, t) for tok, t in zip(toks, tables)]
        start = time.perf_counter()
        if ms is None:
            toks = sample(runner.forward(items), greedy, gens)
        else:
            model_before = ms[_MODEL]
            logits = runner.forward(items)
            mid = time.perf_counter()
            ms[SETUP] += mid - start - (ms[_MODEL] - model_before)
            toks = sample(logits, greedy, gens)
            ms[SAMPLING] += time.perf_counter() - mid
        total += time.perf_counter() - start
        n += 1
    return total


def cycles_per_second(span_s: float = 0.05) -> float:
    """Rate of `kvmesh.engine.llama.step.read_cycles`, the counter the fused step's parts are timed in."""
    llama_step.read_cycles()  # compiled before timing
    c0, t0 = llama_step.read_cycles(), time.perf_counter()
    time.sleep(span_s)
    return (llama_step.read_cycles() - c0) / (time.perf_counter() - t0)


def profile(runner: LlamaRunner, prompt: list[int], steps: int = 64, repeats: int = 3, batch: int = 1) -> Profile:
    """Profile `steps` decode steps of `batch` sequences after `prompt`, `repeats` times; keep the
    fastest run.

    The runner needs `pages_needed(prompt, steps, page_size, batch)` pages. Returns ms per step of
    each part. Raises ValueError when steps, repeats or batch < 1.
    """
    if steps < 1 or repeats < 1 or batch < 1:
        raise ValueError(f"steps, repeats and batch must be >= 1, got {steps}, {repeats} and {batch}")
    model = runner.model
    hz = cycles_per_second()
    best: Profile | None = None
    fastest_plain = float("inf")
    for _ in range(repeats):
        plain = _decode(runner, prompt, steps, batch, None)
        sums = dict.fromkeys((*PARTS, _MODEL), 0.0)
        model.step_cycles = np.zeros(len(llama_step.STEP_PARTS), np.int64)
        with _hooked(model, sums):
            step = _decode(runner, prompt, steps, batch, sums)
        for name, cycles in zip(llama_step.STEP_PARTS, model.step_cycles):
            sums[name] += cycles / hz
        model.step_cycles = np.zeros(0, np.int64)
        del sums[_MODEL]
        ms = {k: v / steps * 1e3 for k, v in sums.items()}
        ms[REST] = step / steps * 1e3 - sum(ms.values())
        quantized = model.q_lm_head is not None and llama.QUANTIZED_MAX_BATCH >= batch
        run = Profile(ms, step / steps * 1e3, plain / steps * 1e3, weight_bytes_per_token(model, quantized), batch)
        if best is None or run.step_ms < best.step_ms:
            best = run
        fastest_plain = min(fastest_plain, run.plain_step_ms)
    assert best is not None
    return replace(best, plain_step_ms=fastest_plain)


def format_profile(p: Profile) -> str:
    """The profile as a table: part, ms per step, % of the hooked step."""
    lines = [f"{f'part of a decode step (B={p.batch})':<40}{'ms/step':>10}{'% step':>8}"]
    for name in (*PARTS, REST):
        lines.append(f"{name:<40}{p.ms[name]:>10.3f}{100 * p.ms[name] / p.step_ms:>7.1f}%")
    lines.append(f"{'  of which matmuls':<40}{p.matmul_ms:>10.3f}{100 * p.matmul_ms / p.step_ms:>7.1f}%")
    lines.append(f"{'step, timed parts':<40}{p.step_ms:>10.3f}{100.0:>7.1f}%")
    lines.append(f"{'step, no timers':<40}{p.plain_step_ms:>10.3f}  ({p.batch * 1e3 / p.plain_step_ms:.1f} tokens/s)")
    lines.append(
        f"weights read per step: {p.weight_bytes / 1e6:.1f} MB; "
        f"{p.weight_bytes / p.plain_step_ms / 1e6:.1f} GB/s over the step, "
        f"{p.weight_bytes / p.matmul_ms / 1e6:.1f} GB/s over the matmuls"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Profile the default model (or --model) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=64, help="decode tokens a run")
    ap.add_argument("--repeats", type=int, default=3, help="runs; the fastest is printed")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument(
        "--quantization", choices=QUANTIZATION_CHOICES, default="none", help="decode's --quantization (default none)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    files = resolve_model(args.model)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = load_tokenizer(files).apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    runner = LlamaRunner(files, num_pages=pages_needed(prompt, args.steps, 16, args.batch))
    apply_quantization(runner, args.quantization)
    runner.warmup()
    p = profile(runner, prompt, args.steps, args.repeats, args.batch)
    kind = "GGUF blocks" if runner.model.q_lm_head is not None else "fp32"
    print(
        f"model {files.name} [{kind}], {torch.get_num_threads()} torch threads, prompt {len(prompt)} tokens, "
        f"{args.batch} sequences, {args.steps} decode steps, fastest of {args.repeats} runs"
    )
    print(format_profile(p))


if __name__ == "__main__":
    main()
