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
as much as two GEMM libraries differ from each other (`kernels.ref.quantized_matmul_ref` is
the reference the tests hold it to).

The loops are compiled by numba (LLVM, vectorized for the host CPU, 512 bits wide on AVX-512:
`_prefer_512_bit_vectors`), split tiles across numba's threads and release the GIL. Each tile
asks for its bytes ~2 KB before it reads them (`_prefetch`): without that, the 1-row loop waited
on memory for two thirds of its time once the weights were past L2 (Intel Xeon, 2 cores). Every
multiply-add is one explicit FMA (`_fma`), rounded once. Each weight is laid out tile-major,
`[NT, K(/2), TN]`, so a tile's bytes stream in order and the innermost loop runs over TN independent outputs;
each tile's accumulators are its own arrays, which is what lets LLVM vectorize the row loop
(shared ones cost 2.5x at 16 rows). Q4_1 rows go through a tile in groups of up to 4 that
unpack each byte once, in registers; Q8_0 with several rows converts each block to fp32 once,
into a 8 KB buffer that stays in L1, and every row multiplies from it. Every path does the same
operations in the same order, so a row's bits do not depend on the rows beside it (batched decode
gives each sequence what it gets alone).

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
    features = llvm.get_host_cpu_features().flatten()
    if "+avx512f" in features.split(","):
        config["CPU_FEATURES"] = features + ",-prefer-256-bit"


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
def _prefetch(typingctx, arr, index):
    """Ask the CPU to bring element `index` of C-contiguous `arr` (counted flat) into cache
    (`llvm.prefetch`: read, keep in all levels). A hint: never faults, even past the end."""

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


