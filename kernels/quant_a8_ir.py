# M=rows of activations (tokens), K=input features, TN=output features of a tile
"""The LLVM IR of the W4A8 tiles (kvmesh.kernels.quant_a8, `--quantization int8`): one 32-input
block's exact int32 sums for up to six rows, on `vpmaddubsw` over weight pairs (AVX2) or on
`vpdpbusd` over quads (AVX-512 VNNI), each with a plain-IR stand-in for CPUs without it; and the
unpacking of a tile's packed Q4_1 bytes into either layout. Compiled into the cached tiles, so
this file is part of their cache key (`kvmesh.kernels.numba_cache.NUMBA_INLINED`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types as nbtypes
from numba.core import cgutils
from numba.extending import intrinsic

from kvmesh.kernels.quant_format import QK, TN
from kvmesh.kernels.quant_llvm import BlockIR, codegen_features

_PASS = 32  # outputs a pass: two <16 x i16> sums a row
_HALF = 8  # pairs summed in int16 before widening
assert TN % 64 == 0  # a tile's outputs in whole passes: 32 a pass of pairs, 64 of quads


def has_pmaddubsw() -> bool:
    """Whether numba's code for this host may use AVX2's `vpmaddubsw` (`codegen_features`)."""
    return "+avx2" in codegen_features()


def has_vpdpbusd() -> bool:
    """Whether numba's code for this host may use AVX-512 VNNI's `vpdpbusd` on 512-bit vectors
    (`codegen_features`)."""
    return {"+avx512vnni", "+avx512f"} <= codegen_features()


A8_QUADS = has_vpdpbusd()
"""Whether this host's tiles run on `vpdpbusd` over quads (else `vpmaddubsw` over pairs)."""


