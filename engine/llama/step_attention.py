# B=sequences (one new token each), Q=query heads, K=kv heads, R=query heads of one kv head (Q/K),
# D=head_dim, P=pages, L=layers, S=page_size, M=pages of one sequence (padded to the batch's most),
# J=attention jobs (sequence, kv head, part of its keys)
"""The attention of the fused Llama decode step (kvmesh.engine.llama.step.decode_step): each
sequence's new token over the K/V in its own pages, as numba kernels.

A sequence's keys are split into parts of SPLIT_TOKENS (flash-decoding, Dao et al. 2023): each
(sequence, kv head, part) is a job of its own on numba's threads, and the parts merge by their
maxima and sums, as flash attention rescales. Each key and value is read once for all the query
heads of its kv head (GQA). Attention sums in another order than SDPA (within an ulp or two);
the split depends on a sequence's own length only, so its bits do not depend on the batch.

Pages hold fp32 or bf16 (`--dtype`): a bf16 page is handed to numba as its bits (uint16, numpy
has no bf16), which `kv_load` widens to fp32 as it reads (exact) and `kv_store` rounds to, to
nearest even as torch's `.to(torch.bfloat16)` does; every sum stays fp32. numba compiles each
kernel once per page dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba.core import types as nbtypes
from numba.extending import intrinsic

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant import prefetch

SPLIT_TOKENS = 512
"""Context tokens one attention job covers: a sequence's keys are split into parts of this many,
each part a job of its own (flash-decoding, Dao et al. 2023), merged by their maxima and sums.
With 3 kv heads a single sequence was 3 jobs for 2 threads; a 2048-token context is now 12. The
split depends on a sequence's own length only, so its bits do not depend on the batch."""

PREFETCH_PAGES = 2
"""How many pages ahead attention asks for a kv head's keys and values. A 2048-token context,
batch 1, 2 cores, Intel Xeon (`/tmp` script reading the step's cycle counters): attention
10.9 ms a step without, 10.8 at 1 page, 9.5 at 2, 9.8 at 4."""


class AttentionJobs(NamedTuple):
    """One step's attention jobs, the same in every layer (`plan_jobs`), with their scratch.

    Sequence b's kv head kh, part k of its keys, is job first[b] + kh * parts_of[b] + k."""

    parts_of: np.ndarray  # [B] int64 parts of each sequence's keys
    first: np.ndarray  # [B] int64 each sequence's first job
    seq: np.ndarray  # [J] int64 the sequence of each job
    kv_head: np.ndarray  # [J] int64 its kv head
    part: np.ndarray  # [J] int64 its part of the keys
    top: np.ndarray  # [J, R] fp32 scratch: each query head's largest score in the part
    total: np.ndarray  # [J, R] fp32 scratch: sum of exp(score - top)
    acc: np.ndarray  # [J, R, D] fp32 scratch: sum of exp(score - top) * v


@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return nbtypes.float32(nbtypes.int32), codegen


@intrinsic
def kv_load(typingctx, x):
    """A page element as fp32: an fp32 element itself, a bf16 one (its 16 bits, uint16) widened
    exactly (the bits become an fp32's upper half)."""
    if isinstance(x, nbtypes.Float) and x.bitwidth == 32:
        return nbtypes.float32(x), lambda context, builder, signature, args: args[0]
    if isinstance(x, nbtypes.Integer) and x.bitwidth == 16:

        def widen(context, builder, signature, args):
            bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(bits, ir.FloatType())

        return nbtypes.float32(x), widen
    return None


@intrinsic
def kv_store(typingctx, value, pages):
    """fp32 `value` as an element of `pages` (an array of fp32, or of bf16 bits as uint16): itself,
    or rounded to the nearest bf16, ties to even (torch's conversion; NaN is not expected here)."""
    dtype = getattr(pages, "dtype", None)
    if dtype == nbtypes.float32:
        return nbtypes.float32(value, pages), lambda context, builder, signature, args: args[0]
    if isinstance(dtype, nbtypes.Integer) and dtype.bitwidth == 16:

        def narrow(context, builder, signature, args):
            i32 = ir.IntType(32)
            bits = builder.bitcast(args[0], i32)
            lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lsb)
            return builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))

        return dtype(value, pages), narrow
    return None


