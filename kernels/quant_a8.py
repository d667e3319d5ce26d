# M=rows of activations (tokens), K=input features, G=K/32 blocks of a row, NT=N/TN tiles of TN
# output features
"""int8 activations against the GGUF file's Q4_1 blocks (W4A8): `--quantization int8`.

llama.cpp's CPU path for Q4_1 weights (`ggml_vec_dot_q4_1_q8_1`): each row of activations is
quantized per block of 32 inputs to int8 with one fp32 scale (`quantize_rows_q8`: xd = max|x| / 127,
xq = round(x / xd), as `quantize_row_q8_1`), and a block's dot product is summed in integers:

    sum_k w_k x_k ~= d * xd * sum_k q_k xq_k + m * sum_k x_k

(d, m the block's Q4_1 scale and minimum, q in 0..15; sum_k x_k exact in fp32, as `block_sums`).
The integer sums run on `vpmaddubsw` (u8 weights x s8 activations, adjacent pairs summed into
int16: 32 multiply-adds an instruction where an fp32 FMA does 8 on AVX2), held in int16 for 8
pairs (|sum| <= 8 * 2 * 15 * 127 = 30,480 < 2^15, so never saturated) and widened to int32 twice a
block. With AVX-512 VNNI (`has_vpdpbusd`: Intel Cascade Lake on, AMD Zen 4 on) they run on
`vpdpbusd` instead: four u8 x s8 products summed straight into int32 lanes, 64 multiply-adds a
512-bit instruction and no int16 stage to widen, over weights unpacked as quads (the four inputs
4j..4j+3 of an output in adjacent bytes). Integer sums are exact in any order, so both paths give
the same bits; the scaling runs in a fixed order, so a row's bits never depend on the rows beside
it (batched decode gives each sequence what it gets alone).

The tile layout is `Q4_1Weight`'s ([NT, K/2, TN] bytes, each byte the pair of inputs 2j, 2j+1 of
one output): unpacked once a call, for all rows, into [G, 16, 2 TN] bytes (q_2j, q_2j+1 of output n
at 2n, 2n+1), which is `vpmaddubsw`'s pair layout, or, for `vpdpbusd`, the same bytes as
[G, 8, 4 TN] (q_4j .. q_4j+3 of output n at 4n .. 4n+3). Numerics: the activations' rounding (at most
xd / 2 an input) is the only error added to the fp32 path's; the acceptance rule in
docs/precision.md judges it through the model.
"""

from __future__ import annotations

import numba
import numpy as np

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant_a8_ir import A8_QUADS, _a8_block_rows, _unpacker, has_vpdpbusd
from kvmesh.kernels.quant_format import QK, TN
from kvmesh.kernels.quant_llvm import PREFETCH_LINES, _fma, prefetch
from kvmesh.kernels.quant_tiles import rows_dispatch

__all__ = ["A8_QUADS", "A8_ROWS", "has_vpdpbusd", "make_q4_1_tile_a8", "q4_1_tile_a8", "quantize_rows_q8"]

A8_ROWS = 6
"""Rows of one register block: 6 rows x 32 outputs of int16 sums = 12 AVX2 registers, 2 for the
block's weights and 1 for the broadcast activations (of 16); on VNNI 6 rows x 64 outputs of int32
sums = 24 of AVX-512's 32 (the IR: kvmesh.kernels.quant_a8_ir)."""
assert A8_ROWS == 6  # rows_dispatch's six


@numba.njit(nogil=True, cache=True, boundscheck=False)
def quantize_rows_q8(x):  # x [M, K] f32 -> (xq [M, K] i8, xd [M, G] f32, xsum [M, G] f32)
    """Each block of 32 inputs of each row as int8 with one scale, as llama.cpp's
    `quantize_row_q8_1`: xd = max|x| / 127, xq = round(x / xd) (halves away from zero; xq = 0
    where the block is all zero), and the block's exact fp32 sum (`block_sums`' order)."""
    rows, g = x.shape[0], x.shape[1] // QK
    xq = np.empty((rows, x.shape[1]), np.int8)
    xd = np.empty((rows, g), np.float32)
    xsum = np.empty((rows, g), np.float32)
    for r in range(rows):
        for b in range(g):
            amax = np.float32(0)
            s = np.float32(0)
            for i in range(QK):
                v = x[r, b * QK + i]
                s += v
                amax = max(amax, abs(v))
            dx = amax / np.float32(127)
            inv = np.float32(1) / dx if dx > 0 else np.float32(0)
            for i in range(QK):
                v = x[r, b * QK + i] * inv
                xq[r, b * QK + i] = np.int8(np.floor(abs(v) + np.float32(0.5)) * np.sign(v))
            xd[r, b] = dx
            xsum[r, b] = s
    return xq, xd, xsum


def make_q4_1_tile_a8(quads: bool = A8_QUADS):
    """The tile function below, its integer sums on `vpdpbusd` over quads (quads) or on
    `vpmaddubsw` over pairs: the same bits either way. The host's choice is `q4_1_tile_a8`;
    kvmesh.bench.quantization builds the other to compare them in one run."""
    unpack_block = _unpacker(quads)
    a8_rows_any = rows_dispatch([_a8_block_rows(r, quads=quads) for r in range(1, A8_ROWS + 1)])

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def q4_1_tile_a8(xq, xd, xsum, qs, d, m, t, out):  # qs [NT, K/2, TN] u8, out [M, NT*TN] f32
        """out[:, t*TN : (t+1)*TN] = tile t of x @ w.T with x as `quantize_rows_q8(x)` gives it.

        Per block b and output n: s = the exact int32 sum of q xq (`_a8_block_rows`), then
        acc = fma(m, xsum, fma(d * xd, s, acc)), blocks in order, the same for a row alone or among
        others. The tile is unpacked once ([G, 16, 2 TN] bytes: 18-48 KB for SmolLM2's K), then rows
        go through it in groups of up to A8_ROWS, each group's sums held in L1 across every block
        (a GEMM's loop order, for prefill's hundreds of rows as for decode's few).
        """
        rows, g = xq.shape[0], xq.shape[1] // QK
        w8 = np.empty((g, QK // 2, 2 * TN), np.uint8)
        q_at, s_at = t * qs.shape[1] * TN, t * g * TN
        for b in range(g):
            for jj in range(QK // 2):
                prefetch(qs, q_at + (b * (QK // 2) + jj + PREFETCH_LINES) * TN)
            unpack_block(qs, q_at + b * (QK // 2) * TN, w8[b])
        acc = np.empty((A8_ROWS, TN), np.float32)
        blk = np.empty((A8_ROWS, TN), np.int32)
        r = 0
        while r < rows:
            group = min(A8_ROWS, rows - r)
            acc[:] = 0
            for b in range(g):
                for line in range(0, TN, 16):
                    prefetch(d, s_at + (b + 2) * TN + line)
                    prefetch(m, s_at + (b + 2) * TN + line)
                a8_rows_any(group, xq, r, b * QK, w8[b], blk)
                for i in range(group):
                    dx, s = xd[r + i, b], xsum[r + i, b]
                    for n in range(TN):
                        acc[i, n] = _fma(m[t, b, n], s, _fma(d[t, b, n] * dx, np.float32(blk[i, n]), acc[i, n]))
            out[r : r + group, t * TN : (t + 1) * TN] = acc[:group]
            r += group

    return q4_1_tile_a8


q4_1_tile_a8 = make_q4_1_tile_a8()
