# M=rows (tokens in a step), K=input features, N=output features
"""Speed of the GGUF block kernels (`kvmesh.kernels.quant`) against torch's fp32 GEMM, side by side.

    python -m kvmesh.bench.quant [--rows 1 2 4 6 8] [--layers 30]

For SmolLM2-135M's decoder shapes (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576, over --layers distinct weights so they stream from memory as in a real step) and
its Q8_0 lm_head (576->49152), prints milliseconds per model step of each path and the ratio,
for each row count. `kvmesh.engine.llama.model.QUANTIZED_MAX_BATCH` is set from where the ratio
crosses 1. Random blocks: speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvmesh.kernels.quant import pack_q4_1, pack_q8_0, quantized_matmul
from kvmesh.kernels.ref import dequantize_q4_1_ref, dequantize_q8_0_ref

_LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N)
_LM_HEAD = (576, 49152)


def _q4_1(rng: np.random.Generator, k: int, n: int):
    qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
    m = (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
    w = dequantize_q4_1_ref(*map(torch.from_numpy, (qs, d, m)))  # [N, K]
    return pack_q4_1(qs, d, m), w.T.contiguous()  # fp32 input-major, as the model keeps it


def _q8_0(rng: np.random.Generator, k: int, n: int):
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
    return pack_q8_0(q, d), dequantize_q8_0_ref(torch.from_numpy(q), torch.from_numpy(d))  # [N, K]


def _ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    layers = [[_q4_1(rng, k, n) for k, n in _LAYER_SHAPES] for _ in range(args.layers)]
    head_q, head_w = _q8_0(rng, *_LM_HEAD)
    print(
        f"{'rows':>4}  {'fp32 layers ms':>14}  {'Q4_1 layers ms':>14}  {'ratio':>6}  "
        f"{'fp32 lm_head ms':>15}  {'Q8_0 lm_head ms':>15}  {'ratio':>6}"
    )
    for rows in args.rows:
        xs = [torch.randn(rows, k) for k, _ in _LAYER_SHAPES]
        h = torch.randn(rows, _LM_HEAD[0])
        fp32 = _ms(lambda: [x @ w for layer in layers for x, (_, w) in zip(xs, layer)], args.repeats)
        quant = _ms(lambda: [quantized_matmul(x, q) for layer in layers for x, (q, _) in zip(xs, layer)], args.repeats)
        head32 = _ms(lambda: torch.nn.functional.linear(h, head_w), args.repeats)
        head8 = _ms(lambda: quantized_matmul(h, head_q), args.repeats)
        print(
            f"{rows:>4}  {fp32:>14.1f}  {quant:>14.1f}  {fp32 / quant:>5.2f}x  "
            f"{head32:>15.2f}  {head8:>15.2f}  {head32 / head8:>5.2f}x"
        )


if __name__ == "__main__":
    main()
