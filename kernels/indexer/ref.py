# T=queries, N=compressed indexer keys (entries), Hi=indexer heads, Di=indexer head_dim
"""Plain, slow references for the Lightning Indexer: what `ops.py` and `triton_indexer.py`
must equal.

Written from transformers' `DeepseekV4IndexerScorer` (one head at a time) and
`DeepseekV4Indexer` (top-k with a -1 sentinel), with the tie order spelled out per query.
"""

from __future__ import annotations

import torch


def indexer_scores_ref(
    q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [T, Hi, Di], k [N, Di], head_weights [T, Hi] -> fp32 [T, N], head by head:
    score = sum_h head_weights[:, h] * relu(q[:, h] @ k^T) * softmax_scale."""
    T, Hi, _ = q.shape
    out = torch.zeros(T, k.shape[0], dtype=torch.float32)
    for h in range(Hi):
        logits = q[:, h].float() @ k.float().t()  # [T, N]
        out += (torch.relu(logits) * softmax_scale) * head_weights[:, h, None].float()
    return out


def indexer_masked_scores_ref(
    q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float, num_valid: torch.Tensor
) -> torch.Tensor:
    """`indexer_scores_ref` with -inf where entry n >= num_valid[t] (the Triton kernel's mask)."""
    out = indexer_scores_ref(q, k, head_weights, softmax_scale)
    for t, nv in enumerate(num_valid.tolist()):
        out[t, nv:] = float("-inf")
    return out


def indexer_topk_ref(scores: torch.Tensor, top_k: int, num_valid: torch.Tensor) -> torch.Tensor:
    """scores [T, N], num_valid [T] -> int64 [T, min(top_k, N)], one query at a time.

    Query t ranks its selectable entries n < num_valid[t] by (score descending, index
    ascending), keeps the first top_k and pads with -1.
    """
    T, N = scores.shape
    kk = min(top_k, N)
    out = torch.full((T, kk), -1, dtype=torch.int64)
    for t in range(T):
        row = scores[t].tolist()
        candidates = range(min(int(num_valid[t]), N))
        best = sorted(candidates, key=lambda n: (-row[n], n))[:kk]
        out[t, : len(best)] = torch.tensor(best, dtype=torch.int64)
    return out
