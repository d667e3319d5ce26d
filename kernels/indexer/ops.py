# T=queries (tokens), N=compressed indexer keys (entries), Hi=indexer heads, Di=indexer head_dim,
# k=entries kept per query (top_k)
"""Lightning Indexer on the PyTorch path (DeepSeek-V4 §2.3.1, eqs. 13-17).

Compressed Sparse Attention lets each query attend to only k of the N compressed KV entries;
the indexer picks them. `indexer_scores` is the index score of query t for entry n,
    I[t, n] = sum_h w[t, h] * ReLU(q[t, h] . K[n]) * softmax_scale,
as transformers' `DeepseekV4IndexerScorer` computes it; `indexer_topk` keeps the k best entries
a query may see, with a fixed tie-break. The reference is `kvmesh.kernels.indexer.ref`;
`kvmesh.kernels.indexer.triton_indexer` computes the scores in one Triton kernel.
"""

from __future__ import annotations

import torch

# bound the [T, Hi, N] fp32 intermediate: queries are scored in chunks of this many elements
_CHUNK_ELEMENTS = 1 << 25  # 128 MiB


def indexer_scores(q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Index scores of every query for every compressed entry (DeepSeek-V4 §2.3.1).

    q [T, Hi, Di] indexer queries (after RoPE); k [N, Di] compressed indexer keys;
    head_weights [T, Hi] per-head weights, already scaled by the caller (transformers:
    weights_proj(h) * Hi^-0.5). Any float dtypes; computed in fp32. Returns fp32 [T, N]:
        score[t, n] = sum_h head_weights[t, h] * relu(q[t, h] . k[n]) * softmax_scale
    in `DeepseekV4IndexerScorer`'s order of operations (relu, * scale, * weight, sum over
    heads), queries in chunks so the [T, Hi, N] intermediate stays within 128 MiB.
    Raises ValueError for mismatched shapes. Reference: `kvmesh.kernels.indexer.ref.indexer_scores_ref`.
    """
    T, Hi, Di = check_score_args(q, k, head_weights)
    N = k.shape[0]
    kt = k.float().t()  # [Di, N]
    w = head_weights.float()  # [T, Hi]
    out = torch.empty(T, N, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, Hi * N))
    for t0 in range(0, T, step):
        qc = q[t0 : t0 + step].float()  # [t, Hi, Di]
        s = (qc.reshape(-1, Di) @ kt).view(qc.shape[0], Hi, N)  # [t, Hi, N]
        s = torch.relu(s) * softmax_scale
        torch.sum(s * w[t0 : t0 + step, :, None], dim=1, out=out[t0 : t0 + step])  # [t, N]
    return out


def indexer_topk(scores: torch.Tensor, top_k: int, num_valid: torch.Tensor) -> torch.Tensor:
    """The top_k entries of each query, best first (DeepSeek-V4 §2.3.1, `DeepseekV4Indexer`).

    scores [T, N] fp32; num_valid [T] int64: query t may select only entries n < num_valid[t]
    (transformers' causal threshold (position + 1) // compress_rate). Returns int64
    [T, min(top_k, N)] entry indices ordered by (score descending, index ascending); slots
    past a query's selectable count, and only those, are -1.

    Tie-break: among equal scores the lower index wins and ranks first (ReLU makes exact 0.0
    ties common, and torch.topk promises no order among ties). Each score is folded with its
    index into one int64 key, order-preserving float bits high, inverted index low, so the
    keys are distinct and torch.topk is exact. -0.0 counts as 0.0. NaN scores: unspecified.
    Raises ValueError for top_k < 1 or mismatched shapes.
    Reference: `kvmesh.kernels.indexer.ref.indexer_topk_ref`.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if scores.dim() != 2 or num_valid.shape != (scores.shape[0],):
        raise ValueError(f"need scores [T, N] and num_valid [T], got {list(scores.shape)} and {list(num_valid.shape)}")
    T, N = scores.shape
    kk = min(top_k, N)
    entry = torch.arange(N, device=scores.device)  # [N]
    selectable = entry[None, :] < num_valid[:, None]  # [T, N]
    s = torch.where(scores == 0, 0.0, scores.float())  # -0.0 -> 0.0, so zeros tie
    s = s.masked_fill(~selectable, float("-inf"))  # [T, N]
    bits = s.view(torch.int32).long()  # [T, N] sign-magnitude float bits
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float value
    key = (ordered << 32) | ((1 << 32) - 1 - entry)  # [T, N]: higher key = higher, then lower n
    picked = torch.topk(key, kk, dim=-1, sorted=True).indices  # [T, kk] best first
    return torch.where(picked < num_valid[:, None], picked, -1)


def check_score_args(q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor) -> tuple[int, int, int]:
    """Shapes shared by both score paths; returns (T, Hi, Di) or raises ValueError."""
    if q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2] or head_weights.shape != q.shape[:2]:
        raise ValueError(
            f"need q [T, Hi, Di], k [N, Di], head_weights [T, Hi], got "
            f"{list(q.shape)}, {list(k.shape)}, {list(head_weights.shape)}"
        )
    return q.shape[0], q.shape[1], q.shape[2]
