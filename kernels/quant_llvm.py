# M=rows of activations (tokens), K=input features, TN=output features of a tile
"""The LLVM pieces the block kernels are built from: the 512-bit vector choice, `prefetch`, one
rounding `_fma`, and `_block_rows`, the register-blocked multiply of one 32-input block written as
LLVM vector IR (the kernels that use them are in `kvmesh.kernels.quant_tiles`).

The loops are compiled by numba (LLVM, vectorized for the host CPU, 512 bits wide on AVX-512:
`_prefer_512_bit_vectors`, which runs when this module is imported, before any kernel is built).
Each tile asks for its bytes ~2 KB before it reads them (`prefetch`): without that, the 1-row
loop waited on memory for two thirds of its time once the weights were past L2 (Intel Xeon,
2 cores). Every multiply-add is one explicit FMA (`_fma`), rounded once, so every path rounds the
same way. These intrinsics and constants are compiled into the cached kernels, so this file is
part of their cache key (`kvmesh.kernels.numba_cache.NUMBA_INLINED`).
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types as nbtypes
from numba.core import cgutils, registry
from numba.extending import intrinsic

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant_format import QK, TN


def codegen_features() -> frozenset[str]:
    """LLVM's features numba generates code for here ('+avx512f', '-amx-bf16', ...): the host's,
    or NUMBA_CPU_FEATURES when the user set them."""
    features = vars(numba.config)["CPU_FEATURES"] or llvm.get_host_cpu_features().flatten()
    return frozenset(features.split(","))


def _host_has_avx512() -> bool:
    """Whether the code numba generates here may use AVX-512 (`codegen_features`)."""
    return "+avx512f" in codegen_features()


def _prefer_512_bit_vectors() -> None:
    """Let LLVM vectorize these loops 512 bits wide on AVX-512 CPUs whose LLVM tuning prefers 256
    (Intel's, "rocketlake" here): `-prefer-256-bit` on the host's features, unless NUMBA_CPU_FEATURES
    is set. It must run before numba builds its code generator, at the process's first `njit`:
    importing this module first does it (the decode step and the tests do). 1-row Q4_1, 576x3072,
    one thread, Intel Xeon (AVX-512): 133 -> 107 us in L2; on AMD (Zen 4/5) LLVM already chose 512.
    numba's on-disk cache keys the code by these features, so cached 256-bit code is not reused."""
    config = vars(numba.config)  # set from the environment at import: mypy sees no attributes
    if config["CPU_FEATURES"] is not None or "_toplevel_target_context" in vars(registry.cpu_target):
        return  # the user chose, or numba's code generator exists already (too late to change)
    if _host_has_avx512():
        config["CPU_FEATURES"] = llvm.get_host_cpu_features().flatten() + ",-prefer-256-bit"


_prefer_512_bit_vectors()

PREFETCH_LINES = 32
"""How far ahead of the loop the tiles ask for their weights, in 64-byte cache lines (2 KB). The
hardware prefetcher alone left the loop waiting on memory: 1-row Q4_1 over 60 different 576x3072
matrices (106 MB, past L2), one thread, Intel Xeon: 231 -> 122 us a matrix (8 lines: 161, 64: 125);
the same matrix from L2 runs 105 us with or without."""


@intrinsic
def prefetch(typingctx, arr, index):
    """Ask the CPU to bring element `index` of C-contiguous `arr` (counted flat) into cache
    (`llvm.prefetch`: read, keep in all levels). A hint: never faults, even past the end. For
    numba code (the tiles, decode attention in `kvmesh.engine.llama.step`)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return nbtypes.none(arr, index), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c in fp32, rounded once (`llvm.fma`: one FMA instruction, vectorized with its
    loop). Explicit, not left to LLVM's contraction: that fuses a mul into an add or not depending
    on the code around it, and every path here must round the same way."""
    f32 = ir.FloatType()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, list(args))

    return nbtypes.float32(nbtypes.float32, nbtypes.float32, nbtypes.float32), codegen


_LANES = 16  # fp32 lanes of one AVX-512 register; LLVM splits the vectors on narrower CPUs
BLOCK_ROWS, PASS_LANES = (6, 64) if _host_has_avx512() else (6, 16)
"""The register block of `_block_rows`: up to BLOCK_ROWS rows x PASS_LANES outputs of sums held in
registers at a time (a tile's TN outputs in TN / PASS_LANES passes over the block, which is in L1).
AVX-512 (32 registers of 16 fp32): 6 rows x 64 outputs = 24 registers, with 4 for the block's
weights and 1 for an input. AVX2 (16 registers of 8): 6 x 64 would be 48, and LLVM kept them in
memory, a load and a store around every FMA; 6 rows x 16 outputs = 12 registers, 2 for the
weights, 1 for an input, four passes a block. `kvmesh.bench.quant`, 30 layers and the lm_head at 16 /
32 rows, AMD EPYC without AVX-512, 2 cores, 6 x 64 then 6 x 16: Q4_1 layers 96.2 -> 59.7 /
183.0 -> 108.2 ms, Q8_0 lm_head 25.0 -> 12.7 / 42.2 -> 26.7 ms (3 x 32: 88.7 and 15.5 at 16).
A row's sums run over the same inputs in the same order in any block: its bits do not change."""


def _block_rows(R: int, halve_odd: bool):
    """An intrinsic `(x, r0, k0, w, blk) -> None`: for i < R, blk[i, :TN] = the sum over k < 32 of
    x[r0 + i, k0 + k] * w[k, :TN], as s = fma(x_k, w_k, s) from s = 0, k in order (x_k / 16 on odd
    k when halve_odd: the Q4_1 blocks' 16 q_hi). x [M, K], w [32, TN], blk [>= R, TN], fp32.

    Written as LLVM vector IR (`_BlockRowsIR`): the R x TN sums stay in registers for the whole
    block and every weight vector loaded serves all R rows, which LLVM's loop vectorizer does not
    find from numba loops (it keeps the sums in memory, a load and a store every two FMAs). The
    register blocking of a GEMM micro-kernel (Goto & van de Geijn, "Anatomy of High-Performance
    Matrix Multiplication", 2008), on one 32-input block at a time so the scales apply per block.
    """

    @intrinsic
    def block_rows(typingctx, x, r0, k0, w, blk):
        def codegen(context, builder, signature, args):
            _BlockRowsIR(context, builder, signature, args).emit(R, halve_odd)
            return context.get_dummy_value()

        return nbtypes.none(x, r0, k0, w, blk), codegen

    return block_rows


class BlockIR:
    """What a register-block intrinsic `(x, r0, k0, w, blk)` emits its IR with: numba's builder,
    the three arrays' types and structs, r0 and k0, and `at` (a pointer to an element)."""

    def __init__(self, context, builder, signature, args) -> None:
        self.context, self.builder = context, builder
        self.x_ty, _, _, self.w_ty, self.blk_ty = signature.args
        self.xa, self.wa, self.ba = (
            context.make_array(ty)(context, builder, args[n])
            for ty, n in ((self.x_ty, 0), (self.w_ty, 3), (self.blk_ty, 4))
        )
        self.r0, self.k0 = args[1], args[2]

    def at(self, ty, ary, i, j):
        """A pointer to ary[i, j]."""
        return cgutils.get_item_pointer(self.context, self.builder, ty, ary, [i, j])


class _BlockRowsIR(BlockIR):
    """The IR of one `_block_rows(R, halve_odd)` call, emitted into numba's builder: for each pass
    of PASS_LANES outputs, zeroed sums, a loop over the block's inputs, and the sums stored."""

    def __init__(self, context, builder, signature, args) -> None:
        super().__init__(context, builder, signature, args)
        self.f32, self.i32, self.i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        self.vec = ir.VectorType(self.f32, _LANES)
        self.fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(self.vec, [self.vec] * 3), f"llvm.fma.v{_LANES}f32"
        )
        self.splat = ir.Constant(ir.VectorType(self.i32, _LANES), [0] * _LANES)

    def vec_at(self, ty, ary, i, j: int):
        """ary[i, j : j + _LANES] as one vector."""
        return self.builder.bitcast(self.at(ty, ary, i, ir.Constant(self.i64, j)), self.vec.as_pointer())

    def emit(self, R: int, halve_odd: bool) -> None:
        for first in range(0, TN, PASS_LANES):  # one pass a PASS_LANES outputs of the tile
            lanes = range(first, first + PASS_LANES, _LANES)
            # the sums live in allocas, which LLVM promotes to registers (SROA): a loop of 16
            # steps of two inputs each, not 32 unrolled, so 12 variants compile in seconds
            sums = [
                [cgutils.alloca_once_value(self.builder, ir.Constant(self.vec, [0.0] * _LANES)) for _ in lanes]
                for _ in range(R)
            ]
            with cgutils.for_range(self.builder, ir.Constant(self.i64, QK // 2)) as loop:
                for odd in (0, 1):
                    self._add_input(loop.index, odd, lanes, sums, halve_odd and bool(odd))
            self._store(sums, lanes)

    def _add_input(self, step, odd: int, lanes: range, sums: list, halve: bool) -> None:
        """sums[i] += x[r0 + i, k0 + k] * w[k, lanes] for input k = 2 step + odd of the block."""
        b, i64 = self.builder, self.i64
        k = b.add(b.mul(step, ir.Constant(i64, 2)), ir.Constant(i64, odd))
        wk = [b.load(self.vec_at(self.w_ty, self.wa, k, j), align=4) for j in lanes]
        col = b.add(self.k0, k)
        for i, row_sums in enumerate(sums):
            xv = self._broadcast_x(i, col, halve)
            for wv, acc in zip(wk, row_sums):
                b.store(b.call(self.fma, [xv, wv, b.load(acc)]), acc)

    def _broadcast_x(self, i: int, col, halve: bool):
        """x[r0 + i, col] (over 16 when halve) in every lane of a vector."""
        b = self.builder
        xk = b.load(self.at(self.x_ty, self.xa, b.add(self.r0, ir.Constant(self.i64, i)), col))
        if halve:
            xk = b.fmul(xk, ir.Constant(self.f32, 0.0625))
        one = b.insert_element(ir.Constant(self.vec, ir.Undefined), xk, ir.Constant(self.i32, 0))
        return b.shuffle_vector(one, ir.Constant(self.vec, ir.Undefined), self.splat)

    def _store(self, sums: list, lanes: range) -> None:
        """blk[i, lanes] = sums[i], for every row i of the block."""
        for i, row_sums in enumerate(sums):
            for acc, j in zip(row_sums, lanes):
                self.builder.store(
                    self.builder.load(acc), self.vec_at(self.blk_ty, self.ba, ir.Constant(self.i64, i), j), align=4
                )
