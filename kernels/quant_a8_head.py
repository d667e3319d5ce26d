# M=rows of activations (tokens), K=input features, G=K/32 blocks of a row, NT=N/TN tiles of TN
# output features
"""int8 activations against the GGUF file's Q8_0 blocks (W8A8): the lm_head under
`--quantization int8`.

llama.cpp's CPU path for Q8_0 weights (`ggml_vec_dot_q8_0_q8_0`): each row of activations is
quantized per block of 32 inputs to int8 with one fp32 scale (`kvmesh.kernels.quant_a8.quantize_rows_q8`),
and a block's dot product is summed in integers:

    sum_k w_k x_k ~= d * xd * sum_k q_k xq_k

(d the block's Q8_0 scale, q in -128..127, xq in -127..127). Both factors are signed, so the
sums run on `vpmaddwd` (int16 x int16, adjacent pairs summed into int32 lanes: 16 multiply-adds
an instruction where an fp32 FMA does 8 on AVX2), exact with no widening step
(|sum| <= 32 * 128 * 127 = 520,192 < 2^31). `vpmaddubsw` (unsigned x signed, as the Q4_1 kernel
uses) would need llama.cpp's sign trick and a widening per pair (its int16 sums of two products
of 128 * 127 do not leave room for a third): more instructions than it saves here.

Layout: the tile's Q8_0 bytes (`Q8_0Weight`, [NT, K, TN] int8) are unpacked one block at a time
into int16 pairs [16, 2 TN] (q_2j, q_2j+1 of output n at 2n, 2n+1: `vpmaddwd`'s pairs; 4 KB,
in L1) and multiplied into up to A8_ROWS rows at a time whose int32 sums stay in registers; the
activations are widened to int16 once a call. Integer sums are exact in any order and the scaling
runs in a fixed order, so a row's bits never depend on the rows beside it.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types as nbtypes
from numba.core import cgutils
from numba.extending import intrinsic

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant_a8 import A8_ROWS, has_pmaddubsw
from kvmesh.kernels.quant_format import QK, TN
from kvmesh.kernels.quant_llvm import BlockIR, _fma, prefetch
from kvmesh.kernels.quant_tiles import rows_dispatch

_PASS = 16  # outputs a pass: two <8 x i32> sums a row (6 rows: 12 of AVX2's 16 registers)


class _WordBlockIR(BlockIR):
    """The IR of one `_wd_block_rows(R)` call: for each pass of 16 outputs, the block's 16 input
    pairs multiplied and summed into int32 registers, then stored to blk."""

    def __init__(self, context, builder, signature, args, native: bool) -> None:
        super().__init__(context, builder, signature, args)
        self.i16, self.i32, self.i64 = (ir.IntType(n) for n in (16, 32, 64))
        self.words = ir.VectorType(self.i16, 16)
        self.sums = ir.VectorType(self.i32, 8)
        self.native = native
        if native:
            self.pmaddwd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(self.sums, [self.words, self.words]), "llvm.x86.avx2.pmadd.wd"
            )

    def emit(self, R: int) -> None:
        b = self.builder
        for first in range(0, TN, _PASS):
            sums = [[cgutils.alloca_once_value(b, ir.Constant(self.sums, [0] * 8)) for _ in range(2)] for _ in range(R)]
            with cgutils.for_range(b, ir.Constant(self.i64, QK // 2)) as loop:
                self._add_pair(loop.index, first, sums)
            for i, row_sums in enumerate(sums):
                for v, acc in enumerate(row_sums):
                    at = self.at(self.blk_ty, self.ba, ir.Constant(self.i64, i), ir.Constant(self.i64, first + 8 * v))
                    b.store(b.load(acc), b.bitcast(at, self.sums.as_pointer()), align=4)

    def _add_pair(self, jj, first: int, sums: list) -> None:
        """sums[i][v] += the pair jj's products for outputs first + 8 v .. + 8, every row i."""
        b = self.builder
        wv = [
            b.load(
                b.bitcast(
                    self.at(self.w_ty, self.wa, jj, ir.Constant(self.i64, 2 * (first + 8 * v))),
                    self.words.as_pointer(),
                ),
                align=2,
            )
            for v in range(2)
        ]
        col = b.add(self.k0, b.mul(jj, ir.Constant(self.i64, 2)))
        for i, row_sums in enumerate(sums):
            pair_ptr = self.at(self.x_ty, self.xa, b.add(self.r0, ir.Constant(self.i64, i)), col)
            pair = b.load(b.bitcast(pair_ptr, self.i32.as_pointer()), align=2)  # xq_2j, xq_2j+1
            one = b.insert_element(ir.Constant(self.sums, ir.Undefined), pair, ir.Constant(self.i32, 0))
            xv = b.bitcast(
                b.shuffle_vector(one, ir.Constant(self.sums, ir.Undefined), ir.Constant(self.sums, [0] * 8)),
                self.words,
            )
            for w, acc in zip(wv, row_sums):
                b.store(b.add(b.load(acc), self.madd(w, xv)), acc)

    def madd(self, w, xv):
        """`vpmaddwd(w, xv)`: lane n = w[2n] xv[2n] + w[2n+1] xv[2n+1], <8 x i32>. Elsewhere (no
        AVX2) the same in plain IR (exact: no product or pair sum leaves int32)."""
        b = self.builder
        if self.native:
            return b.call(self.pmaddwd, [w, xv])
        wide = ir.VectorType(self.i32, 16)
        prod = b.mul(b.sext(w, wide), b.sext(xv, wide))
        lanes = ir.VectorType(self.i32, 8)
        even = b.shuffle_vector(prod, ir.Constant(wide, ir.Undefined), ir.Constant(lanes, list(range(0, 16, 2))))
        odd = b.shuffle_vector(prod, ir.Constant(wide, ir.Undefined), ir.Constant(lanes, list(range(1, 16, 2))))
        return b.add(even, odd)


