# B=sequences (one new token each), H=hidden, I=intermediate, V=vocab, Q=query heads, K=kv heads,
# D=head_dim, L=layers, P=pages, S=page_size, M=pages of one sequence (padded to the batch's most),
# NT=tiles of TN output features
"""A decode step of B sequences (one new token each) through every Llama layer and the lm_head,
as one numba call over the GGUF file's Q4_1 / Q8_0 blocks (`kernels.quant`).

As torch ops around the block kernels a decode step costs ~10 ops a layer (RMSNorm, RoPE, the
K/V write, gathers and SDPA, SiLU*up, adds), ~16 us each on 2 cores whatever B: 6.3 ms of a
batch-1 token outside the matmuls, ~40 ms of a 16-sequence step. Here the whole step is loops
numba compiles, threads split each matmul by tiles and attention by (sequence, query head).

Numbers follow transformers' `LlamaForCausalLM` (modeling_llama.py): the matmuls are the block
kernels' tiles (`q4_1_tile`, `q8_0_tile`), bit for bit what `quantized_matmul` computes; RMSNorm,
RoPE and SiLU*up do transformers' fp32 operations (RMSNorm's mean summed in fp64); attention
sums in another order than SDPA (within an ulp or two). Each sequence's numbers depend on its
own row only, so a sequence gets the same bits alone or in any batch.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from kernels.quant import TN, block_sums, q4_1_tile, q8_0_tile

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


# reassociation lets LLVM vectorize the dot products (a sequential sum is add-latency bound:
# 0.93 ms of a 7.8 ms batch-1 step went to attention); the rounding stays within SDPA's own
@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _attend(q, kv, k_blocks, v_blocks, n_ctx, kh, scale, out):  # q [D], kv [P*L*2, S, K, D], out [D]
    # one query head over its kv head's n_ctx keys: softmax(q.k * scale) @ v, as SDPA. q and out
    # are rows of their own: with an offset into a longer row (q[o + i]) numba's negative-index
    # wraparound turned the dot product into gathers, 2x slower
    S, D = kv.shape[1], q.shape[0]
    scores = np.empty(n_ctx, np.float32)
    top = np.float32(-np.inf)
    for p in range(n_ctx):
        key = kv[k_blocks[p // S], p % S, kh]
        s = np.float32(0)
        for i in range(D):
            s += q[i] * key[i]
        scores[p] = s * scale
        top = max(top, scores[p])
    acc = np.zeros(D, np.float32)
    total = np.float32(0)
    for p in range(n_ctx):
        e = np.exp(scores[p] - top)
        total += e
        val = kv[v_blocks[p // S], p % S, kh]
        for i in range(D):
            acc[i] += e * val[i]
    for i in range(D):
        out[i] = acc[i] / total


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def decode_step(
    h, lens, cos, sin_rot, blocks, kv, norms, eps, nq, nk, inter, qkv, o, gate_up, down, head, logits, cycles
):
    """B decode tokens through every layer and the lm_head, in place (one numba call).

    h [B, H] fp32: the tokens' embedding rows (becomes the last residual); lens [B] int64: each
    sequence's context in tokens, the new one included (its position is lens - 1); cos, sin_rot
    [B, D] fp32: RoPE rows at those positions (`kernels.rope_table`); blocks [L, 2, B, M] int64:
    each sequence's K and V page blocks in kv [P*L*2, S, K, D] (`kernels.attention`'s read blocks;
    entries past a sequence's own pages are never read), written at each sequence's position;
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
    half, group, heads = D // 2, nq // nk, nq
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
        for job in numba.prange(B * heads):  # (sequence, query head): each over its own pages
            b, hq = job // heads, job % heads
            _attend(rot[b, hq], kv, blocks[li, 0, b], blocks[li, 1, b], lens[b], hq // group, scale, heads_out[b, hq])
        t = _lap(cycles, 3, t)
        xs = block_sums(attn)
        for tile in numba.prange(o[0].shape[1]):
            q4_1_tile(attn, xs, o[0][li], o[1][li], o[2][li], tile, y_o)
        for b in range(B):
            for i in range(H):
                h[b, i] = h[b, i] + y_o[b, i]
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
        for b in range(B):
            for i in range(H):
                h[b, i] = h[b, i] + y_down[b, i]
        t = _lap(cycles, 6, t)
    _rms_norm_rows(h, norms[L, 0], eps, x)
    t = _lap(cycles, 0, t)
    for tile in numba.prange(head[0].shape[0]):
        q8_0_tile(x, head[0], head[1], tile, logits)
    _lap(cycles, 7, t)
