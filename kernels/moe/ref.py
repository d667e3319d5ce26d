# T=tokens, H=hidden, I=expert intermediate size, E=routed experts, K=experts per token,
# V=vocabulary
"""Plain, slow references for the MoE kernels: what `routing.py`, `experts.py` and
`triton_moe.py` must equal.

Written from transformers' DeepSeek-V4 code (`DeepseekV4TopKRouter`, `DeepseekV4HashRouter`,
`DeepseekV4Experts`), one token at a time, so each step can be read at a glance.
"""

from __future__ import annotations

import math

import torch


def score_ref(logit_row: list[float], scoring_func: str) -> list[float]:
    """One token's router scores, [E] floats in fp64 arithmetic."""
    if scoring_func == "sqrtsoftplus":  # sqrt(log(1 + e^x)), written to not overflow for large x
        return [math.sqrt(max(v, 0.0) + math.log1p(math.exp(-abs(v)))) for v in logit_row]
    if scoring_func == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v)) for v in logit_row]
    if scoring_func == "softmax":
        m = max(logit_row)
        exps = [math.exp(v - m) for v in logit_row]
        return [v / sum(exps) for v in exps]
    raise ValueError(scoring_func)


def route_topk_ref(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] fp32, expert_ids [T, K] int64), token by token.

    Experts ranked by (score + bias descending, id ascending); weights are the picked scores
    (without bias) over their sum, times the scaling factor.
    """
    T, E = logits.shape
    bias = [0.0] * E if correction_bias is None else correction_bias.tolist()
    weights, ids = [], []
    for row in logits.tolist():
        scores = score_ref(row, scoring_func)
        picked = sorted(range(E), key=lambda e: (-(scores[e] + bias[e]), e))[:top_k]
        total = sum(scores[e] for e in picked)
        weights.append([scores[e] / (total + 1e-20) * routed_scaling_factor for e in picked])
        ids.append(picked)
    return (
        torch.tensor(weights, dtype=torch.float32).view(T, top_k),
        torch.tensor(ids, dtype=torch.int64).view(T, top_k),
    )


def route_hash_ref(
    logits: torch.Tensor,
    scoring_func: str,
    tid2eid: torch.Tensor,
    input_ids: torch.Tensor,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing, token by token: the experts of token id v are row v of tid2eid [V, K]."""
    T, K = logits.shape[0], tid2eid.shape[1]
    weights, ids = [], []
    for row, tid in zip(logits.tolist(), input_ids.reshape(-1).tolist()):
        scores = score_ref(row, scoring_func)
        picked = tid2eid[tid].tolist()
        total = sum(scores[e] for e in picked)
        weights.append([scores[e] / (total + 1e-20) * routed_scaling_factor for e in picked])
        ids.append(picked)
    return (torch.tensor(weights, dtype=torch.float32).view(T, K), torch.tensor(ids, dtype=torch.int64).view(T, K))


def moe_experts_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * down_e(silu(clamp(gate)) * clamp(up)), e = expert_ids[t, k].

    x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; computed in fp32 one (token, expert) at
    a time, returned in x.dtype.
    """
    T, H = x.shape
    I = w_down.shape[2]
    limit = math.inf if swiglu_limit is None else swiglu_limit
    out = torch.zeros(T, H, dtype=torch.float32)
    for t in range(T):
        for k in range(expert_ids.shape[1]):
            e = int(expert_ids[t, k])
            gate_up = w_gate_up[e].float() @ x[t].float()  # [2I]
            gate = gate_up[:I].clamp(max=limit)
            up = gate_up[I:].clamp(min=-limit, max=limit)
            act = gate * torch.sigmoid(gate) * up  # silu(gate) * up, [I]
            out[t] += float(weights[t, k]) * (w_down[e].float() @ act)  # [H]
    return out.to(x.dtype)
