# T=tokens, H=hidden, I=intermediate, X=heads, L=layers, P=pages, S=page_size, N=context tokens,
# Q=query heads, K=kv heads, D=head_dim
"""Plain, slow PyTorch references for the kernels: what `ops.py` and `attention.py` must equal.

The pointwise ones are transformers' Llama code (modeling_llama.py) restated; paged attention
walks every token and page in Python loops so its indexing can be read at a glance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm.forward`: x [T, H], weight [H] -> [T, H]."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rope_cos_sin_ref(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `LlamaRotaryEmbedding` (default rope): positions [T] -> cos, sin [T, D]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` for one of q/k: x [T, X, D], cos/sin [T, D]."""

    def rotate_half(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2 :]
        return torch.cat((-t2, t1), dim=-1)

    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """transformers' `LlamaMLP` activation: x [T, 2I] = [gate, up] -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def paged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Write new K/V into the page-major cache, then causal GQA attention, one token at a time.

    q [T, Q, D], k/v [T, K, D] for the sequences' new tokens back to back; kv_cache
    [P, L, 2, S, K, D] (`kvmesh.engine.kv_layout.LLAMA_PAGE`) is written in place. Token j of sequence b sits at position
    num_computed[b] + j, in page block_ids[b][pos // S], slot pos % S. Returns [T, Q*D].
    """
    T, Q, D = q.shape
    K, S = k.shape[1], kv_cache.shape[3]
    scale = 1.0 / math.sqrt(D)
    out = torch.zeros(T, Q, D, dtype=q.dtype)
    t = 0
    for nc, n, pages in zip(num_computed, num_new, block_ids):
        for j in range(n):  # write all new tokens first; causality below keeps queries honest
            pos = nc + j
            kv_cache[pages[pos // S], layer, 0, pos % S] = k[t + j]
            kv_cache[pages[pos // S], layer, 1, pos % S] = v[t + j]
        for j in range(n):
            pos = nc + j
            keys = torch.stack([kv_cache[pages[p // S], layer, 0, p % S] for p in range(pos + 1)])
            values = torch.stack([kv_cache[pages[p // S], layer, 1, p % S] for p in range(pos + 1)])
            for h in range(Q):
                kh = h // (Q // K)  # transformers' repeat_kv: query head h reads kv head h // R
                scores = (keys[:, kh].float() @ q[t + j, h].float()) * scale  # [pos+1]
                probs = torch.softmax(scores, dim=0)
                out[t + j, h] = (probs @ values[:, kh].float()).to(q.dtype)
        t += n
    return out.reshape(T, Q * D)


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: Sequence[Sequence[int]],
    context_lens: Sequence[int],
) -> torch.Tensor:
    """One decode query a sequence against the K/V its pages already hold (no write).

    q [B, Q, D]; kv_cache [P, L, 2, S, K, D] (`kvmesh.engine.kv_layout.LLAMA_PAGE`); sequence b's
    context is its first context_lens[b] tokens, token p in page block_table[b][p // S], slot
    p % S (the new token's K/V included: the model writes it first). Returns [B, Q, D] in
    q.dtype, computed in fp32 one head at a time.
    """
    B, Q, D = q.shape
    K, S = kv_cache.shape[4], kv_cache.shape[3]
    out = torch.zeros(B, Q, D, dtype=q.dtype)
    for b in range(B):
        n, pages = context_lens[b], block_table[b]
        keys = torch.stack([kv_cache[pages[p // S], layer, 0, p % S] for p in range(n)]).float()  # [n, K, D]
        values = torch.stack([kv_cache[pages[p // S], layer, 1, p % S] for p in range(n)]).float()
        for h in range(Q):
            kh = h // (Q // K)  # transformers' repeat_kv
            probs = torch.softmax((keys[:, kh] @ q[b, h].float()) / math.sqrt(D), dim=0)  # [n]
            out[b, h] = (probs @ values[:, kh]).to(q.dtype)
    return out


def dequantize_q4_1_ref(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """gguf-py's Q4_1 `dequantize_blocks`: w = d * q + m per block of 32 inputs, in fp32.

    qs [N, K/2] uint8 (q[n, 2j] in the low nibble of qs[n, j], q[n, 2j+1] in the high one);
    d, m [N, K/32] fp16. Returns [N, K] fp32, bit for bit what transformers loads.
    """
    q = torch.stack([qs & 15, qs >> 4], dim=-1).reshape(qs.shape[0], -1).float()  # [N, K]
    return d.float().repeat_interleave(32, 1) * q + m.float().repeat_interleave(32, 1)


def dequantize_q8_0_ref(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """gguf-py's Q8_0 `dequantize_blocks`: w = q * d per block of 32; q [N, K] int8, d [N, K/32]
    fp16 -> [N, K] fp32."""
    return q.float() * d.float().repeat_interleave(32, 1)


def quantized_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in fp64, rounded to fp32: what `kvmesh.kernels.quant` approximates."""
    return (x.double() @ w.double().T).float()
