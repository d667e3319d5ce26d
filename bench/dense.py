# T=rows (tokens), K=input features, N=output features
"""fp32 GEMM speed of prefill's shapes through each library PyTorch or numpy can reach, in one run.

    python -m kvmesh.bench.dense [--rows 2048] [--threads 1] [--repeats 20]

For SmolLM2-135M's four matmuls of a layer ([T, 576] @ [576, 960] q/k/v, [576, 576] o,
[576, 3072] gate/up, [1536, 576] down) prints GFLOP/s of `x @ w` (PyTorch's BLAS, MKL in the
x86 wheels), of `kvmesh.kernels.dense.dense_matmul` (oneDNN, layout conversions included) and of
numpy's `@` (OpenBLAS in numpy's wheels), and each as a ratio to `x @ w`. PyTorch's two: CPU time
of the calling thread (`time.thread_time`), best of --repeats, so other processes on the machine
distort it least; use --threads 1 for that reason (with more threads it times the wall clock).
numpy's: the wall clock, since OpenBLAS computes on threads of its own, as many as the cores
unless OPENBLAS_NUM_THREADS says (the header prints it: run with OPENBLAS_NUM_THREADS=1 for a
one-thread column; the thread clock once credited it with 1.8x MKL here on two threads).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from kvmesh.kernels.dense import dense_matmul

SHAPES = {"q/k/v": (576, 960), "o": (576, 576), "gate/up": (576, 3072), "down": (1536, 576)}


def _gflops(fn: Callable[[], object], flops: float, repeats: int, clock: Callable[[], float]) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return flops / best / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(
        f"fp32 GEMM GFLOP/s, {args.rows} rows, {args.threads} thread(s), best of {args.repeats}; numpy's "
        f"OpenBLAS threads: OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset: all cores)')}"
    )
    print(f"{'matmul':<10}{'x @ w':>10}{'oneDNN':>10}{'ratio':>8}{'numpy':>10}{'ratio':>8}")
    for name, (k, n) in SHAPES.items():
        x, w = torch.randn(args.rows, k), torch.randn(k, n)
        dnn = w.t().contiguous().to_mkldnn()  # whichever library prefill picks here
        xn, wn = x.numpy(), w.numpy()
        flops = 2.0 * args.rows * k * n
        base = _gflops(lambda: x @ w, flops, args.repeats, clock)
        one = _gflops(lambda: dense_matmul(x, w, dnn), flops, args.repeats, clock)
        blas = _gflops(lambda: xn @ wn, flops, args.repeats, time.perf_counter)
        print(f"{name:<10}{base:>10.1f}{one:>10.1f}{one / base:>7.2f}x{blas:>10.1f}{blas / base:>7.2f}x")


if __name__ == "__main__":
    main()
