# T=tokens (new, all sequences), B=sequences, L=layers, P=pages, S=page_size, M=pages of one
# sequence (padded to the batch's most), Q=query heads, K=kv heads, R=Q/K, D=head_dim,
# n=new tokens of one prefill, N=its context (prefix + new), b=queries of one block
"""Paged attention on the CPU PyTorch path.

The KV cache is page-major, `[P, L, 2, S, K, D]` (the layout `kvmesh.engine.kv_layout.LLAMA_PAGE`
defines and allocates), so one page is one contiguous buffer for the KV transfer. Writes address it by token row, `kv_cache.view(P*L*2*S, K, D)`: the K (kv=0) or
V (kv=1) of slot s of page p in layer l is row `((p*L + l)*2 + kv)*S + s`. Reads gather whole
page blocks, `kv_cache.view(P*L*2, S, K, D)`, block `(p*L + l)*2 + kv`: one memcpy of S tokens
each instead of S small ones.

`build_attention_metadata` (`kvmesh.kernels.attention_metadata`) turns a batch's page tables
into those indices once per forward; every layer reuses them (`paged_attention`). Sequences
with one new token (decode) run as one batched SDPA over their gathered K/V, padded to whole
pages and masked; each sequence with several new tokens (prefill, possibly after a cached
prefix) runs causal attention in query blocks (`_causal_blocks`). The reference is `ref.paged_attention_ref` (vLLM's paged attention
semantics, transformers' Llama attention numerics).

Decode reads the unused slots of a sequence's last page and masks them, so they must hold
finite values: a NaN there leaks through the mask as 0 * NaN (prefill reads only its N tokens). ModelRunner zero-fills its cache and only K/V ever lands
in it, which keeps that true.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels.attention_metadata import (  # the plan, importable from here too
    AttentionMetadata,
    DecodeGroup,
    PrefillGroup,
    build_attention_metadata,
)

__all__ = [
    "QUERY_BLOCK",
    "AttentionMetadata",
    "DecodeGroup",
    "PrefillGroup",
    "build_attention_metadata",
    "paged_attention",
]

QUERY_BLOCK = 2048
"""Queries per block of `_causal_blocks`, so a chunk of up to 2048 tokens is one block: its
own keys causally, the cached prefix's in full, merged. Smaller blocks skip more of the causal
waste (256: about 8% less attention time on an idle 2-core machine, SmolLM2-135M) but make
~8x the kernel calls, each a parallel region that waits for every thread; on shared cores
(prefill and decode instances share them by default) that measured 25-50% slower."""

# PyTorch's CPU flash attention kernel (the one SDPA dispatches to here), called directly
# because it also returns each query row's log-sum-exp, which merging two parts needs
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata
) -> torch.Tensor:
    """Write the new tokens' K/V into their pages, then attend each query to its context.

    q [T, Q, D], k and v [T, K, D] (strided views are fine); kv_cache [P, L, 2, S, K, D],
    contiguous, written in place; layer in [0, L). Returns [T, Q*D], same dtype as q.
    Scale 1/sqrt(D), causal, GQA with query head h reading kv head h // R (transformers'
    `repeat_kv`). Reference: `ref.paged_attention_ref`.
    """
    T, Q, D = q.shape
    P, _, _, S, K, _ = kv_cache.shape
    kv_rows = kv_cache.view(-1, K, D)  # [P*L*2*S, K, D]
    kv_blocks = kv_cache.view(-1, S, K, D)  # [P*L*2, S, K, D]
    rows = meta.write_rows[layer]  # [2, T]
    kv_rows.index_copy_(0, rows[0], k)
    kv_rows.index_copy_(0, rows[1], v)
    g = meta.decode
    if g is not None and g.token_index is None and not meta.prefills:
        return _decode(q, kv_cache, layer, g).reshape(T, Q * D)  # all-decode: no scatter
    if g is None and len(meta.prefills) == 1 and meta.prefills[0].end - meta.prefills[0].start == T:
        return _prefill(q, k, v, kv_blocks, layer, meta.prefills[0])  # one prefill: no scatter either
    out = q.new_empty(T, Q * D)
    if g is not None:
        qd = q.index_select(0, g.token_index)  # [B, Q, D]
        out.index_copy_(0, g.token_index, _decode(qd, kv_cache, layer, g).reshape(-1, Q * D))
    for p in meta.prefills:
        out[p.start : p.end] = _prefill(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], kv_blocks, layer, p)
    return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, g: DecodeGroup) -> torch.Tensor:
    """q [B, Q, D] -> [B, K, R, D] (CPU) or [B, Q, D] (a GPU: the paged decode op), same memory order."""
    if q.device.type != "cpu":  # the Triton kernel (kvmesh.kernels.custom_ops): pages read in place
        import kvmesh.kernels.custom_ops  # noqa: F401  # on first use: registers torch.ops.kvmesh.*, imports triton

        return torch.ops.kvmesh.paged_decode_attention(q, kv_cache, layer, g.block_table, g.context_lens)
    B, (*_, S, K, D) = g.num_seqs, kv_cache.shape
    kv_blocks = kv_cache.view(-1, S, K, D)  # [P*L*2, S, K, D]
    kv = kv_blocks.index_select(0, g.read_blocks[layer].view(-1)).view(2, B, -1, K, D)  # N = M*S
    # the R query heads sharing a kv head act as R query rows against it: no K/V repeat
    qg = q.reshape(B, K, -1, D)  # [B, K, R, D]
    return F.scaled_dot_product_attention(
        qg, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=g.mask
    )  # [B, K, R, D]


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_blocks: torch.Tensor, layer: int, p: PrefillGroup
) -> torch.Tensor:
    n, Q, D = q.shape
    nc = p.num_computed
    if p.read_blocks is None:
        keys, values = k, v  # [n, K, D]: no prefix, the new tokens are the whole context
    else:
        kv = kv_blocks.index_select(0, p.read_blocks[layer].view(-1))  # [2*M, S, K, D]
        keys, values = kv.view(2, -1, *kv.shape[2:])[:, : nc + n].unbind(0)  # [N, K, D] each, N = nc+n
    qh, kh, vh = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if q.device.type == "cpu":
        o = _causal_blocks(qh, kh, vh, nc, QUERY_BLOCK)  # [1, Q, n, D]
    else:  # SDPA's GPU kernels (flash / memory-efficient) take GQA and a bottom-right causal mask
        mask = None if nc == 0 else torch.ones(n, nc + n, dtype=torch.bool, device=q.device).tril(nc)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=nc == 0, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, Q * D)


def _causal_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nc: int, block: int) -> torch.Tensor:
    """Causal attention of n queries at positions nc.. over keys 0 .. nc+n-1, a block at a time.

    q [1, Q, n, D], k and v [1, K, nc+n, D] (strided views are fine; GQA as SDPA's enable_gqa).
    Returns [1, Q, n, D] laid out as [1, n, Q, D] in memory.

    SDPA's causal flag aligns the mask top-left, which is wrong after a prefix, and an explicit
    [n, nc+n] mask makes its kernel build, add and exponentiate every masked score too. Here
    queries [s, e) see the keys before the block, [0, nc+s), in full (no mask at all) and the
    diagonal keys [nc+s, nc+e) causally (a square, where top-left is right); the two partial
    softmaxes merge by their log-sum-exps as in flash attention (Dao et al. 2022):
    out = lerp(o_diag, o_before, w), w = Z_before / (Z_before + Z_diag) = sigmoid(lse_b - lse_d).
    Reference: `ref.paged_attention_ref`; within 2e-5 of it (fp32), not bit-identical to SDPA.
    """
    _, Q, n, D = q.shape
    if nc == 0 and n <= block:
        return _flash(q, k, v, 0.0, True)[0]  # one causal square: SDPA's own call, no copy
    out = q.new_empty(1, n, Q, D).transpose(1, 2)  # [1, Q, n, D], rows of [n, Q*D] in memory
    for s in range(0, n, block):
        e = min(n, s + block)
        a = nc + s  # keys before this block
        qb = q[:, :, s:e]
        o, lse = _flash(qb, k[:, :, a : nc + e], v[:, :, a : nc + e], 0.0, True)  # [1, Q, b, D], [1, Q, b]
        if a:
            o_before, lse_before = _flash(qb, k[:, :, :a], v[:, :, :a], 0.0, False)
            w = (lse_before - lse).sigmoid_().to(o.dtype)[..., None]  # [1, Q, b, 1]
            torch.lerp(o, o_before, w, out=out[:, :, s:e])  # one pass, straight into the output rows
        else:
            out[:, :, s:e] = o
    return out
