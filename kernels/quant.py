# M=rows of activations (tokens), K=input features, N=output features, G=K/32 blocks of a row,
# NT=N/TN tiles of TN output features
"""Matmul straight from GGUF's Q4_1 and Q8_0 blocks, for decode on CPU: `quantized_matmul`.

Decode at batch 1 reads every weight once per token and does two flops with it, so it runs
at memory speed: fp32 weights cost 4 bytes each, a Q4_1 weight 0.75 (4 bits plus its block's
scale and min, widened to fp32 here), a Q8_0 weight 1.125. These kernels read the blocks as
the GGUF file stores them and never build an fp32 copy. llama.cpp's ggml-cpu reads blocks
too but also rounds the activations to 8-bit blocks; here they stay fp32.

The weights they compute with are the file's exactly: Q4_1 holds w = d*q + m for each block
of 32 inputs (q in 0..15, d and m fp16), Q8_0 holds w = d*q (q in -128..127). Per block they
sum x*q first and scale once: sum_k x_k w_k = d * sum_k x_k q_k + m * sum_k x_k.
That rounds differently from an fp32 GEMM over transformers' dequantized weights, by about
as much as two GEMM libraries differ from each other (`kvmesh.kernels.ref.quantized_matmul_ref` is
the reference the tests hold it to).

One kernel family in four files whose paths must stay bit-identical to each other:
- `kvmesh.kernels.quant_format`: the blocks' types and their tile-major layout (`pack_q4_1`, `pack_q8_0`);
- `kvmesh.kernels.quant_llvm`: the 512-bit vector choice, `prefetch`, `_fma` and `_block_rows`, the
  LLVM intrinsics every path shares;
- `kvmesh.kernels.quant_tiles`: the numba tiles (`q4_1_tile`, `q8_0_tile`, `block_sums`);
- here: the loops that split tiles across numba's threads and release the GIL, and the torch entry point.
An edit to one path must be checked against its twins (tests/unit/test_quant_kernels.py does).

The fused decode step (`kvmesh.engine.llama.step`) compiles these tiles into its own cached
code, and numba's cache index checks only the timestamp of the file a kernel is in, so it would
keep running old tiles after an edit here. `kvmesh.kernels.numba_cache` names the cache folder by
the sha256 of all these files (NUMBA_SOURCES and NUMBA_INLINED), so an edit starts a fresh one;
with NUMBA_CACHE_DIR set, numba's own locator decides, and that cache must be cleared by hand
(a fresh clone has no cache).
"""

from __future__ import annotations

import numba
import torch

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant_a8 import q4_1_tile_a8, quantize_rows_q8
from kvmesh.kernels.quant_format import QK, TN, Q4_1Weight, Q8_0Weight, pack_q4_1, pack_q8_0
from kvmesh.kernels.quant_llvm import BLOCK_ROWS, PASS_LANES, PREFETCH_LINES, prefetch
from kvmesh.kernels.quant_tiles import block_sums, q4_1_tile, q8_0_tile

__all__ = [
    "BLOCK_ROWS",
    "PASS_LANES",
    "PREFETCH_LINES",
    "QK",
    "TN",
    "Q4_1Weight",
    "Q8_0Weight",
    "block_sums",
    "kernel_threads",
    "pack_q4_1",
    "pack_q8_0",
    "prefetch",
    "q4_1_tile",
    "q8_0_tile",
    "quantized_matmul",
]


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q4_1_matmul(x, qs, d, m, out):  # x [M, K] f32, qs [NT, K/2, TN] u8, out [M, NT*TN] f32
    xsum = block_sums(x)
    for t in numba.prange(qs.shape[0]):
        q4_1_tile(x, xsum, qs, d, m, t, out)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q4_1_matmul_a8(x, qs, d, m, out):  # the same with x's rows as int8 blocks (kvmesh.kernels.quant_a8)
    xq, xd, xsum = quantize_rows_q8(x)
    for t in numba.prange(qs.shape[0]):
        q4_1_tile_a8(xq, xd, xsum, qs, d, m, t, out)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q8_0_matmul(x, q, d, out):  # x [M, K] f32, q [NT, K, TN] i8, out [M, NT*TN] f32
    for t in numba.prange(q.shape[0]):
        q8_0_tile(x, q, d, t, out)


def kernel_threads() -> tuple[str, int]:
    """(numba's threading layer, threads) the kernels run on; call after one of them ran.

    "omp" (GNU OpenMP, Debian's libgomp1) or "tbb" wake their threads in microseconds;
    "workqueue", numba's fallback when neither library loads, made the 30 Q4_1 layers of a
    batch-1 step 3.3x slower here (16.6 ms against omp's 5.0 ms, `kvmesh.bench.quant` under
    NUMBA_THREADING_LAYER=workqueue).
    """
    return numba.threading_layer(), numba.get_num_threads()


def quantized_matmul(x: torch.Tensor, w: Q4_1Weight | Q8_0Weight, int8_activations: bool = False) -> torch.Tensor:
    """x @ w.T for x [M, K] fp32 and a packed GGUF weight [N, K]; returns [M, N] fp32.

    int8_activations: x's rows as int8 blocks against Q4_1 weights (W4A8, `kvmesh.kernels.quant_a8`;
    `--quantization int8`), the same bits as the fused decode step's tiles; a Q8_0 weight takes
    fp32 activations either way.

    Meant for decode batches: each tile's bytes are read and unpacked once and reused for all M
    rows; past ~128 rows an fp32 GEMM wins (`kvmesh.bench.quant`). Row r of the result does not depend
    on the other rows' values, bit for bit.
    Runs on numba's threads (`numba.set_num_threads`), each on whole tiles.
    Raises ValueError when x is not [M, w.in_features] fp32.
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be fp32 [M, {w.in_features}], got {x.dtype} {tuple(x.shape)}")
    xn = x.contiguous().numpy()
    tiles = w.qs.shape[0] if isinstance(w, Q4_1Weight) else w.q.shape[0]
    out = torch.empty(x.shape[0], tiles * TN)
    if isinstance(w, Q4_1Weight) and int8_activations:
        _q4_1_matmul_a8(xn, w.qs, w.d, w.m, out.numpy())
    elif isinstance(w, Q4_1Weight):
        _q4_1_matmul(xn, w.qs, w.d, w.m, out.numpy())
    else:
        _q8_0_matmul(xn, w.q, w.d, out.numpy())
    return out if tiles * TN == w.out_features else out[:, : w.out_features]
