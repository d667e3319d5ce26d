"""Decode speed of LlamaRunner against transformers' generate and llama.cpp, side by side in one run.

    python -m kvmesh.bench.engine [--model NAME_OR_PATH] [--new-tokens 64] [--batch 4 16]

Prints greedy single-stream decode tokens/s of transformers `generate`, of llama.cpp
(llama-cpp-python on the same GGUF file and prompt tokens, as many threads as torch, in a
process of its own; when llama_cpp is installed and the model came from a GGUF file) and of
LlamaRunner, then LlamaRunner's batched decode tokens/s at each batch size, each as a ratio to
transformers and to llama.cpp. Decode time excludes prefill: each run times only the steps
after the first token. Runs are interleaved and the best of --repeats is kept, so background
load skews all contenders alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import default_gguf_path, resolve_model
from kvmesh.engine.sampler import sample
from kvmesh.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis briefly.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What does a compiler do?",
    "Name a famous painter.",
]


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)] + " " * (i // 8)}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def bench_transformers(model, prompt: list[int], new_tokens: int) -> float:
    """Greedy decode tokens/s of transformers generate, prefill excluded: n / (t(1+n) - t(1))."""
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return time.perf_counter() - start

    return new_tokens / (timed(1 + new_tokens) - timed(1))


def bench_runner(runner: LlamaRunner, prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy batched decode tokens/s of LlamaRunner (forward + sample), prefill excluded."""
    S = runner.page_size
    greedy = [SamplingParams()] * len(prompts)
    gens = [None] * len(prompts)
    pages_each = (max(map(len, prompts)) + new_tokens + S) // S
    tables = [list(range(b * pages_each, (b + 1) * pages_each)) for b in range(len(prompts))]
    last = [
        sample(runner.forward([ForwardItem(p, 0, t)]), greedy[:1], gens[:1])[0] for p, t in zip(prompts, tables)
    ]  # prefill one by one, untimed
    lens = [len(p) for p in prompts]
    start = time.perf_counter()
    for _ in range(new_tokens):
        items = [ForwardItem([tok], n, t) for tok, n, t in zip(last, lens, tables)]
        last = sample(runner.forward(items), greedy, gens)
        lens = [n + 1 for n in lens]
    return len(prompts) * new_tokens / (time.perf_counter() - start)


# a llama.cpp process that decodes on request: one line "N" in, greedy decode tokens/s of N out
_LLAMA_CPP = """
import sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=1024, verbose=False)
prompt = [int(t) for t in sys.argv[3].split(",")]
def timed(k):
    start = time.perf_counter()
    for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        if i + 1 >= k:
            break
    return time.perf_counter() - start
timed(4)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    print(n / (timed(1 + n) - timed(1)), flush=True)
"""


class LlamaCpp:
    """llama.cpp's greedy single-stream decode on a GGUF file, in a process of its own, timed as
    `bench_transformers` times generate: n / (t(1+n) - t(1)) tokens/s."""

    def __init__(self, gguf: Path, prompt: list[int], threads: int) -> None:
        cmd = [sys.executable, "-c", _LLAMA_CPP, str(gguf), str(threads), ",".join(map(str, prompt))]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "ready", "llama.cpp failed"

    def tokens_per_s(self, new_tokens: int) -> float:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{new_tokens}\n")
        self._proc.stdin.flush()
        return float(self._proc.stdout.readline())

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default SmolLM2-135M-Instruct)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    files = resolve_model(args.model)
    tokenizer = load_tokenizer(files)
    prompts = _prompts(tokenizer, max(args.batch + [1]))
    print(
        f"model {files.name}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
        f"prompt {len(prompts[0])} tokens; activations fp32"
    )
    hf_model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32)
    hf_model.eval()
    pages = max(args.batch + [1]) * ((max(map(len, prompts)) + args.new_tokens) // 16 + 2)
    runner = LlamaRunner(files, num_pages=pages)
    runner.warmup()
    # decode steps of up to max_block_rows sequences read the GGUF file's Q4_1 / Q8_0 blocks
    # (when the model came from a GGUF file); transformers reads the fp32 conversion
    ours = "GGUF blocks" if runner.model.q_lm_head is not None else "fp32"
    llama_cpp = None
    if importlib.util.find_spec("llama_cpp") is not None and args.model is None:
        llama_cpp = LlamaCpp(default_gguf_path(), prompts[0], torch.get_num_threads())
    bench_transformers(hf_model, prompts[0], 4)  # warm up
    # interleave the contenders, best of each: load from other processes hits both alike
    hf_key = "transformers generate, B=1 [fp32]"
    cpp_key = "llama.cpp, B=1 [GGUF blocks]"
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        runs = {hf_key: bench_transformers(hf_model, prompts[0], args.new_tokens)}
        if llama_cpp is not None:
            runs[cpp_key] = llama_cpp.tokens_per_s(args.new_tokens)
        for b in [1] + args.batch:
            fmt = ours if b <= runner.model.max_block_rows else "fp32"
            runs[f"LlamaRunner, B={b} [{fmt}]"] = bench_runner(runner, prompts[:b], args.new_tokens)
        best = {k: max(v, best.get(k, 0.0)) for k, v in runs.items()}
    if llama_cpp is not None:
        llama_cpp.close()
    hf, cpp = best[hf_key], best.get(cpp_key)
    print(f"{'decode [weights read]':<40}{'tokens/s':>10}{'x transformers':>16}{'x llama.cpp':>13}")
    for name, tps in best.items():
        print(f"{name:<40}{tps:>10.1f}{tps / hf:>16.2f}{tps / cpp if cpp else float('nan'):>13.2f}")


if __name__ == "__main__":
    main()
