# B=sequences (one new token each), H=hidden, I=intermediate, V=vocab, Q=query heads, K=kv heads,
# D=head_dim, L=layers, P=pages, S=page_size, M=pages of one sequence (padded to the batch's most),
# NT=tiles of TN output features
"""A decode step of B sequences (one new token each) through every Llama layer and the lm_head,
as one numba call over the GGUF file's Q4_1 / Q8_0 blocks (`kvmesh.kernels.quant`).

As torch ops around the block kernels a decode step costs ~10 ops a layer (RMSNorm, RoPE, the
K/V write, gathers and SDPA, SiLU*up, adds), ~16 us each on 2 cores whatever B: 6.3 ms of a
batch-1 token outside the matmuls, ~40 ms of a 16-sequence step. Here the whole step is loops
numba compiles, threads split each matmul by tiles and attention by (sequence, kv head, part of
its keys).

Numbers follow transformers' `LlamaForCausalLM` (modeling_llama.py): the matmuls are the block
kernels' tiles (`q4_1_tile`, `q8_0_tile`), bit for bit what `quantized_matmul` computes; RMSNorm,
RoPE and SiLU*up do transformers' fp32 operations (RMSNorm's mean summed in fp64); attention
sums in another order than SDPA (within an ulp or two). Each sequence's numbers depend on its
own row only, so a sequence gets the same bits alone or in any batch.

Over 300 lines on purpose: it is one fused numba step; the helpers above `decode_step` are
pieces inlined into its one compiled call, read with it rather than in files of their own.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant import TN, block_sums, prefetch, q4_1_tile, q8_0_tile

STEP_PARTS = (
    "RMSNorm",
    "matmul q/k/v",
    "RoPE",
    "attention over pages",
    "matmul o",
    "matmul MLP gate/up",
    "matmul MLP down",
    "matmul lm_head",
)
"""The parts `decode_step` counts cycles of, in the order of `LlamaModel.step_cycles`. The K/V
write counts with attention, each residual add with the matmul before it, and SiLU*up with
gate/up: each thread applies it to the gate and up tiles it just computed."""


@intrinsic
def _rdtsc(typingctx):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter"
        )
        return builder.call(fn, [])

    return nbtypes.int64(), codegen


@numba.njit(nogil=True, cache=True)
def read_cycles() -> int:
    """The CPU's time-stamp counter (cycles), which the step's profiling counts in."""
    return _rdtsc()  # type: ignore[call-arg]  # an intrinsic: numba supplies typingctx


@numba.njit(nogil=True, cache=True, inline="always")
def _lap(cycles, part, start):  # add the cycles since start to cycles[part] when profiling
    if cycles.shape[0] == 0:
        return start
    now = _rdtsc()
    cycles[part] += now - start
    return now


@numba.njit(nogil=True, cache=True, inline="always")
def _add_rows(h, y):  # h [B, H] += y[:, :H]: a projection's output into the residual stream
    for b in range(h.shape[0]):
        for i in range(h.shape[1]):
            h[b, i] = h[b, i] + y[b, i]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _rms_norm_rows(h, w, eps, out):  # h, out [B, H], w [H]
    # transformers: fp32 squares, their mean (summed here in fp64), rsqrt, then w * (h * r)
    for b in range(h.shape[0]):
        ss = 0.0
        for i in range(h.shape[1]):
            ss += np.float32(h[b, i] * h[b, i])
        r = np.float32(1) / np.sqrt(np.float32(np.float32(ss / h.shape[1]) + eps))
        for i in range(h.shape[1]):
            out[b, i] = w[i] * (h[b, i] * r)


SPLIT_TOKENS = 512
"""Context tokens one attention job covers: a sequence's keys are split into parts of this many,
each part a job of its own (flash-decoding, Dao et al. 2023), merged by their maxima and sums.
With 3 kv heads a single sequence was 3 jobs for 2 threads; a 2048-token context is now 12. The
split depends on a sequence's own length only, so its bits do not depend on the batch."""


@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return nbtypes.float32(nbtypes.int32), codegen


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