class _A8BlockIR(BlockIR):
    """The IR of one `_a8_block_rows(R)` call: for each pass of 32 outputs, two halves of 8 input
    pairs summed in int16 registers, each half widened and added into blk (int32)."""

    def __init__(self, context, builder, signature, args, native: bool) -> None:
        super().__init__(context, builder, signature, args)
        self.i8, self.i16, self.i32, self.i64 = (ir.IntType(n) for n in (8, 16, 32, 64))
        self.bytes32 = ir.VectorType(self.i8, 32)
        self.sum16 = ir.VectorType(self.i16, 16)
        self.sum32 = ir.VectorType(self.i32, 16)
        self.native = native
        if self.native:
            self.pmaddubsw = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(self.sum16, [self.bytes32, self.bytes32]), "llvm.x86.avx2.pmadd.ub.sw"
            )

    def emit(self, R: int) -> None:
        b = self.builder
        for first in range(0, TN, _PASS):
            for half in range(QK // 2 // _HALF):
                sums = [
                    [cgutils.alloca_once_value(b, ir.Constant(self.sum16, [0] * 16)) for _ in range(2)]
                    for _ in range(R)
                ]
                with cgutils.for_range(b, ir.Constant(self.i64, _HALF)) as loop:
                    self._add_pair(b.add(loop.index, ir.Constant(self.i64, half * _HALF)), first, sums)
                self._flush(sums, first, add=half > 0)

    def _add_pair(self, jj, first: int, sums: list) -> None:
        """sums[i][v] += the pair jj's products for outputs first + 16 v .. + 16, every row i."""
        b = self.builder
        wv = [
            b.load(
                b.bitcast(
                    self.at(self.w_ty, self.wa, jj, ir.Constant(self.i64, 2 * (first + 16 * v))),
                    self.bytes32.as_pointer(),
                ),
                align=1,
            )
            for v in range(2)
        ]
        col = b.add(self.k0, b.mul(jj, ir.Constant(self.i64, 2)))
        for i, row_sums in enumerate(sums):
            pair_ptr = self.at(self.x_ty, self.xa, b.add(self.r0, ir.Constant(self.i64, i)), col)
            pair = b.load(b.bitcast(pair_ptr, self.i16.as_pointer()), align=1)  # xq_2j, xq_2j+1
            one = b.insert_element(ir.Constant(self.sum16, ir.Undefined), pair, ir.Constant(self.i32, 0))
            xv = b.bitcast(
                b.shuffle_vector(
                    one, ir.Constant(self.sum16, ir.Undefined), ir.Constant(ir.VectorType(self.i32, 16), [0] * 16)
                ),
                self.bytes32,
            )
            for w, acc in zip(wv, row_sums):
                b.store(b.add(b.load(acc), self.madd(w, xv)), acc)

    def madd(self, w, xv):
        """`vpmaddubsw(w, xv)`: lane n = w[2n] xv[2n] + w[2n+1] xv[2n+1], w unsigned, xv signed,
        <16 x i16>. Elsewhere (no AVX2) the same in plain IR (exact: no sum here saturates)."""
        b = self.builder
        if self.native:
            return b.call(self.pmaddubsw, [w, xv])
        wide = ir.VectorType(self.i16, 32)
        prod = b.mul(b.zext(w, wide), b.sext(xv, wide))
        lanes = ir.VectorType(self.i32, 16)
        even = b.shuffle_vector(prod, ir.Constant(wide, ir.Undefined), ir.Constant(lanes, list(range(0, 32, 2))))
        odd = b.shuffle_vector(prod, ir.Constant(wide, ir.Undefined), ir.Constant(lanes, list(range(1, 32, 2))))
        return b.add(even, odd)

    def _flush(self, sums: list, first: int, add: bool) -> None:
        """blk[i, first + 16 v ..] (+)= sums[i][v] widened to int32."""
        b = self.builder
        for i, row_sums in enumerate(sums):
            for v, acc in enumerate(row_sums):
                ptr = b.bitcast(
                    self.at(self.blk_ty, self.ba, ir.Constant(self.i64, i), ir.Constant(self.i64, first + 16 * v)),
                    self.sum32.as_pointer(),
                )
                wide = b.sext(b.load(acc), self.sum32)
                b.store(b.add(b.load(ptr, align=4), wide) if add else wide, ptr, align=4)


class _A8QuadIR(BlockIR):
    """The IR of one `_a8_block_rows(R, quads=True)` call: 64 outputs a pass (four <16 x i32>
    sums a row: 6 rows x 4 = 24 of AVX-512's 32 registers, 4 for the weights, 1 for the
    activations), 8 quads of inputs summed into them, then stored into blk."""

    def __init__(self, context, builder, signature, args, native: bool) -> None:
        super().__init__(context, builder, signature, args)
        self.i8, self.i32, self.i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        self.sum32 = ir.VectorType(self.i32, 16)
        self.native = native
        if native:
            self.vpdpbusd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(self.sum32, [self.sum32] * 3), "llvm.x86.avx512.vpdpbusd.512"
            )

    def emit(self, R: int) -> None:
        b = self.builder
        w0 = self.at(self.w_ty, self.wa, ir.Constant(self.i64, 0), ir.Constant(self.i64, 0))  # the block's flat bytes
        for first in range(0, TN, 64):
            sums = [
                [cgutils.alloca_once_value(b, ir.Constant(self.sum32, [0] * 16)) for _ in range(4)] for _ in range(R)
            ]
            with cgutils.for_range(b, ir.Constant(self.i64, QK // 4)) as loop:
                self._add_quad(w0, loop.index, first, sums)
            for i, row_sums in enumerate(sums):
                for v, acc in enumerate(row_sums):
                    at = self.at(self.blk_ty, self.ba, ir.Constant(self.i64, i), ir.Constant(self.i64, first + 16 * v))
                    b.store(b.load(acc), b.bitcast(at, self.sum32.as_pointer()), align=4)

    def _add_quad(self, w0, j, first: int, sums: list) -> None:
        """sums[i][v] += quad j's products for outputs first + 16 v .. + 16, every row i."""
        b = self.builder
        base = b.mul(j, ir.Constant(self.i64, 4 * TN))
        wv = [
            b.load(
                b.bitcast(
                    b.gep(w0, [b.add(base, ir.Constant(self.i64, 4 * (first + 16 * v)))]), self.sum32.as_pointer()
                ),
                align=1,
            )
            for v in range(4)
        ]
        col = b.add(self.k0, b.mul(j, ir.Constant(self.i64, 4)))
        for i, row_sums in enumerate(sums):
            quad_ptr = self.at(self.x_ty, self.xa, b.add(self.r0, ir.Constant(self.i64, i)), col)
            quad = b.load(b.bitcast(quad_ptr, self.i32.as_pointer()), align=1)  # xq_4j .. xq_4j+3
            one = b.insert_element(ir.Constant(self.sum32, ir.Undefined), quad, ir.Constant(self.i32, 0))
            xv = b.shuffle_vector(one, ir.Constant(self.sum32, ir.Undefined), ir.Constant(self.sum32, [0] * 16))
            for w, acc in zip(wv, row_sums):
                b.store(self.dot(b.load(acc), w, xv), acc)

    def dot(self, acc, w, xv):
        """`vpdpbusd(acc, w, xv)`: lane n += the sum over e < 4 of byte 4n+e of w (unsigned) times
        that of xv (signed), <16 x i32>. Elsewhere the same in plain IR (exact either way)."""
        b = self.builder
        if self.native:
            return b.call(self.vpdpbusd, [acc, w, xv])
        bytes64, wide = ir.VectorType(self.i8, 64), ir.VectorType(self.i32, 64)
        prod = b.mul(b.zext(b.bitcast(w, bytes64), wide), b.sext(b.bitcast(xv, bytes64), wide))
        for e in range(4):
            lane = ir.Constant(self.sum32, list(range(e, 64, 4)))
            acc = b.add(acc, b.shuffle_vector(prod, ir.Constant(wide, ir.Undefined), lane))
        return acc


def _a8_block_rows(R: int, native: bool | None = None, quads: bool = A8_QUADS):
    """An intrinsic `(xq, r0, k0, w8, blk) -> None`: for i < R and n < TN,
    blk[i, n] = sum over j < 16 of w8[j, 2n] xq[r0+i, k0+2j] + w8[j, 2n+1] xq[r0+i, k0+2j+1], exact
    in int32. xq [M, K] int8, w8 [16, 2 TN] uint8 (values <= 15; C-contiguous), blk [>= R, TN] int32.
    quads: w8's bytes are [8, 4 TN] quads (`_unpacker(quads=True)`) and the sums run on
    `vpdpbusd`; else pairs on `vpmaddubsw`. native: the instruction (None: where the host has it),
    else plain IR (tests run all four)."""
    if native is None:
        native = has_vpdpbusd() if quads else has_pmaddubsw()
    emitter = _A8QuadIR if quads else _A8BlockIR

    @intrinsic
    def a8_block_rows(typingctx, xq, r0, k0, w8, blk):
        def codegen(context, builder, signature, args):
            emitter(context, builder, signature, args, native).emit(R)
            return context.get_dummy_value()

        return nbtypes.none(xq, r0, k0, w8, blk), codegen

    return a8_block_rows


def _unpacker(quads: bool):
    """An intrinsic `(qs, at, w8) -> None`: one block of a tile from its packed bytes (qs
    C-contiguous uint8, the block at flat index `at`: byte qs.flat[at + jj * TN + n] holds inputs
    2jj, 2jj+1 of output n) into w8 (16 x 2 TN bytes), as vector IR (mask, shift, interleave:
    LLVM's byte unpacks). Pairs: w8[jj, 2n] = q_2jj, w8[jj, 2n+1] = q_2jj+1 (`vpmaddubsw`'s
    layout). quads: byte 4 TN j + 4n + e = q_4j+e (`vpdpbusd`'s), the pairs of rows 2j and
    2j+1 interleaved output by output."""

    @intrinsic
    def unpack_block(typingctx, qs, at, w8):
        def codegen(context, builder, signature, args):
            b = builder
            i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
            src = context.make_array(signature.args[0])(context, builder, args[0]).data
            dst = context.make_array(signature.args[2])(context, builder, args[2]).data
            chunk, wide = ir.VectorType(i8, 32), ir.VectorType(i8, 64)
            pairs = ir.Constant(ir.VectorType(i32, 64), [k // 2 + (32 if k % 2 else 0) for k in range(64)])

            def pairs_of(jj: int, c: int):  # row jj's pairs for outputs c .. c + 32: 64 bytes
                ptr = b.gep(src, [b.add(args[1], ir.Constant(i64, jj * TN + c))])
                v = b.load(b.bitcast(ptr, chunk.as_pointer()), align=1)
                lo = b.and_(v, ir.Constant(chunk, [15] * 32))
                hi = b.lshr(v, ir.Constant(chunk, [4] * 32))
                return b.shuffle_vector(lo, hi, pairs)

            for c in range(0, TN, 32):
                if not quads:
                    for jj in range(QK // 2):
                        out = b.gep(dst, [ir.Constant(i64, jj * 2 * TN + 2 * c)])
                        b.store(pairs_of(jj, c), b.bitcast(out, wide.as_pointer()), align=1)
                    continue
                half = ir.VectorType(i16, 32)
                for j in range(QK // 4):  # outputs' pairs of rows 2j, 2j+1 interleaved: 128 bytes of quads
                    even, odd = (b.bitcast(pairs_of(2 * j + e, c), half) for e in (0, 1))
                    out = b.gep(dst, [ir.Constant(i64, j * 4 * TN + 4 * c)])
                    b.store(
                        b.shuffle_vector(even, odd, pairs), b.bitcast(out, ir.VectorType(i16, 64).as_pointer()), align=1
                    )
            return context.get_dummy_value()

        return nbtypes.none(qs, at, w8), codegen

    return unpack_block
