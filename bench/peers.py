"""The peers `kvmesh bench` compares the mesh with, each measured in a process of its own while
no mesh runs (an idle mesh's OpenMP threads must not slow a peer, nor a peer the mesh):

    python -m kvmesh.bench.peers transformers|llama_cpp|engine --new-tokens N --rounds R
        [--prompt-tokens P] [--batch 4 16] [--model M]

prints one JSON object of medians over R rounds:
- transformers (fp32 weights, `generate`, greedy): `tokens_per_s` single-stream decode,
  `batch_tokens_per_s` {B: aggregate decode tokens/s of B prompts in one batched `generate`},
  both prefill excluded (time of N new tokens minus the time of 1); `prefill_tokens_per_s`,
  one forward over a P-token prompt.
- llama_cpp (llama-cpp-python on the default model's GGUF file, 2 threads, greedy):
  `tokens_per_s` single-stream decode, prefill excluded; `prefill_tokens_per_s`, its prompt
  evaluation of the same P tokens. It has no batched decode of several sequences, so no
  `batch_tokens_per_s`.
- engine (kvmesh's LlamaRunner alone in the mesh's dtype, GGUF blocks at batch 1, no services): `tokens_per_s`.

Decode prompts are the bench's first prompt in the chat template; the P-token prompt is the
same text for every peer (`long_prompt_ids`). Every figure is tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from kvmesh.engine.checkpoint import long_prompt_ids

if TYPE_CHECKING:
    from kvmesh.engine.precision import Precision

PROMPT = "Tell me a story about a lighthouse keeper."


def _median(runs: list[float]) -> float:
    return statistics.median(runs)


def _transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import resolve_model

    files = resolve_model(args.model)
    tok = load_tokenizer(files)
    model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    prompt = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    n = args.new_tokens

    def timed(batch: int, k: int) -> float:
        ids = torch.tensor([prompt] * batch)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False
            )
        return time.perf_counter() - start

    def decode(batch: int) -> float:
        return batch * (n - 1) / (timed(batch, n) - timed(batch, 1))

    long_ids = torch.tensor([long_prompt_ids(tok, args.prompt_tokens)])

    def forward() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=long_ids)
        return args.prompt_tokens / (time.perf_counter() - start)

    timed(1, 4)  # warm-up
    forward()
    return {
        "tokens_per_s": _median([decode(1) for _ in range(args.rounds)]),
        "batch_tokens_per_s": {b: _median([decode(b) for _ in range(args.rounds)]) for b in args.batch},
        "prefill_tokens_per_s": _median([forward() for _ in range(args.rounds)]),
    }


def _llama_cpp(args) -> dict:
    from llama_cpp import Llama

    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import default_gguf_path, resolve_model

    llm = Llama(model_path=str(default_gguf_path()), n_threads=2, n_ctx=args.prompt_tokens + 64, verbose=False)
    prompt = llm.tokenize(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n".encode(), special=True)
    long_ids = long_prompt_ids(load_tokenizer(resolve_model(None)), args.prompt_tokens)
    n = args.new_tokens

    def timed(k: int) -> float:
        start = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 >= k:
                break
        return time.perf_counter() - start

    def prompt_eval() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(long_ids)
        return len(long_ids) / (time.perf_counter() - start)

    timed(4)
    prompt_eval()
    return {
        "tokens_per_s": _median([(n - 1) / (timed(n) - timed(1)) for _ in range(args.rounds)]),
        "prefill_tokens_per_s": _median([prompt_eval() for _ in range(args.rounds)]),
    }


def mesh_precision(model: str | None) -> Precision:
    """What the mesh a bench starts computes in on this CPU: `KVMESH_DTYPE` (which its services
    read), else auto."""
    import torch

    from kvmesh.engine.loader import resolve_model
    from kvmesh.engine.runners import runner_precision

    return runner_precision(resolve_model(model), torch.device("cpu"), os.environ.get("KVMESH_DTYPE") or "auto")


def _engine(args) -> dict:
    from kvmesh.bench.engine import _prompts, bench_runner
    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.llama.runner import LlamaRunner
    from kvmesh.engine.loader import resolve_model

    files = resolve_model(args.model)
    prompts = _prompts(load_tokenizer(files), 1)
    dtype = mesh_precision(args.model).dtype  # the mesh's, so that the two rows compare like for like
    runner = LlamaRunner(files, num_pages=(len(prompts[0]) + args.new_tokens) // 16 + 2, dtype=dtype)
    runner.warmup()
    bench_runner(runner, prompts, 4)
    return {"tokens_per_s": _median([bench_runner(runner, prompts, args.new_tokens) for _ in range(args.rounds)])}


PEERS = {"transformers": _transformers, "llama_cpp": _llama_cpp, "engine": _engine}


def measure(peer: str, new_tokens: int, rounds: int, prompt_tokens: int, batch: list[int], model: str | None) -> dict:
    """Run `peer` in a process of its own and return its figures (see the module docstring).

    Raises subprocess.CalledProcessError (with the peer's stderr) when it fails.
    """
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "kvmesh.bench.peers",
        peer,
        "--new-tokens",
        str(new_tokens),
        "--rounds",
        str(rounds),
    ]
    cmd += ["--prompt-tokens", str(prompt_tokens), "--batch", *map(str, batch)]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise subprocess.CalledProcessError(out.returncode, cmd, out.stdout, out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "batch_tokens_per_s" in result:
        result["batch_tokens_per_s"] = {int(b): v for b, v in result["batch_tokens_per_s"].items()}
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", choices=sorted(PEERS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    print(json.dumps(PEERS[args.peer](args)))


if __name__ == "__main__":
    main()
