# n=query tokens of one sequence, Hq=query heads, D=head_dim, M=keys (sliding window + compressed
# entries), Ws=window keys
"""DeepSeek-V4 attention of one sequence's queries over its sliding window plus selected
compressed entries, with a learnable per-head sink (DeepSeek-V4 §2.3; the sink as in gpt-oss).

Shared-KV MQA: one K=V head serves every query head, so keys and values are the same [M, D]
rows. Which keys a query sees is an additive bias (0 or -inf): the window's causal band, and
for compressed entries the causal limit and, in CSA layers, the Lightning Indexer's top-k.
The reference is transformers' `eager_attention_forward` for DeepSeek-V4 (scores + mask, a sink
logit appended, max subtracted, softmax, sink dropped).
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D], kv [M, D] (keys and values), bias [n, M] additive (0 / -inf), sinks [Hq] fp32.

    Returns [n, Hq, D] in q's dtype. A query whose every key is masked attends only to its sink
    and gets zeros. Raises ValueError on mismatched shapes.
    """
    n, Hq, D = q.shape
    if kv.dim() != 2 or kv.shape[1] != D or bias.shape != (n, kv.shape[0]) or sinks.shape != (Hq,):
        raise ValueError(
            f"sink_attention shapes: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
            f"bias {tuple(bias.shape)}, sinks {tuple(sinks.shape)}"
        )
    scores = torch.matmul(q, kv.t()) * scale + bias[:, None, :]  # [n, Hq, M]
    logits = torch.cat([scores, sinks.view(1, Hq, 1).expand(n, Hq, 1).to(scores.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # [n, Hq, M], the sink's share dropped
    return torch.matmul(probs, kv)  # [n, Hq, D]


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Sliding-window causal bias [n, Ws]: key at k_pos visible to q_pos iff q_pos - window < k_pos <= q_pos."""
    d = q_pos[:, None] - k_pos[None, :]
    visible = (d >= 0) & (d < window)
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))


def sparse_sink_attention(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_bias: torch.Tensor,
    ent_kv: torch.Tensor | None,
    ent_bias: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same softmax as `sink_attention`, over only the keys each query can see.

    q [n, Hq, D]; win_kv [n, W, D] each query's own sliding window (gathered), win_bias [n, W];
    ent_kv either [n, k, D] (CSA: each query's top-k compressed entries, gathered) or [C, D]
    (HCA: every entry, shared), ent_bias [n, k] or [n, C] (0 / -inf), or both None (sliding
    layers). Cost O(n (W + k)) instead of `sink_attention`'s O(n^2) over a whole prompt's keys;
    masked keys contribute exactly zero in both, so only the summation order differs.
    Returns [n, Hq, D] in q's dtype.
    """
    n, Hq, D = q.shape
    parts = [torch.einsum("nhd,nwd->nhw", q, win_kv) * scale + win_bias[:, None, :]]  # [n, Hq, W]
    if ent_kv is not None:
        if ent_kv.dim() == 3:
            parts.append(torch.einsum("nhd,nkd->nhk", q, ent_kv) * scale + ent_bias[:, None, :])
        else:
            parts.append(torch.matmul(q, ent_kv.t()) * scale + ent_bias[:, None, :])  # [n, Hq, C]
    parts.append(sinks.view(1, Hq, 1).expand(n, Hq, 1).to(q.dtype))
    logits = torch.cat(parts, dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)
    W = win_kv.shape[1]
    out = torch.einsum("nhw,nwd->nhd", probs[..., :W], win_kv)
    if ent_kv is not None:
        pe = probs[..., W:-1]
        out = out + (torch.einsum("nhk,nkd->nhd", pe, ent_kv) if ent_kv.dim() == 3 else torch.matmul(pe, ent_kv))
    return out