def _wd_block_rows(R: int, native: bool | None = None):
    """An intrinsic `(xq, r0, k0, w16, blk) -> None`: for i < R and n < TN,
    blk[i, n] = sum over j < 16 of w16[j, 2n] xq[r0+i, k0+2j] + w16[j, 2n+1] xq[r0+i, k0+2j+1],
    exact in int32. xq [M, K] int16 (values in -128..127), w16 [16, 2 TN] int16 (the same),
    blk [>= R, TN] int32. native: `vpmaddwd` (None: where AVX2 is, `has_pmaddubsw`), else plain
    IR (tests run both)."""
    native = has_pmaddubsw() if native is None else native

    @intrinsic
    def wd_block_rows(typingctx, xq, r0, k0, w16, blk):
        def codegen(context, builder, signature, args):
            _WordBlockIR(context, builder, signature, args, native).emit(R)
            return context.get_dummy_value()

        return nbtypes.none(xq, r0, k0, w16, blk), codegen

    return wd_block_rows


@intrinsic
def _unpack_q8_block(typingctx, q, at, w16):
    """w16[jj, 2n] = q.flat[at + 2 jj TN + n], w16[jj, 2n+1] = q.flat[at + (2 jj + 1) TN + n], for
    jj < 16 and n < TN: one block of a Q8_0 tile (q C-contiguous int8, at its flat index) as int16
    pairs, as vector IR (sign-extend two rows of TN bytes, interleave)."""

    def codegen(context, builder, signature, args):
        b = builder
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        src = context.make_array(signature.args[0])(context, builder, args[0]).data
        dst = context.make_array(signature.args[2])(context, builder, args[2]).data
        row, wide = ir.VectorType(i8, TN), ir.VectorType(i16, TN)
        interleave = ir.Constant(ir.VectorType(i32, 2 * TN), [k // 2 + (TN if k % 2 else 0) for k in range(2 * TN)])
        for jj in range(QK // 2):
            even, odd = (
                b.sext(
                    b.load(
                        b.bitcast(b.gep(src, [b.add(args[1], ir.Constant(i64, (2 * jj + e) * TN))]), row.as_pointer()),
                        align=1,
                    ),
                    wide,
                )
                for e in (0, 1)
            )
            out = b.bitcast(b.gep(dst, [ir.Constant(i64, jj * 2 * TN)]), ir.VectorType(i16, 2 * TN).as_pointer())
            b.store(b.shuffle_vector(even, odd, interleave), out, align=2)
        return context.get_dummy_value()

    return nbtypes.none(q, at, w16), codegen


assert A8_ROWS == 6  # rows_dispatch's six
_wd_rows_any = rows_dispatch([_wd_block_rows(r) for r in range(1, A8_ROWS + 1)])


@numba.njit(nogil=True, cache=True, boundscheck=False)
def q8_0_tile_a8(xq16, xd, q, d, t, out):  # xq16 [M, K] i16, q [NT, K, TN] i8, d [NT, G, TN], out [M, NT*TN]
    """out[:, t*TN : (t+1)*TN] = tile t of x @ w.T with x's rows as int8 blocks (`quantize_rows_q8`'s
    xq widened to int16, and its xd).

    Per block b and output n: s = the exact int32 sum of q xq (`_wd_block_rows`), then
    acc = fma(d * xd, s, acc), blocks in order, the same for a row alone or among others.
    """
    rows, g = xq16.shape[0], xq16.shape[1] // QK
    w16 = np.empty((QK // 2, 2 * TN), np.int16)
    acc = np.zeros((rows, TN), np.float32)
    blk = np.empty((A8_ROWS, TN), np.int32)
    q_at, s_at = t * q.shape[1] * TN, t * g * TN  # the tile's first byte / scale, flat
    for b in range(g):
        for line in range(0, TN, 16):  # the scales two blocks on
            prefetch(d, s_at + (b + 2) * TN + line)
        for i in range(QK):  # the block after next (2 KB on): a row of the tile is one line
            prefetch(q, q_at + ((b + 2) * QK + i) * TN)
        _unpack_q8_block(q, q_at + b * QK * TN, w16)
        r = 0
        while r < rows:
            group = min(A8_ROWS, rows - r)
            _wd_rows_any(group, xq16, r, b * QK, w16, blk)
            for i in range(group):
                dx = xd[r + i, b]
                for n in range(TN):
                    acc[r + i, n] = _fma(d[t, b, n] * dx, np.float32(blk[i, n]), acc[r + i, n])
            r += group
    out[:, t * TN : (t + 1) * TN] = acc
