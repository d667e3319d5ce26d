# T=tokens (new, all sequences), n=new tokens of one sequence, Bd=decode sequences, H=hidden,
# qr=q_lora_rank, Hi/Di=indexer heads/head dim, C=compressed entries (Cmax: padded to the most),
# k=index_topk
"""The Lightning Indexer's use in CSA layers (paper §2.3.1; transformers'
`DeepseekV4Indexer`): its queries score every closed window's indexer key, and each query
attends to the top-k compressed entries by that score. The keys themselves come from the
indexer's compressor (kvmesh.engine.deepseek_v4.compressor); the scores and the top-k are
kvmesh.kernels.indexer's. Ties in the top-k go to the lower entry index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.ops import RopeTable, apply_rope
from kvmesh.engine.deepseek_v4.plan import ForwardPlan
from kvmesh.kernels.backend import KernelBackend
from kvmesh.kernels.indexer import indexer_topk


def indexer_queries(
    w: dict[str, torch.Tensor],
    p: str,
    x: torch.Tensor,
    q_res: torch.Tensor,
    rope: RopeTable,
    positions: torch.Tensor,
    config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer p's (`model.layers.3.self_attn.`) indexer queries iq [T, Hi, Di], rotated by the
    "compress" rope at each token's position, from the query's low-rank q_res [T, qr]; and
    their head weights iw [T, Hi] from the attention input x [T, H]."""
    ip = p + "compressor.indexer."
    T, Hi, Di = x.shape[0], config.index_n_heads, config.index_head_dim
    ic, isn = rope(positions)
    iq = apply_rope(F.linear(q_res, w[ip + "q_b_proj.weight"]).view(T, Hi, Di), ic, isn)
    iw = F.linear(x, w[ip + "scorer.weights_proj.weight"]) * Hi**-0.5  # [T, Hi]
    return iq, iw


def select_for_sequence(
    kernels: KernelBackend,
    config,
    iq: torch.Tensor,
    ikeys: torch.Tensor,
    iw: torch.Tensor,
    num_valid: torch.Tensor,
    plan: ForwardPlan,
) -> torch.Tensor:
    """One sequence's n queries (iq [n, Hi, Di], iw [n, Hi]) over its C indexer keys ikeys
    [C, Di], of which query j may select its first num_valid[j] (windows closed by its
    position): the entries each attends to, top [n, k] int64, -1 = none."""
    Di = config.index_head_dim
    scores = kernels.indexer_scores(iq, ikeys, iw, Di**-0.5)  # [n, C]
    k = min(config.index_topk, ikeys.shape[0])
    top = indexer_topk(scores, k, num_valid)  # [n, k], -1 = none
    if plan.count_ties:
        plan.ties += boundary_ties(scores, num_valid, k)
    return top


def select_for_decode(
    config, iq: torch.Tensor, ikeys: torch.Tensor, iw: torch.Tensor, count: torch.Tensor, most: int, plan: ForwardPlan
) -> torch.Tensor:
    """Every decode sequence's query at once (iq [Bd, Hi, Di], iw [Bd, Hi]) over its indexer keys
    ikeys [Bd, Cmax, Di], the first count [Bd] of them valid (`most` the largest count, a host
    value): top [Bd, k] int64, -1 = none."""
    Di = config.index_head_dim
    # indexer_scores per query: sum_h w_h * relu(q_h . k) * Di^-0.5
    scores = (torch.matmul(iq.float(), ikeys.transpose(1, 2).float()).relu() * Di**-0.5 * iw.float().unsqueeze(-1)).sum(
        dim=1
    )  # [Bd, Cmax]
    k = min(config.index_topk, ikeys.shape[1])
    top = indexer_topk(scores, k, count)  # [Bd, k], -1 = none
    if plan.count_ties:
        plan.ties += boundary_ties(scores, count, min(k, most))
    return top


def boundary_ties(scores: torch.Tensor, num_valid: torch.Tensor, k: int) -> int:
    """Queries whose k-th and (k+1)-th best selectable scores are equal: the tie-break decides
    their top-k set. scores [n, C], num_valid [n]. A test's counter (`count_topk_ties`, off by
    default): its int() is a host sync on a GPU."""
    entry = torch.arange(scores.shape[1], device=scores.device)
    masked = scores.masked_fill(entry[None, :] >= num_valid[:, None], float("-inf"))
    if masked.shape[1] <= k:
        return 0
    best = masked.topk(k + 1, dim=-1).values  # [n, k+1]
    return int(((best[:, k - 1] == best[:, k]) & (num_valid > k)).sum())