PREFETCH_PAGES = 2
"""How many pages ahead attention asks for a kv head's keys and values. A 2048-token context,
batch 1, 2 cores, Intel Xeon (`/tmp` script reading the step's cycle counters): attention
10.9 ms a step without, 10.8 at 1 page, 9.5 at 2, 9.8 at 4."""


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
                    dot += qr[i] * key[i]
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
                    ar[i] += e * val[i]
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


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def decode_step(
    h, lens, cos, sin_rot, blocks, kv, norms, eps, nq, nk, inter, qkv, o, gate_up, down, head, logits, cycles
):
    """B decode tokens through every layer and the lm_head, in place (one numba call).

    h [B, H] fp32: the tokens' embedding rows (becomes the last residual); lens [B] int64: each
    sequence's context in tokens, the new one included (its position is lens - 1); cos, sin_rot
    [B, D] fp32: RoPE rows at those positions (`kernels.rope_table`); blocks [L, 2, B, M] int64:
    each sequence's K and V page blocks in kv [P*L*2, S, K, D] (`kvmesh.engine.kv_layout.LLAMA_PAGE` seen
    as `kvmesh.kernels.attention`'s read blocks; entries past a sequence's own pages are never read), written at each sequence's position;
    norms [L + 1, 2, H]: the input and post-attention norms, then the final norm twice; qkv, o,
    gate_up, down: (qs, d, m) of the layers' Q4_1 weights stacked [L, NT, ...] (gate_up's gate rows
    first, `inter` of them, a multiple of TN); head (q, d) of the Q8_0 lm_head; logits [B, NT*TN]
    fp32 out; cycles [len(STEP_PARTS)] int64 accumulates each part's CPU cycles, or is empty.
    Raises nothing: the caller checks shapes (`LlamaModel`).
    """
    L, B, H, S, D = norms.shape[0] - 1, h.shape[0], h.shape[1], kv.shape[1], kv.shape[3]
    x = np.empty((B, H), np.float32)
    y_qkv = np.empty((B, qkv[0].shape[1] * TN), np.float32)
    rot = np.empty((B, nq + nk, D), np.float32)
    heads_out = np.empty((B, nq, D), np.float32)
    attn = heads_out.reshape(B, nq * D)  # the same memory, as the o projection's input rows
    y_o = np.empty((B, o[0].shape[1] * TN), np.float32)
    y_gu = np.empty((B, gate_up[0].shape[1] * TN), np.float32)
    act = np.empty((B, inter), np.float32)
    y_down = np.empty((B, down[0].shape[1] * TN), np.float32)
    half, group = D // 2, nq // nk
    # attention jobs: sequence b's kv head kh, part k of its keys, at job_first[b] + kh * parts_of[b] + k
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
    split = jobs > B * nk
    scale = np.float32(1 / np.sqrt(D))
    t = _rdtsc() if cycles.shape[0] else 0
    for li in range(L):
        _rms_norm_rows(h, norms[li, 0], eps, x)
        t = _lap(cycles, 0, t)
        xs = block_sums(x)
        for tile in numba.prange(qkv[0].shape[1]):
            q4_1_tile(x, xs, qkv[0][li], qkv[1][li], qkv[2][li], tile, y_qkv)
        t = _lap(cycles, 1, t)
        for b in range(B):  # x * cos + swap_halves(x) * sin_rot, as `apply_rotary`
            for hd in range(nq + nk):
                for i in range(D):
                    c = hd * D
                    rot[b, hd, i] = y_qkv[b, c + i] * cos[b, i] + y_qkv[b, c + (i + half) % D] * sin_rot[b, i]
        t = _lap(cycles, 2, t)
        for b in range(B):
            page, slot = (lens[b] - 1) // S, (lens[b] - 1) % S
            kb, vb = blocks[li, 0, b, page], blocks[li, 1, b, page]
            for kh in range(nk):
                for i in range(D):
                    kv[kb, slot, kh, i] = rot[b, nq + kh, i]
                    kv[vb, slot, kh, i] = y_qkv[b, (nq + nk + kh) * D + i]
        for job in numba.prange(jobs):  # (sequence, kv head, part of its keys)
            b, kh, k = job_seq[job], job_kv_head[job], job_part[job]
            p0 = k * SPLIT_TOKENS
            _attend_part(
                rot[b, kh * group : (kh + 1) * group],
                kv,
                blocks[li, 0, b],
                blocks[li, 1, b],
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
        if split:  # a second parallel region (a barrier) only where some context has parts to merge
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
        t = _lap(cycles, 3, t)
        xs = block_sums(attn)
        for tile in numba.prange(o[0].shape[1]):
            q4_1_tile(attn, xs, o[0][li], o[1][li], o[2][li], tile, y_o)
        _add_rows(h, y_o)
        t = _lap(cycles, 4, t)
        _rms_norm_rows(h, norms[li, 1], eps, x)
        t = _lap(cycles, 0, t)
        xs = block_sums(x)
        for tile in numba.prange(inter // TN):  # a gate tile, its up tile, then silu(gate) * up
            q4_1_tile(x, xs, gate_up[0][li], gate_up[1][li], gate_up[2][li], tile, y_gu)
            q4_1_tile(x, xs, gate_up[0][li], gate_up[1][li], gate_up[2][li], tile + inter // TN, y_gu)
            for b in range(B):
                for i in range(tile * TN, (tile + 1) * TN):  # as `silu_and_mul`
                    g = y_gu[b, i]
                    act[b, i] = g / (np.float32(1) + np.exp(-g)) * y_gu[b, inter + i]
        t = _lap(cycles, 5, t)
        xs = block_sums(act)
        for tile in numba.prange(down[0].shape[1]):
            q4_1_tile(act, xs, down[0][li], down[1][li], down[2][li], tile, y_down)
        _add_rows(h, y_down)
        t = _lap(cycles, 6, t)
    _rms_norm_rows(h, norms[L, 0], eps, x)
    t = _lap(cycles, 0, t)
    for tile in numba.prange(head[0].shape[0]):
        q8_0_tile(x, head[0], head[1], tile, logits)
    _lap(cycles, 7, t)
