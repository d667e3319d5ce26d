# M=rows of activations (tokens), K=input features, N=output features, G=K/32 blocks of a row,
# NT=N/TN tiles of TN output features
"""The numba tiles of the GGUF block matmul: tile t of x @ w.T from Q4_1 or Q8_0 blocks
(`q4_1_tile`, `q8_0_tile`), for `kvmesh.kernels.quant.quantized_matmul` and the fused decode step
in `kvmesh.engine.llama.step`, which run them over tiles on numba's threads.

Per block they sum x*q first and scale once: sum_k x_k w_k = d * sum_k x_k q_k + m * sum_k x_k.
Each tile's accumulators are its own arrays, which is what lets LLVM vectorize the row loop
(shared ones cost 2.5x at 16 rows). One row unpacks each byte in registers as it streams by.
Several rows convert each block of the tile to fp32 once, into an 8 KB buffer that stays in L1,
and multiply it into up to 6 rows at a time whose sums stay in registers (`_block_rows` of
`kvmesh.kernels.quant_llvm`, in passes of 16 outputs where AVX2 has too few registers for 64:
`BLOCK_ROWS`). Every path does the same operations in the same order, so a row's bits do not
depend on the rows beside it (batched decode gives each sequence what it gets alone).
"""

from __future__ import annotations

import numba
import numpy as np

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant_format import QK, TN
from kvmesh.kernels.quant_llvm import BLOCK_ROWS, PREFETCH_LINES, _block_rows, _fma, prefetch


def rows_dispatch(blocks):
    """A numba function `(R, x, r0, k0, w, blk)` calling blocks[R - 1](x, r0, k0, w, blk), for the
    six register-block intrinsics of 1..6 rows (`_block_rows`, `kvmesh.kernels.quant_a8`'s)."""
    b1, b2, b3, b4, b5, b6 = blocks

    @numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
    def block_rows_any(R, x, r0, k0, w, blk):
        if R == 6:
            b6(x, r0, k0, w, blk)
        elif R == 5:
            b5(x, r0, k0, w, blk)
        elif R == 4:
            b4(x, r0, k0, w, blk)
        elif R == 3:
            b3(x, r0, k0, w, blk)
        elif R == 2:
            b2(x, r0, k0, w, blk)
        else:
            b1(x, r0, k0, w, blk)

    return block_rows_any


assert BLOCK_ROWS == 6  # rows_dispatch's six
_block_rows_q4_1, _block_rows_q8_0 = (
    rows_dispatch([_block_rows(r, halve_odd) for r in range(1, BLOCK_ROWS + 1)]) for halve_odd in (True, False)
)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def block_sums(x):  # x [M, K] -> [M, G]
    """Sums of each block of 32 inputs of each row, as `q4_1_tile` wants them."""
    rows, g = x.shape[0], x.shape[1] // QK
    out = np.empty((rows, g), np.float32)
    for r in range(rows):
        for b in range(g):
            s = np.float32(0)
            for i in range(QK):
                s += x[r, b * QK + i]
            out[r, b] = s
    return out


