# T=tokens, H=hidden, E=routed experts, K=experts per token, I=moe_intermediate_size
"""DeepSeek-V4's MoE around its routed experts (paper §2.1, transformers' `DeepseekV4MoE`): the
router, hash-routed (a frozen token -> experts table) or top-k over scores with a correction
bias, and the shared expert, its SwiGLU clamped at `swiglu_limit`. The routed experts themselves
run in kvmesh.kernels.moe (or on expert-parallel ranks, kvmesh.engine.ep), called by the model.
Weights are named under the MLP's prefix p (`model.layers.3.mlp.`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels.moe import route_hash, route_topk


def route(
    x: torch.Tensor, ids: torch.Tensor, w: dict[str, torch.Tensor], p: str, config, hash_routed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], token ids [T] -> (weights [T, K] fp32, expert ids [T, K] int64) of MLP p."""
    c = config
    logits = F.linear(x, w[p + "gate.weight"])  # [T, E]
    if hash_routed:
        return route_hash(logits, c.scoring_func, w[p + "gate.tid2eid"], ids, c.routed_scaling_factor)
    return route_topk(
        logits,
        c.scoring_func,
        c.num_experts_per_tok,
        w[p + "gate.e_score_correction_bias"],
        c.routed_scaling_factor,
    )


def shared_expert(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, limit: float) -> torch.Tensor:
    """MLP p's shared expert: x [T, H] -> [T, H], gate clamped above at limit, up to [-limit, limit]."""
    gate = F.linear(x, w[p + "shared_experts.gate_proj.weight"]).clamp(max=limit)
    up = F.linear(x, w[p + "shared_experts.up_proj.weight"]).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w[p + "shared_experts.down_proj.weight"])
