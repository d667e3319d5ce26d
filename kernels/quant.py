# M=rows of activations (tokens), K=input features, N=output features, G=K/32 blocks of a row,
# NT=N/TN tiles of TN output features
"""Matmul straight from GGUF's Q4_1 and Q8_0 blocks, for decode on CPU.

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

The loops are compiled by numba (LLVM, vectorized for the host CPU, 512 bits wide on AVX-512:
`_prefer_512_bit_vectors`), split tiles across numba's threads and release the GIL. Each tile
asks for its bytes ~2 KB before it reads them (`prefetch`): without that, the 1-row loop waited
on memory for two thirds of its time once the weights were past L2 (Intel Xeon, 2 cores). Every
multiply-add is one explicit FMA (`_fma`), rounded once. Each weight is laid out tile-major,
`[NT, K(/2), TN]`, so a tile's bytes stream in order and the innermost loop runs over TN independent outputs;
each tile's accumulators are its own arrays, which is what lets LLVM vectorize the row loop
(shared ones cost 2.5x at 16 rows). One row unpacks each byte in registers as it streams by.
Several rows convert each block of the tile to fp32 once, into an 8 KB buffer that stays in L1,
and multiply it into up to 6 rows at a time whose sums stay in registers (`_block_rows`, in passes
of 16 outputs where AVX2 has too few registers for 64: `BLOCK_ROWS`; written
as LLVM vector IR). Every path does the same operations in the same order, so a row's bits do not
depend on the rows beside it (batched decode gives each sequence what it gets alone).

It is one file over 300 lines on purpose: the Q4_1 and Q8_0 tiles, their row-blocked form and the
LLVM intrinsics they share are one kernel family whose paths must stay bit-identical to each other;
split across files, an edit to one path would too easily miss its twins.

After editing this file, delete `engine/models/__pycache__/llama_step.*.nb*`: the fused decode
step compiles these tiles into its own numba cache, whose index checks only llama_step.py's
timestamp, so it would keep running the old tiles (a fresh clone has no cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.binding as llvm
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types as nbtypes
from numba.core import cgutils, registry
from numba.extending import intrinsic

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)


def _host_has_avx512() -> bool:
    """Whether the code numba generates here may use AVX-512 (the host's features, or
    NUMBA_CPU_FEATURES when the user set them)."""
    features = vars(numba.config)["CPU_FEATURES"] or llvm.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


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

QK = 32
"""Inputs per GGUF block (Q4_1 and Q8_0)."""
TN = 64
"""Output features per tile: a tile's accumulators (64 fp32 a row, 4 AVX-512 registers) stay in
L1, and 64 divides every N of SmolLM2 (576, 960, 3072, 49152); other N are zero-padded."""


@dataclass(frozen=True)
class Q4_1Weight:
    """A Linear's Q4_1 weight in kernel layout: w[n, k] = d[n, k//32] * q[n, k] + m[n, k//32].

    qs [NT, K/2, TN] uint8: q of inputs 2j (low nibble) and 2j+1 (high nibble) of each output;
    d, m [NT, G, TN] fp32 (fp16 values, widened exactly). Rows past `out_features` are zero.
    """

    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray
    out_features: int
    in_features: int


@dataclass(frozen=True)
class Q8_0Weight:
    """A Linear's Q8_0 weight in kernel layout: w[n, k] = d[n, k//32] * q[n, k].

    q [NT, K, TN] int8; d [NT, G, TN] fp32 (fp16 values, widened exactly).
    """

    q: np.ndarray
    d: np.ndarray
    out_features: int
    in_features: int


def _tiles(rows: np.ndarray) -> np.ndarray:
    """[N, X] -> [NT, X, TN], zero-padding N up to a multiple of TN."""
    n = rows.shape[0]
    pad = -n % TN
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), rows.dtype)])
    return np.ascontiguousarray(rows.reshape(-1, TN, rows.shape[1]).transpose(0, 2, 1))


def _check_blocks(q: np.ndarray, scales: list[np.ndarray], per_byte: int) -> tuple[int, int]:
    if q.ndim != 2 or any(s.ndim != 2 or s.shape[0] != q.shape[0] for s in scales):
        raise ValueError(
            f"expected 2-D q and scales with one row per output, got {q.shape}, {[s.shape for s in scales]}"
        )
    n, k = q.shape[0], q.shape[1] * per_byte
    if k % QK or any(s.shape[1] != k // QK for s in scales):
        raise ValueError(f"{k} inputs need {k // QK} blocks of {QK} a row, scales have {[s.shape[1] for s in scales]}")
    return n, k


def pack_q4_1(qs: np.ndarray, d: np.ndarray, m: np.ndarray) -> Q4_1Weight:
    """Lay out Q4_1 blocks for `quantized_matmul`.

    qs [N, K/2] uint8 with q[n, 2j] in the low and q[n, 2j+1] in the high nibble of qs[n, j];
    d, m [N, K/32] fp16 or fp32. Raises ValueError when the shapes disagree or K % 32 != 0.
    """
    n, k = _check_blocks(qs, [d, m], 2)
    return Q4_1Weight(_tiles(qs.astype(np.uint8)), _tiles(d.astype(np.float32)), _tiles(m.astype(np.float32)), n, k)


def pack_q8_0(q: np.ndarray, d: np.ndarray) -> Q8_0Weight:
    """Lay out Q8_0 blocks for `quantized_matmul`: q [N, K] int8, d [N, K/32] fp16 or fp32.

    Raises ValueError when the shapes disagree or K % 32 != 0.
    """
    n, k = _check_blocks(q, [d], 1)
    return Q8_0Weight(_tiles(q.astype(np.int8)), _tiles(d.astype(np.float32)), n, k)


PREFETCH_LINES = 32
"""How far ahead of the loop the tiles ask for their weights, in 64-byte cache lines (2 KB). The
hardware prefetcher alone left the loop waiting on memory: 1-row Q4_1 over 60 different 576x3072
matrices (106 MB, past L2), one thread, Intel Xeon: 231 -> 122 us a matrix (8 lines: 161, 64: 125);
the same matrix from L2 runs 105 us with or without."""


@intrinsic
def prefetch(typingctx, arr, index):
    """Ask the CPU to bring element `index` of C-contiguous `arr` (counted flat) into cache
    (`llvm.prefetch`: read, keep in all levels). A hint: never faults, even past the end. For
    numba code (the tiles here, decode attention in `kvmesh.engine.llama.step`)."""

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

    Written as LLVM vector IR: the R x TN sums stay in registers for the whole block and every
    weight vector loaded serves all R rows, which LLVM's loop vectorizer does not find from numba
    loops (it keeps the sums in memory, a load and a store every two FMAs). The
    register blocking of a GEMM micro-kernel (Goto & van de Geijn, "Anatomy of High-Performance
    Matrix Multiplication", 2008), on one 32-input block at a time so the scales apply per block.
    """

    @intrinsic
    def block_rows(typingctx, x, r0, k0, w, blk):
        def codegen(context, builder, signature, args):
            x_ty, _, _, w_ty, blk_ty = signature.args
            xa, wa, ba = (
                context.make_array(ty)(context, builder, args[n]) for ty, n in ((x_ty, 0), (w_ty, 3), (blk_ty, 4))
            )
            f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
            vec = ir.VectorType(f32, _LANES)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fma.v{_LANES}f32"
            )
            splat = ir.Constant(ir.VectorType(i32, _LANES), [0] * _LANES)

            def at(ty, ary, i, j):  # a pointer to ary[i, j]
                return cgutils.get_item_pointer(context, builder, ty, ary, [i, j])

            def vec_at(ty, ary, i, j):  # ary[i, j : j + _LANES] as one vector
                return builder.bitcast(at(ty, ary, i, ir.Constant(i64, j)), vec.as_pointer())

            for first in range(0, TN, PASS_LANES):  # one pass a PASS_LANES outputs of the tile
                lanes = range(first, first + PASS_LANES, _LANES)
                # the sums live in allocas, which LLVM promotes to registers (SROA): a loop of 16
                # steps of two inputs each, not 32 unrolled, so 12 variants compile in seconds
                sums = [
                    [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * _LANES)) for _ in lanes]
                    for _ in range(R)
                ]
                with cgutils.for_range(builder, ir.Constant(i64, QK // 2)) as loop:
                    for odd in (0, 1):
                        k = builder.add(builder.mul(loop.index, ir.Constant(i64, 2)), ir.Constant(i64, odd))
                        wk = [builder.load(vec_at(w_ty, wa, k, j), align=4) for j in lanes]
                        col = builder.add(args[2], k)
                        for i in range(R):
                            xk = builder.load(at(x_ty, xa, builder.add(args[1], ir.Constant(i64, i)), col))
                            if halve_odd and odd:
                                xk = builder.fmul(xk, ir.Constant(f32, 0.0625))
                            one = builder.insert_element(ir.Constant(vec, ir.Undefined), xk, ir.Constant(i32, 0))
                            xv = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), splat)
                            for wv, acc in zip(wk, sums[i]):
                                builder.store(builder.call(fma, [xv, wv, builder.load(acc)]), acc)
                for i in range(R):
                    for acc, j in zip(sums[i], lanes):
                        builder.store(builder.load(acc), vec_at(blk_ty, ba, ir.Constant(i64, i), j), align=4)
            return context.get_dummy_value()

        return nbtypes.none(x, r0, k0, w, blk), codegen

    return block_rows


def _block_rows_any(halve_odd: bool):
    """A numba function `(R, x, r0, k0, w, blk)` calling `_block_rows(R, halve_odd)` for R in 1..BLOCK_ROWS."""
    b1, b2, b3, b4, b5, b6 = (_block_rows(r, halve_odd) for r in range(1, BLOCK_ROWS + 1))

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


_block_rows_q4_1, _block_rows_q8_0 = _block_rows_any(True), _block_rows_any(False)


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


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q4_1_matmul(x, qs, d, m, out):  # x [M, K] f32, qs [NT, K/2, TN] u8, out [M, NT*TN] f32
    xsum = block_sums(x)
    for t in numba.prange(qs.shape[0]):
        q4_1_tile(x, xsum, qs, d, m, t, out)


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


def quantized_matmul(x: torch.Tensor, w: Q4_1Weight | Q8_0Weight) -> torch.Tensor:
    """x @ w.T for x [M, K] fp32 and a packed GGUF weight [N, K]; returns [M, N] fp32.

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
    if isinstance(w, Q4_1Weight):
        _q4_1_matmul(xn, w.qs, w.d, w.m, out.numpy())
    else:
        _q8_0_matmul(xn, w.q, w.d, out.numpy())
    return out if tiles * TN == w.out_features else out[:, : w.out_features]
