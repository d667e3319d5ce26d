# T=tokens
"""Prefill speed of LlamaRunner against transformers' forward on the same prompt, in one run.

    python -m kvmesh.bench.prefill [--model NAME_OR_PATH] [--prompt-tokens 2048] [--chunk 512]
        [--repeats 5]

Prints tokens/s of three contenders over the same T-token prompt (`long_prompt_ids`, the text
`kvmesh.bench.peers` uses), each as a ratio to transformers:
- transformers: one fp32 `model(input_ids=...)` forward computing every position's logits, as
  `kvmesh.bench.peers` measures its `prefill_tokens_per_s`;
- LlamaRunner, the whole prompt in one forward (logits of the last token only);
- LlamaRunner in chunks the way the prefill service schedules them with
  `--chunked-prefill-size` (`chunk_ends`: whole-page chunks, the last at most a quarter of
  one; 2048 tokens at 512 are 512, 512, 512, 384, 128), each chunk a forward after the cached
  prefix the earlier ones left in the pages.
Runs are interleaved, one of each contender per repeat, and the best and the median of
--repeats are reported, so background load on a shared machine skews all contenders alike.
Units: tokens per second, seconds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from kvmesh.engine.checkpoint import load_tokenizer, long_prompt_ids
from kvmesh.engine.forward import ForwardItem, chunk_ends
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model

logger = logging.getLogger(__name__)


def runner_prefill(runner: LlamaRunner, ids: list[int], ends: list[int]) -> float:
    """Seconds to prefill `ids` into pages 0.. as forwards ending at each of `ends`."""
    S = runner.page_size
    pages = list(range((len(ids) + S - 1) // S))
    start = time.perf_counter()
    done = 0
    for end in ends:
        runner.forward([ForwardItem(ids[done:end], done, pages)])
        done = end
    return time.perf_counter() - start


def transformers_forward(model, ids: list[int]) -> float:
    """Seconds of one transformers forward over `ids`, every position's logits."""
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=x)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: the default model)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512, help="the prefill service's --chunked-prefill-size")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    files = resolve_model(args.model)
    ids = long_prompt_ids(load_tokenizer(files), args.prompt_tokens)
    hf = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    runner = LlamaRunner(files, num_pages=(len(ids) + 15) // 16 + 1)
    runner.warmup()
    ends = chunk_ends(0, len(ids), args.chunk, runner.page_size)
    contenders: dict[str, Callable[[], float]] = {
        "transformers forward, all logits": lambda: transformers_forward(hf, ids),
        "LlamaRunner, one chunk": lambda: runner_prefill(runner, ids, [len(ids)]),
        f"LlamaRunner, chunks {[b - a for a, b in zip([0, *ends], ends)]}": lambda: runner_prefill(runner, ids, ends),
    }
    for run in contenders.values():  # warm-up: first-call allocations and kernel choices
        run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, run in contenders.items():
            times[name].append(run())
    base = len(ids) / min(next(iter(times.values())))
    print(f"{len(ids)}-token prefill, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats")
    print(f"{'':<48}{'best tok/s':>12}{'median tok/s':>14}{'best ratio':>12}")
    for name, ts in times.items():
        best, median = len(ids) / min(ts), len(ids) / statistics.median(ts)
        print(f"{name:<48}{best:>12.1f}{median:>14.1f}{best / base:>11.2f}x")


if __name__ == "__main__":
    main()
