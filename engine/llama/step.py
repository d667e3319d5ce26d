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
kernels' tiles (`q4_1_tile`, `q8_0_tile`; `q4_1_tile_a8` for the layers with
`StepWeights.int8_activations`), bit for bit what `quantized_matmul` computes; RMSNorm,
RoPE and SiLU*up do transformers' fp32 operations (RMSNorm's mean summed in fp64); attention
sums in another order than SDPA (within an ulp or two). Each sequence's numbers depend on its
own row only, so a sequence gets the same bits alone or in any batch.

`decode_step` takes two records: `StepWeights`, the same every step, and `StepBatch`, one
step's sequences. It runs the layers' stages below in order; attention over each sequence's
pages is kvmesh.engine.llama.step_attention (both files are in kvmesh.kernels.numba_cache's
NUMBA_SOURCES: the step compiles their kernels into its own cached code).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbtypes
from numba.extending import intrinsic

from kvmesh.engine.llama.step_attention import attend_pages, kv_store, plan_jobs
from kvmesh.kernels import numba_cache  # noqa: F401  (before any njit(cache=True): the machine-wide cache)
from kvmesh.kernels.quant import TN, block_sums, q4_1_tile, q8_0_tile
from kvmesh.kernels.quant_a8 import q4_1_tile_a8, quantize_rows_q8

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


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _rope_rows(y_qkv, cos, sin_rot, nq, nk, rot):  # rot [B, Q+K, D]: the q and k heads of y_qkv rotated
    D = rot.shape[2]
    half = D // 2
    for b in range(rot.shape[0]):  # x * cos + swap_halves(x) * sin_rot, as `apply_rotary`
        for hd in range(nq + nk):
            for i in range(D):
                c = hd * D
                rot[b, hd, i] = y_qkv[b, c + i] * cos[b, i] + y_qkv[b, c + (i + half) % D] * sin_rot[b, i]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _write_kv(kv, k_blocks, v_blocks, lens, rot, y_qkv, nq, nk):  # each token's K (rotated) and V at its position
    S, D = kv.shape[1], kv.shape[3]
    for b in range(rot.shape[0]):
        page, slot = (lens[b] - 1) // S, (lens[b] - 1) % S
        kb, vb = k_blocks[b, page], v_blocks[b, page]
        for kh in range(nk):
            for i in range(D):
                kv[kb, slot, kh, i] = kv_store(rot[b, nq + kh, i], kv)
                kv[vb, slot, kh, i] = kv_store(y_qkv[b, (nq + nk + kh) * D + i], kv)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q4_1_rows_fp32(x, qs, d, m, y):  # y [B, NT*TN] = x [B, in] @ one layer's Q4_1 weight, a tile a thread
    xs = block_sums(x)
    for tile in numba.prange(qs.shape[0]):
        q4_1_tile(x, xs, qs, d, m, tile, y)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q4_1_rows_a8(x, qs, d, m, y):  # the same with x's rows as int8 blocks (`kvmesh.kernels.quant_a8`)
    xq, xd, xs = quantize_rows_q8(x)
    for tile in numba.prange(qs.shape[0]):
        q4_1_tile_a8(xq, xd, xs, qs, d, m, tile, y)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _q4_1_rows(x, qs, d, m, y, a8):  # y = x @ the weight, with int8 activations when a8
    if a8:
        _q4_1_rows_a8(x, qs, d, m, y)
    else:
        _q4_1_rows_fp32(x, qs, d, m, y)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _silu_tile(y_gu, inter, tile, act):  # act[:, tile's columns] = silu(gate) * up, as `silu_and_mul`
    for b in range(y_gu.shape[0]):
        for i in range(tile * TN, (tile + 1) * TN):
            g = y_gu[b, i]
            act[b, i] = g / (np.float32(1) + np.exp(-g)) * y_gu[b, inter + i]


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _gate_up_silu_fp32(x, qs, d, m, inter, y_gu, act):  # act [B, I] = silu(x @ gate) * (x @ up)
    xs = block_sums(x)
    for tile in numba.prange(inter // TN):  # a gate tile, its up tile, then silu(gate) * up
        q4_1_tile(x, xs, qs, d, m, tile, y_gu)
        q4_1_tile(x, xs, qs, d, m, tile + inter // TN, y_gu)
        _silu_tile(y_gu, inter, tile, act)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _gate_up_silu_a8(x, qs, d, m, inter, y_gu, act):  # the same with x's rows as int8 blocks
    xq, xd, xs = quantize_rows_q8(x)
    for tile in numba.prange(inter // TN):
        q4_1_tile_a8(xq, xd, xs, qs, d, m, tile, y_gu)
        q4_1_tile_a8(xq, xd, xs, qs, d, m, tile + inter // TN, y_gu)
        _silu_tile(y_gu, inter, tile, act)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _gate_up_silu(x, qs, d, m, inter, y_gu, act, a8):
    if a8:
        _gate_up_silu_a8(x, qs, d, m, inter, y_gu, act)
    else:
        _gate_up_silu_fp32(x, qs, d, m, inter, y_gu, act)


@numba.njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _q8_0_rows(x, q, d, logits):  # logits [B, NT*TN] = x [B, H] @ the Q8_0 lm_head, a tile a thread
    for tile in numba.prange(q.shape[0]):
        q8_0_tile(x, q, d, tile, logits)


class StepWeights(NamedTuple):
    """What `decode_step` reads and never writes, the same from step to step (`LlamaModel` stacks
    it once at load; the layers keep views of its arrays). A NamedTuple: numba's frozen record,
    where a dataclass cannot enter a compiled call."""

    norms: np.ndarray
    """[L + 1, 2, H] fp32: each layer's input and post-attention norms, then the final norm twice."""
    eps: float
    """RMSNorm's epsilon."""
    num_heads: int
    """Q, query heads."""
    num_kv_heads: int
    """K, kv heads."""
    intermediate: int
    """I, the MLP's width: gate_up's first I output rows are the gate's; a multiple of TN."""
    qkv: tuple[np.ndarray, ...]
    """(qs, d, m) of the layers' fused q/k/v Q4_1 weights, stacked [L, NT, ...]."""
    o: tuple[np.ndarray, ...]
    """(qs, d, m) of the layers' o projections, stacked [L, NT, ...]."""
    gate_up: tuple[np.ndarray, ...]
    """(qs, d, m) of the layers' fused gate/up projections (gate rows first), stacked [L, NT, ...]."""
    down: tuple[np.ndarray, ...]
    """(qs, d, m) of the layers' down projections, stacked [L, NT, ...]."""
    head: tuple[np.ndarray, ...]
    """(q, d) of the Q8_0 lm_head [NT, ...]: its logits are NT*TN wide, V padded to tiles."""
    int8_activations: bool
    """The layers' matmuls take their inputs as int8 blocks (`kvmesh.kernels.quant_a8`,
    `--quantization int8`); False: fp32. The lm_head takes fp32 either way."""


class StepBatch(NamedTuple):
    """One decode step's B sequences: what `decode_step` reads, and writes in place."""

    h: np.ndarray
    """[B, H] fp32: the tokens' embedding rows; becomes the last residual."""
    lens: np.ndarray
    """[B] int64: each sequence's context in tokens, the new one included (its position is lens - 1)."""
    cos: np.ndarray
    """[B, D] fp32: RoPE rows at those positions (`kernels.rope_table`)."""
    sin_rot: np.ndarray
    """[B, D] fp32: the sin rows, likewise."""
    blocks: np.ndarray
    """[L, 2, B, M] int64: each sequence's K and V page blocks in kv (entries past a sequence's
    own pages are never read)."""
    kv: np.ndarray
    """[P*L*2, S, K, D] fp32, or bf16 pages as their bits (uint16): the pages, `kvmesh.engine.kv_layout.LLAMA_PAGE` seen as
    `kvmesh.kernels.attention`'s read blocks; written at each sequence's position."""
    logits: np.ndarray
    """[B, NT*TN] fp32, out."""
    cycles: np.ndarray
    """[len(STEP_PARTS)] int64: accumulates each part's CPU cycles, or is empty (nothing counted)."""


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_step(batch, weights):
    """B decode tokens through every layer and the lm_head, in place (one numba call).

    batch: a `StepBatch` (its h, kv, logits and cycles are written); weights: the model's
    `StepWeights`. Raises nothing: the caller checks shapes (`LlamaModel`).
    """
    h, lens, kv, cycles, w = batch.h, batch.lens, batch.kv, batch.cycles, weights
    L, B, H, D = w.norms.shape[0] - 1, h.shape[0], h.shape[1], kv.shape[3]
    nq, nk, inter, a8 = w.num_heads, w.num_kv_heads, w.intermediate, w.int8_activations
    x = np.empty((B, H), np.float32)
    y_qkv = np.empty((B, w.qkv[0].shape[1] * TN), np.float32)
    rot = np.empty((B, nq + nk, D), np.float32)
    heads_out = np.empty((B, nq, D), np.float32)
    attn = heads_out.reshape(B, nq * D)  # the same memory, as the o projection's input rows
    y_o = np.empty((B, w.o[0].shape[1] * TN), np.float32)
    y_gu = np.empty((B, w.gate_up[0].shape[1] * TN), np.float32)
    act = np.empty((B, inter), np.float32)
    y_down = np.empty((B, w.down[0].shape[1] * TN), np.float32)
    jobs = plan_jobs(lens, nk, nq // nk, D)
    t = _rdtsc() if cycles.shape[0] else 0
    for li in range(L):
        _rms_norm_rows(h, w.norms[li, 0], w.eps, x)
        t = _lap(cycles, 0, t)
        _q4_1_rows(x, w.qkv[0][li], w.qkv[1][li], w.qkv[2][li], y_qkv, a8)
        t = _lap(cycles, 1, t)
        _rope_rows(y_qkv, batch.cos, batch.sin_rot, nq, nk, rot)
        t = _lap(cycles, 2, t)
        _write_kv(kv, batch.blocks[li, 0], batch.blocks[li, 1], lens, rot, y_qkv, nq, nk)
        attend_pages(rot, kv, batch.blocks[li, 0], batch.blocks[li, 1], lens, jobs, heads_out)
        t = _lap(cycles, 3, t)
        _q4_1_rows(attn, w.o[0][li], w.o[1][li], w.o[2][li], y_o, a8)
        _add_rows(h, y_o)
        t = _lap(cycles, 4, t)
        _rms_norm_rows(h, w.norms[li, 1], w.eps, x)
        t = _lap(cycles, 0, t)
        _gate_up_silu(x, w.gate_up[0][li], w.gate_up[1][li], w.gate_up[2][li], inter, y_gu, act, a8)
        t = _lap(cycles, 5, t)
        _q4_1_rows(act, w.down[0][li], w.down[1][li], w.down[2][li], y_down, a8)
        _add_rows(h, y_down)
        t = _lap(cycles, 6, t)
    _rms_norm_rows(h, w.norms[L, 0], w.eps, x)
    t = _lap(cycles, 0, t)
    _q8_0_rows(x, w.head[0], w.head[1], batch.logits)
    _lap(cycles, 7, t)