@numba.njit(nogil=True, cache=True, inline="always")
def _nibbles(byte):  # one packed byte -> (q_lo, 16 q_hi) as fp32, exactly
    # in fp32, not with integer masks: numba widens `byte & 15` to 64-bit integers, which
    # LLVM vectorizes 8 lanes at a time with 64-bit converts; as floats, 16 lanes and no
    # conversion past the first (the row-1 path ran 1.7x faster, 3072x576, one thread).
    # floor(v / 16) * 16 and the rest are exact for v in 0..255
    v = np.float32(byte)
    hi16 = np.floor(v * np.float32(0.0625)) * np.float32(16)
    return v - hi16, hi16


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _q4_1_row(x, xsum, qs, d, m, t, r, acc):  # adds tile t of row r of x @ w.T into acc [M, TN]
    """One row streaming through tile t (decode at batch 1, memory-bound): each packed byte is
    unpacked in registers and used once; the block's partial sums stay in a [TN] buffer in L1."""
    blk = np.empty(TN, np.float32)
    q_at, s_at = t * qs.shape[1] * TN, t * d.shape[1] * TN  # the tile's first byte / scale, flat
    for b in range(x.shape[1] // QK):
        blk[:] = 0
        for line in range(0, TN, 16):  # the scales and mins two blocks on
            prefetch(d, s_at + (b + 2) * TN + line)
            prefetch(m, s_at + (b + 2) * TN + line)
        for jj in range(QK // 2):
            j = b * (QK // 2) + jj
            prefetch(qs, q_at + (j + PREFETCH_LINES) * TN)  # a row of the tile is one line
            # x1 * q_hi as (x1 / 16) * (16 q_hi): the same product (the division is exact)
            x0, x1 = x[r, 2 * j], x[r, 2 * j + 1] * np.float32(0.0625)
            for n in range(TN):
                lo, hi16 = _nibbles(qs[t, j, n])
                blk[n] = _fma(x1, hi16, _fma(x0, lo, blk[n]))
        s = xsum[r, b]
        for n in range(TN):
            acc[r, n] = _fma(m[t, b, n], s, _fma(d[t, b, n], blk[n], acc[r, n]))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def q4_1_tile(x, xsum, qs, d, m, t, out):  # x [M, K] f32, xsum [M, G], qs [NT, K/2, TN] u8, out [M, NT*TN]
    """out[:, t*TN : (t+1)*TN] = tile t of x @ w.T, for callers' own numba loops (`_q4_1_matmul`,
    the fused decode step in `kvmesh.engine.llama.step`); xsum is `block_sums(x)`.

    One row streams the bytes (`_q4_1_row`). Several rows unpack each block of the tile once, to
    [32, TN] fp32 in L1 (q_lo, and 16 q_hi on odd inputs), and multiply it into up to 6 rows at a
    time held in registers (`_block_rows`): 16 rows 1.6-1.7x faster than unpacking each byte in
    registers for groups of 4 rows, 30 layers of SmolLM2's shapes, 2 threads, Intel Xeon.
    Every row gets the same bits alone or among others, in any group: each block's partial sum runs
    over j in order as s = fma(x_2j+1 / 16, 16 q_2j+1, fma(x_2j, q_2j, s)), then
    acc = fma(m, xsum, fma(d, s, acc)), blocks in order.
    """
    rows = x.shape[0]
    acc = np.zeros((rows, TN), np.float32)
    if rows == 1:
        _q4_1_row(x, xsum, qs, d, m, t, 0, acc)
        out[:, t * TN : (t + 1) * TN] = acc
        return
    w = np.empty((QK, TN), np.float32)  # one block of the tile: q_lo, 16 q_hi, ... as fp32
    blk = np.empty((BLOCK_ROWS, TN), np.float32)
    q_at, s_at = t * qs.shape[1] * TN, t * d.shape[1] * TN
    for b in range(x.shape[1] // QK):
        for line in range(0, TN, 16):
            prefetch(d, s_at + (b + 2) * TN + line)
            prefetch(m, s_at + (b + 2) * TN + line)
        for jj in range(QK // 2):
            j = b * (QK // 2) + jj
            prefetch(qs, q_at + (j + PREFETCH_LINES) * TN)
            for n in range(TN):
                lo, hi16 = _nibbles(qs[t, j, n])
                w[2 * jj, n] = lo
                w[2 * jj + 1, n] = hi16
        r = 0
        while r < rows:
            group = min(BLOCK_ROWS, rows - r)
            _block_rows_q4_1(group, x, r, b * QK, w, blk)
            for i in range(group):
                s = xsum[r + i, b]
                for n in range(TN):
                    acc[r + i, n] = _fma(m[t, b, n], s, _fma(d[t, b, n], blk[i, n], acc[r + i, n]))
            r += group
    out[:, t * TN : (t + 1) * TN] = acc


@numba.njit(nogil=True, cache=True, boundscheck=False)
def q8_0_tile(x, q, d, t, out):  # x [M, K] f32, q [NT, K, TN] i8, d [NT, G, TN], out [M, NT*TN]
    """out[:, t*TN : (t+1)*TN] = tile t of x @ w.T, for callers' own numba loops. Each output is
    sum over blocks of d * sum_k x_k q_k, as s = fma(x_k, q_k, s) over k in order, then
    acc = fma(d, s, acc) over blocks in order, so a row's bits do not depend on the others."""
    rows, g = x.shape[0], x.shape[1] // QK
    acc = np.zeros((rows, TN), np.float32)
    blk = np.empty((BLOCK_ROWS, TN), np.float32)
    w = np.empty((QK, TN), np.float32)  # one block of the tile as fp32
    q_at, s_at = t * q.shape[1] * TN, t * g * TN  # the tile's first byte / scale, flat
    for b in range(g):
        for line in range(0, TN, 16):  # the scales two blocks on
            prefetch(d, s_at + (b + 2) * TN + line)
        for i in range(QK):  # the block after next (2 KB on): a row of the tile is one line
            prefetch(q, q_at + ((b + 2) * QK + i) * TN)
        if rows == 1:
            blk[0, :] = 0
            for i in range(QK):
                k = b * QK + i
                xk = x[0, k]
                for n in range(TN):
                    blk[0, n] = _fma(xk, np.float32(q[t, k, n]), blk[0, n])
            for n in range(TN):
                acc[0, n] = _fma(d[t, b, n], blk[0, n], acc[0, n])
            continue
        # convert the block's int8 once for all rows (1.5x at 16 rows, 576x49152, one thread)
        for i in range(QK):
            for n in range(TN):
                w[i, n] = np.float32(q[t, b * QK + i, n])
        r = 0
        while r < rows:
            group = min(BLOCK_ROWS, rows - r)
            _block_rows_q8_0(group, x, r, b * QK, w, blk)
            for i in range(group):
                for n in range(TN):
                    acc[r + i, n] = _fma(d[t, b, n], blk[i, n], acc[r + i, n])
            r += group
    out[:, t * TN : (t + 1) * TN] = acc