def _q4_1_rows(R: int):
    """A numba function adding tile t of rows r0 .. r0+R-1 of x @ w.T into acc [M, TN]: each
    packed byte is unpacked once, in registers, and used for all R rows (whose block sums stay
    in an [R, TN] buffer in L1). R is fixed when it compiles, so LLVM unrolls the row loops and
    vectorizes over the tile's TN outputs."""

    @numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
    def rows(x, xsum, qs, d, m, t, r0, acc):  # x [M, K] f32, xsum [M, G], qs [NT, K/2, TN] u8
        blk = np.empty((R, TN), np.float32)
        xv = np.empty((R, 2), np.float32)
        q_at, s_at = t * qs.shape[1] * TN, t * d.shape[1] * TN  # the tile's first byte / scale, flat
        for b in range(x.shape[1] // QK):
            blk[:] = 0
            for line in range(0, TN, 16):  # the scales and mins two blocks on
                _prefetch(d, s_at + (b + 2) * TN + line)
                _prefetch(m, s_at + (b + 2) * TN + line)
            for jj in range(QK // 2):
                j = b * (QK // 2) + jj
                _prefetch(qs, q_at + (j + PREFETCH_LINES) * TN)  # a row of the tile is one line
                for i in range(R):
                    # x1 * q_hi as (x1 / 16) * (16 q_hi): the same product (the division is exact)
                    xv[i, 0] = x[r0 + i, 2 * j]
                    xv[i, 1] = x[r0 + i, 2 * j + 1] * np.float32(0.0625)
                for n in range(TN):
                    lo, hi16 = _nibbles(qs[t, j, n])
                    for i in range(R):
                        blk[i, n] = _fma(xv[i, 1], hi16, _fma(xv[i, 0], lo, blk[i, n]))
            for i in range(R):
                s = xsum[r0 + i, b]
                for n in range(TN):
                    acc[r0 + i, n] = _fma(m[t, b, n], s, _fma(d[t, b, n], blk[i, n], acc[r0 + i, n]))

    return rows


_q4_1_rows1, _q4_1_rows2, _q4_1_rows4 = _q4_1_rows(1), _q4_1_rows(2), _q4_1_rows(4)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def q4_1_tile(x, xsum, qs, d, m, t, out):  # x [M, K] f32, xsum [M, G], qs [NT, K/2, TN] u8, out [M, NT*TN]
    """out[:, t*TN : (t+1)*TN] = tile t of x @ w.T, for callers' own numba loops (`_q4_1_matmul`,
    the fused decode step in `engine.models.llama_step`); xsum is `block_sums(x)`.

    Rows go through in groups of 4, then 2, then 1, each group unpacking the tile's bytes once
    (2 rows cost 1.5x one row, 16 rows 10.5x, 576x3072 on one thread, against 2.0x and 10.7x
    with the bytes unpacked to an L1 buffer once for all rows). Every row gets the same bits alone or
    among others, in any group: each block's partial sum runs over j in order as
    s = fma(x_2j+1 / 16, 16 q_2j+1, fma(x_2j, q_2j, s)), then acc = fma(m, xsum, fma(d, s, acc)),
    blocks in order.
    """
    rows = x.shape[0]
    acc = np.zeros((rows, TN), np.float32)
    r0 = 0
    while rows - r0 >= 4:
        _q4_1_rows4(x, xsum, qs, d, m, t, r0, acc)
        r0 += 4
    if rows - r0 >= 2:
        _q4_1_rows2(x, xsum, qs, d, m, t, r0, acc)
        r0 += 2
    if rows - r0 == 1:
        _q4_1_rows1(x, xsum, qs, d, m, t, r0, acc)
    out[:, t * TN : (t + 1) * TN] = acc


@numba.njit(nogil=True, cache=True, boundscheck=False)
def q8_0_tile(x, q, d, t, out):  # x [M, K] f32, q [NT, K, TN] i8, d [NT, G, TN], out [M, NT*TN]
    """out[:, t*TN : (t+1)*TN] = tile t of x @ w.T, for callers' own numba loops. Each output is
    sum over blocks of d * sum_k x_k q_k, as s = fma(x_k, q_k, s) over k in order, then
    acc = fma(d, s, acc) over blocks in order, so a row's bits do not depend on the others."""
    rows, g = x.shape[0], x.shape[1] // QK
    acc = np.zeros((rows, TN), np.float32)
    blk = np.empty(TN, np.float32)
    w = np.empty((QK, TN), np.float32)  # one block of the tile as fp32
    q_at, s_at = t * q.shape[1] * TN, t * g * TN  # the tile's first byte / scale, flat
    for b in range(g):
        for line in range(0, TN, 16):  # the scales two blocks on
            _prefetch(d, s_at + (b + 2) * TN + line)
        for i in range(QK):  # the block after next (2 KB on): a row of the tile is one line
            _prefetch(q, q_at + ((b + 2) * QK + i) * TN)
        if rows == 1:
            blk[:] = 0
            for i in range(QK):
                k = b * QK + i
                xk = x[0, k]
                for n in range(TN):
                    blk[n] = _fma(xk, np.float32(q[t, k, n]), blk[n])
            for n in range(TN):
                acc[0, n] = _fma(d[t, b, n], blk[n], acc[0, n])
            continue
        # convert the block's int8 once for all rows (1.5x at 16 rows, 576x49152, one thread)
        for i in range(QK):
            for n in range(TN):
                w[i, n] = np.float32(q[t, b * QK + i, n])
        for r in range(rows):
            xr = x[r, b * QK : (b + 1) * QK]
            for n in range(TN):
                p = np.float32(0)
                for i in range(QK):
                    p = _fma(xr[i], w[i, n], p)
                blk[n] = p
            for n in range(TN):
                acc[r, n] = _fma(d[t, b, n], blk[n], acc[r, n])
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
    batch-1 step 3.3x slower here (16.6 ms against omp's 5.0 ms, `bench_quant` under
    NUMBA_THREADING_LAYER=workqueue).
    """
    return numba.threading_layer(), numba.get_num_threads()


def quantized_matmul(x: torch.Tensor, w: Q4_1Weight | Q8_0Weight) -> torch.Tensor:
    """x @ w.T for x [M, K] fp32 and a packed GGUF weight [N, K]; returns [M, N] fp32.

    Meant for decode batches: each tile's bytes are read and unpacked once and reused for all M
    rows; past ~128 rows an fp32 GEMM wins (`bench_quant`). Row r of the result does not depend
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
