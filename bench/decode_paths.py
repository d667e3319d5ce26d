"""Decode steps from the GGUF blocks (the fused step) against the dense GEMMs, in one run: where
`kvmesh.engine.llama.model.block_rows_bound` should switch from one to the other.

    python -P -m kvmesh.bench.decode_paths [--dtype bfloat16] [--batch 16 24 32 48 64]

Two LlamaRunners of the default model in --dtype, one with the GGUF blocks and one without
(every step dense: torch's GEMMs, on AMX tiles in bf16 where the CPU has them), each bound
taken away (every row count runs its own path); greedy decode tokens/s of each at each batch
(kvmesh.bench.engine.bench_runner: prefill untimed), interleaved, best of --repeats, and their
ratio.
"""

from __future__ import annotations

import argparse
import logging

import torch

from kvmesh.bench.engine import _prompts, bench_runner
from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    dtype = getattr(torch, args.dtype)
    files = resolve_model(None)
    prompts = _prompts(load_tokenizer(files), max(args.batch))
    pages = max(args.batch) * ((max(map(len, prompts)) + args.new_tokens) // 16 + 2)
    runners = {
        "blocks": LlamaRunner(files, num_pages=pages, dtype=dtype, gguf_blocks=True),
        "dense": LlamaRunner(files, num_pages=pages, dtype=dtype, gguf_blocks=False),
    }
    runners["blocks"].model.max_block_rows = max(args.batch)  # the blocks at every row count
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    print(f"{args.dtype}, {torch.get_num_threads()} threads, AMX tiles: {amx}")
    for r in runners.values():
        r.warmup()
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats):
        for b in args.batch:
            for name, r in runners.items():
                tps = bench_runner(r, prompts[:b], args.new_tokens)
                best[(name, b)] = max(tps, best.get((name, b), 0.0))
    print(f"{'sequences':>9} {'blocks tok/s':>13} {'dense tok/s':>12} {'dense / blocks':>15}")
    for b in args.batch:
        blocks, dense = best[("blocks", b)], best[("dense", b)]
        print(f"{b:>9} {blocks:>13.1f} {dense:>12.1f} {dense / blocks:>15.2f}")


if __name__ == "__main__":
    main()
