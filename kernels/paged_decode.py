# B=sequences, Q=query heads, K=kv heads, R=Q/K, D=head_dim, P=pages, L=layers, S=page_size,
# M=pages of one sequence (padded), BR/BS/BD=R, S, D rounded up to powers of two >= 16
"""Paged decode attention as one Triton kernel: one query token a sequence, GQA, over the
page-major KV cache (`kvmesh.engine.kv_layout.LLAMA_PAGE`, [P, L, 2, S, K, D]).

One program serves one sequence and one kv head: it loads that head's R query heads once
([BR, BD], padded rows masked), then walks the sequence's pages in order, one page a step: the
page's K and V tiles ([BS, BD]), scores by one tl.dot, and the online softmax of
FlashAttention (running max and sum, the accumulator rescaled), so each K/V byte is read once
for all R query heads, as vLLM's paged attention and FlashInfer's decode kernels read GQA.
Slots past the context (the last page's tail) are masked to -inf before the softmax.
Not yet: splitting one long context over several programs (flash-decoding), which a GPU needs
to fill its SMs at small batch; several pages a step for pages under 64 tokens.

The kernel is jitted at first launch (kvmesh.kernels.triton_jit) and calls only triton.language
builtins (its row max and sum are tl.reduce with combine functions of its own: tl.max, tl.sum
and tl.cdiv are @triton.jit themselves, fixed in one mode when triton is imported), so
TRITON_INTERPRET=1 set later still runs it on CPU tensors (the unit tests). Reference:
`kvmesh.kernels.ref.paged_decode_attention_ref`; the CPU path the model runs is kvmesh.kernels.attention.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvmesh.kernels.triton_jit import jit


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


def _paged_decode_kernel(
    q_ptr,
    kv_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    layer,
    scale,
    R,
    S,
    D,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kl,
    stride_kv,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_tb,
    stride_tm,
    stride_ob,
    stride_oh,
    stride_od,
    DOT_FP32: tl.constexpr,
    BR: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    n_ctx = tl.load(lens_ptr + b)
    r = tl.arange(0, BR)
    r_ok = r < R
    heads = (kh * R + r).to(tl.int64)  # [BR] query heads reading kv head kh
    d = tl.arange(0, BD)
    d_ok = d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BR, BD]
    if DOT_FP32:
        q = q.to(tl.float32)
    s = tl.arange(0, BS)
    m_i = tl.full((BR,), float("-inf"), tl.float32)
    l_i = tl.full((BR,), 0.0, tl.float32)
    acc = tl.full((BR, BD), 0.0, tl.float32)
    for i in range(0, (n_ctx + S - 1) // S):
        page = tl.load(table_ptr + b * stride_tb + i * stride_tm).to(tl.int64)
        ok = (s < S) & (i * S + s < n_ctx)  # [BS] slots of the context
        base = kv_ptr + page * stride_kp + layer * stride_kl + kh * stride_kh
        offs = s[:, None] * stride_ks + d[None, :] * stride_kd
        tile_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(base + offs, mask=tile_ok, other=0.0)  # [BS, BD]
        v = tl.load(base + stride_kv + offs, mask=tile_ok, other=0.0)
        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [BR, BS]
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _max_combine))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BR, BS], 0 where masked
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
        out,
        mask=r_ok[:, None] & d_ok[None, :],
    )


def paged_decode_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """`paged_decode_attention_triton` in PyTorch ops, on any device and free of host syncs: each
    sequence's pages gathered whole ([B, M*S, K, D]), slots past its context masked, one SDPA
    with GQA (`enable_gqa`). Arguments, result and errors as the Triton kernel's; the softmax in
    q.dtype's SDPA numerics (fp32 for fp32). Unlike the kernel it reads the slots past each
    context (then masks them), so they must hold finite values, as for kvmesh.kernels.attention's
    decode: a NaN there leaks through the mask as 0 * NaN.
    Reference: `kvmesh.kernels.ref.paged_decode_attention_ref`.
    """
    B, Q, D = _check(q, kv_cache, layer, block_table, context_lens)
    S, K = kv_cache.shape[3], kv_cache.shape[4]
    M = block_table.shape[1]
    pages = kv_cache[:, layer][block_table.long()]  # [B, M, 2, S, K, D]
    k = pages[:, :, 0].reshape(B, M * S, K, D).transpose(1, 2)  # [B, K, M*S, D]
    v = pages[:, :, 1].reshape(B, M * S, K, D).transpose(1, 2)
    slots = torch.arange(M * S, device=q.device)
    mask = (slots[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, M*S]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask, enable_gqa=Q != K
    )  # [B, Q, 1, D]
    return out[:, :, 0]


def _check(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_lens: torch.Tensor
) -> tuple[int, int, int]:
    """(B, Q, D) of a paged decode attention call, or ValueError saying which shapes disagree."""
    if q.dim() != 3 or kv_cache.dim() != 6:
        raise ValueError(
            f"q must be [B, Q, D] and kv_cache [P, L, 2, S, K, D], got {list(q.shape)}, {list(kv_cache.shape)}"
        )
    B, Q, D = q.shape
    _P, L, two, _S, K, Dk = kv_cache.shape
    if two != 2 or Dk != D or Q % K:
        raise ValueError(
            f"kv_cache {list(kv_cache.shape)} does not fit q {list(q.shape)} (2 planes, head_dim {D}, Q % K == 0)"
        )
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q and kv_cache must share a dtype, got {q.dtype} and {kv_cache.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or tuple(context_lens.shape) != (B,):
        raise ValueError(
            f"block_table must be [{B}, M] and context_lens [{B}], got {list(block_table.shape)}, "
            f"{list(context_lens.shape)}"
        )
    if not 0 <= layer < L:
        raise ValueError(f"layer must be in [0, {L}), got {layer}")
    return B, Q, D


def _block(n: int) -> int:
    """n rounded up to a power of two, at least 16 (tl.dot's smallest side)."""
    return max(16, triton.next_power_of_2(n))


def paged_decode_attention_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """Attention of one new token a sequence over its pages, by a Triton kernel.

    q [B, Q, D]; kv_cache [P, L, 2, S, K, D] holding every context token's K/V (the new
    token's written already); block_table [B, M] int32/int64 page ids (rows padded past each
    sequence's pages with any id); context_lens [B] int32/int64 tokens of each context (>= 1).
    Returns [B, Q, D] in q.dtype; products and the softmax in fp32 (IEEE fp32 products for fp32
    inputs, fp32 accumulation of 16-bit ones). CUDA tensors, or CPU tensors with
    TRITON_INTERPRET=1.

    Raises ValueError for shapes that disagree (Q not a multiple of K, q and the cache of
    different head_dim or dtype, a block table or lengths of another batch size, a layer out
    of range). Reference: `kvmesh.kernels.ref.paged_decode_attention_ref`.
    """
    B, Q, D = _check(q, kv_cache, layer, block_table, context_lens)
    S, K = kv_cache.shape[3], kv_cache.shape[4]
    out = torch.empty_like(q)
    if B == 0:
        return out
    interpret = triton.knobs.runtime.interpret
    # the interpreter multiplies bf16 bit patterns as integers in tl.dot (triton-lang/triton#11584)
    dot_fp32 = q.dtype == torch.float32 or interpret
    jit(_paged_decode_kernel, interpret)[(B, K)](
        q,
        kv_cache,
        block_table,
        context_lens,
        out,
        layer,
        1.0 / math.sqrt(D),
        Q // K,
        S,
        D,
        *q.stride(),
        *(kv_cache.stride(i) for i in (0, 1, 2, 3, 4, 5)),
        *block_table.stride(),
        *out.stride(),
        DOT_FP32=dot_fp32,
        BR=_block(Q // K),
        BS=_block(S),
        BD=_block(D),
    )
    return out