@numba.njit(nogil=True, cache=True, inline="always")
def _exp_nonpositive(x):  # exp(x) for x <= 0 in fp32, within 1 ulp (Cephes' expf)
    # written out, not np.exp: numba calls libm's expf one value at a time, while this
    # vectorizes with its loop (a 16-sequence step's attention 4.5 -> 3.3 ms); max error over
    # [-87, 0]: 0.99 ulp, numpy's fp32 exp 2.4 ulp. Below -87 the result would be denormal: it
    # is clamped there (exp(-87) = 1.6e-38, nothing next to the row's largest score's 1)
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)  # x - n ln2 in two parts (Cody-Waite), exact first
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # * 2^n


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_head(kv, blk, kh):  # ask for kv head kh's rows of page block blk (S x D fp32)
    S, K, D = kv.shape[1], kv.shape[2], kv.shape[3]
    for slot in range(S):
        at = ((blk * S + slot) * K + kh) * D
        for line in range(0, D, 16):  # 16 fp32 a 64-byte line
            prefetch(kv, at + line)


# reassociation lets LLVM vectorize the dot products (a sequential sum is add-latency bound:
# 0.93 ms of a 7.8 ms batch-1 step went to attention); the rounding stays within SDPA's own
@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _attend_part(q, kv, k_blocks, v_blocks, p0, p1, kh, scale, top, total, acc):
    # the R query heads of kv head kh (q [R, D]) over keys p0 .. p1-1 (p0 a multiple of the page
    # size): each head's largest score top [R], sum of exp(score - top) total [R] and
    # sum of exp(score - top) * v acc [R, D]. Each key and value is read once for all R heads
    # (GQA); q and acc rows are arrays of their own: numba's negative-index wraparound on an
    # offset into a longer row (q[o + i]) turned the dot product into gathers, 2x slower
    S, R, D = kv.shape[1], q.shape[0], q.shape[1]
    n = p1 - p0
    qs = np.empty((R, D), np.float32)
    qs[:, :] = q
    scores = np.empty((R, n), np.float32)
    top[:] = -np.inf
    j = 0
    last = (p1 + S - 1) // S
    for page in range(p0 // S, last):
        blk = k_blocks[page]
        if page + PREFETCH_PAGES < last:
            _prefetch_head(kv, k_blocks[page + PREFETCH_PAGES], kh)
        for slot in range(min(S, p1 - page * S)):
            key = kv[blk, slot, kh]
            for r in range(R):
                qr = qs[r]
                dot = np.float32(0)
                for i in range(D):
                    dot += qr[i] * kv_load(key[i])
                dot *= scale
                scores[r, j] = dot
                top[r] = max(top[r], dot)
            j += 1
    for r in range(R):
        m, sum_e = top[r], np.float32(0)
        for j in range(n):
            e = _exp_nonpositive(scores[r, j] - m)
            scores[r, j] = e
            sum_e += e
        total[r] = sum_e
    acc[:, :] = 0
    j = 0
    for page in range(p0 // S, last):
        blk = v_blocks[page]
        if page + PREFETCH_PAGES < last:
            _prefetch_head(kv, v_blocks[page + PREFETCH_PAGES], kh)
        for slot in range(min(S, p1 - page * S)):
            val = kv[blk, slot, kh]
            for r in range(R):
                e, ar = scores[r, j], acc[r]
                for i in range(D):
                    ar[i] += e * kv_load(val[i])
            j += 1


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _merge_parts(top, total, acc, out):
    # one sequence's kv head from its parts (top, total [parts, R], acc [parts, R, D]) into its
    # R query heads' outputs out [R, D]: softmax over all keys, as flash attention's rescaling
    parts, R, D = acc.shape
    for r in range(R):
        m = top[0, r]
        for k in range(1, parts):
            m = max(m, top[k, r])
        sum_e = np.float32(0)
        for i in range(D):
            out[r, i] = 0
        for k in range(parts):
            w = _exp_nonpositive(top[k, r] - m)
            sum_e += total[k, r] * w
            for i in range(D):
                out[r, i] += acc[k, r, i] * w
        for i in range(D):
            out[r, i] = out[r, i] / sum_e


@numba.njit(nogil=True, cache=True, boundscheck=False)
def plan_jobs(lens, nk, group, D):
    """The attention jobs of B sequences of lens [B] int64 context tokens with nk kv heads of
    `group` query heads each, head_dim D: an `AttentionJobs`, its scratch uninitialized."""
    B = lens.shape[0]
    parts_of = (lens + SPLIT_TOKENS - 1) // SPLIT_TOKENS
    job_first = np.zeros(B, np.int64)
    for b in range(1, B):
        job_first[b] = job_first[b - 1] + nk * parts_of[b - 1]
    jobs = job_first[B - 1] + nk * parts_of[B - 1]
    job_seq, job_kv_head, job_part = np.empty(jobs, np.int64), np.empty(jobs, np.int64), np.empty(jobs, np.int64)
    for b in range(B):
        for kh in range(nk):
            for k in range(parts_of[b]):
                job = job_first[b] + kh * parts_of[b] + k
                job_seq[job], job_kv_head[job], job_part[job] = b, kh, k
    part_top, part_total = np.empty((jobs, group), np.float32), np.empty((jobs, group), np.float32)
    part_acc = np.empty((jobs, group, D), np.float32)
    return AttentionJobs(parts_of, job_first, job_seq, job_kv_head, job_part, part_top, part_total, part_acc)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def attend_pages(rot, kv, k_blocks, v_blocks, lens, jobs, heads_out):
    """One layer's attention of B new tokens over their sequences' pages, into heads_out [B, Q, D].

    rot [B, Q + K, D] fp32: the tokens' rotated queries, then keys; kv [P*L*2, S, K, D] fp32, or
    bf16 as uint16 bits, the pages (this token's K/V already written); k_blocks, v_blocks [B, M] int64 each sequence's
    K and V page blocks of this layer; lens [B] int64 context tokens; jobs from `plan_jobs`."""
    B, nq, nk = heads_out.shape[0], heads_out.shape[1], kv.shape[2]
    group = nq // nk
    parts_of, job_first, job_seq, job_kv_head, job_part = jobs.parts_of, jobs.first, jobs.seq, jobs.kv_head, jobs.part
    part_top, part_total, part_acc = jobs.top, jobs.total, jobs.acc
    scale = np.float32(1 / np.sqrt(kv.shape[3]))
    for job in numba.prange(job_seq.shape[0]):  # (sequence, kv head, part of its keys)
        b, kh, k = job_seq[job], job_kv_head[job], job_part[job]
        p0 = k * SPLIT_TOKENS
        _attend_part(
            rot[b, kh * group : (kh + 1) * group],
            kv,
            k_blocks[b],
            v_blocks[b],
            p0,
            min(lens[b], p0 + SPLIT_TOKENS),
            kh,
            scale,
            part_top[job],
            part_total[job],
            part_acc[job],
        )
        if parts_of[b] == 1:  # the whole context in one part: its own "merge", in this job
            _merge_parts(
                part_top[job : job + 1],
                part_total[job : job + 1],
                part_acc[job : job + 1],
                heads_out[b, kh * group : (kh + 1) * group],
            )
    if job_seq.shape[0] > B * nk:  # a second parallel region (a barrier) only where some context has parts to merge
        for bk in numba.prange(B * nk):
            b, kh = bk // nk, bk % nk
            if parts_of[b] > 1:
                first = job_first[b] + kh * parts_of[b]
                _merge_parts(
                    part_top[first : first + parts_of[b]],
                    part_total[first : first + parts_of[b]],
                    part_acc[first : first + parts_of[b]],
                    heads_out[b, kh * group : (kh + 1) * group],
                )
