# T=tokens, E=routed experts, K=experts per token (top-k), V=vocabulary
"""MoE routing for DeepSeek-V4: which K experts each token goes to, and with what weight.

Two routers (DeepSeek-V4 paper §2.1):
- `route_topk`, the learned router (transformers' `DeepseekV4TopKRouter`): the top-K experts
  by score plus a load-balancing correction bias (the bias picks experts, it never weights them);
- `route_hash`, hash routing for the first MoE layers (`DeepseekV4HashRouter`): a frozen
  token-id -> expert-ids table picks the experts, the learned scores still weight them.

Both normalise the K picked scores to sum to one, then scale by `routed_scaling_factor`.
The reference is `kvmesh.kernels.moe.ref` (a per-token loop); tests also compare with transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# transformers' ACT2FN["sqrtsoftplus"] / ["sigmoid"]; "softmax" is V2/V3-style routing over E
_SCORE_FNS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


def score_fn(scoring_func: str):
    """The router's score function by name; ValueError for a name not in `_SCORE_FNS`."""
    fn = _SCORE_FNS.get(scoring_func)
    if fn is None:
        raise ValueError(f"scoring_func must be one of {sorted(_SCORE_FNS)}, got {scoring_func!r}")
    return fn


def route_topk(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learned top-K routing, `DeepseekV4TopKRouter`'s numbers (DeepSeek-V4 §2.1).

    logits [T, E] fp32 (router gate output; another float dtype is computed in fp32);
    correction_bias [E] fp32 or None (zeros). Returns (weights [T, K] fp32, expert_ids [T, K]
    int64):
        scores     = score_fn(logits)         # "sqrtsoftplus" | "sigmoid" | "softmax" over E
        expert_ids = top-K of scores + correction_bias, best first; equal values -> lower id first
        weights    = scores[expert_ids] / (sum_K + 1e-20) * routed_scaling_factor

    transformers asks `torch.topk(sorted=False)` for the ids, whose order (and whose pick among
    equal scores) is unspecified; here both are fixed, so the set of experts can differ from
    transformers' only where scores tie exactly at the K-th place.
    Raises ValueError for an unknown scoring_func, top_k outside [1, E] or a bias not [E].
    Reference: `kvmesh.kernels.moe.ref.route_topk_ref`.
    """
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}] (the number of experts), got {top_k}")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"correction_bias must have shape [{E}], got {list(correction_bias.shape)}")
    scores = score_fn(scoring_func)(logits.float())  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    # a stable descending sort keeps equal values in id order: the lower id wins the tie
    ranked = torch.sort(choice, dim=-1, descending=True, stable=True).indices  # [T, E]
    expert_ids = ranked[:, :top_k]  # [T, K]
    return _normalized_weights(scores, expert_ids, routed_scaling_factor), expert_ids


def route_hash(
    logits: torch.Tensor,
    scoring_func: str,
    tid2eid: torch.Tensor,
    input_ids: torch.Tensor,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing, `DeepseekV4HashRouter`'s numbers (DeepSeek-V4 §2.1, hash-MoE layers).

    logits [T, E] fp32; tid2eid [V, K] integer table of expert ids per token id; input_ids [T]
    (any shape with T elements) token ids. Returns (weights [T, K] fp32, expert_ids [T, K]
    int64) with expert_ids = tid2eid[input_ids] and weights as in `route_topk`.
    Raises ValueError for an unknown scoring_func, a token count that differs from T, or (CPU
    tensors) a token id outside [0, V). Reference: `kvmesh.kernels.moe.ref.route_hash_ref`.
    """
    T, _E = logits.shape
    V = tid2eid.shape[0]
    ids = input_ids.reshape(-1)  # [T]
    if ids.numel() != T:
        raise ValueError(f"input_ids has {ids.numel()} tokens but logits has {T} rows")
    scores = score_fn(scoring_func)(logits.float())  # [T, E]
    # checked where the ids are host values; on a GPU reading them back would stall the step, and
    # the runner checked every token id against the vocabulary before the forward
    if T and ids.device.type == "cpu" and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"token ids must be in [0, {V}) (rows of tid2eid), got [{int(ids.min())}, {int(ids.max())}]")
    expert_ids = tid2eid[ids].long()  # [T, K]
    return _normalized_weights(scores, expert_ids, routed_scaling_factor), expert_ids


def _normalized_weights(scores: torch.Tensor, expert_ids: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    weights = scores.gather(1, expert_ids)  # [T, K]
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor
