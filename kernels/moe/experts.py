# T=tokens, H=hidden, I=expert intermediate size, E=routed experts, K=experts per token,
# A=T*K (token, expert) assignments, n=assignments of one expert
"""Routed experts on the PyTorch path, grouped by expert (DeepSeek-V4 §2.1, `DeepseekV4Experts`).

Each token's K assignments are sorted by expert id; an expert that got n of them runs one
[n, H] x [H, 2I] matmul, the clamped SwiGLU, one [n, I] x [I, H] matmul, and adds its
weighted rows back into the tokens' outputs: the layout of vLLM's `fused_moe` and sglang's
`moe_align_block_size`, without the padding a GPU kernel needs. Experts without tokens cost
nothing. The reference is `kvmesh.kernels.moe.ref.moe_experts_ref`; `kvmesh.kernels.moe.triton_moe` is the
same computation as one Triton kernel launch per matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_moe_args(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Shapes and dtypes shared by both MoE paths; returns (T, H, E, I, K) or raises ValueError."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"need x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], got "
            f"{list(x.shape)}, {list(w_gate_up.shape)}, {list(w_down.shape)}"
        )
    T, H = x.shape
    E, I2, H_w = w_gate_up.shape
    I = I2 // 2
    if H_w != H or I2 % 2 or tuple(w_down.shape) != (E, H, I):
        raise ValueError(
            f"need w_gate_up [E, 2I, {H}] and w_down [E, {H}, I], got {list(w_gate_up.shape)} and {list(w_down.shape)}"
        )
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or weights.shape != expert_ids.shape:
        raise ValueError(
            f"need weights and expert_ids [{T}, K], got {list(weights.shape)} and {list(expert_ids.shape)}"
        )
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(
            f"x, w_gate_up and w_down must share a dtype, got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
        )
    return T, H, E, I, expert_ids.shape[1]


def swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU (`DeepseekV4Experts._apply_gate`): [n, 2I] -> [n, I].

    gate (first half) is clamped to at most `limit`, up (second half) to [-limit, limit],
    then silu(gate) * up; limit None clamps nothing.
    """
    gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def moe_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]).

    x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows: transformers'
    `experts.gate_up_proj`); w_down [E, H, I]; weights [T, K] fp32; expert_ids [T, K] int64 in
    [0, E). expert_e(v) = w_down[e] @ (silu(clamp(gate, max=limit)) * clamp(up, -limit, limit))
    with [gate; up] = w_gate_up[e] @ v (`swiglu`). Returns [T, H] in x.dtype.

    Matmuls run in x.dtype; the weighted sum over K accumulates in fp32 in ascending expert
    order, so fp32 inputs give `DeepseekV4Experts`' numbers (which adds in x.dtype: for bf16
    this is the more accurate of the two). Raises ValueError for mismatched shapes or dtypes,
    or an expert id outside [0, E). Reference: `kvmesh.kernels.moe.ref.moe_experts_ref`.
    """
    T, H, E, _I, K = check_moe_args(x, w_gate_up, w_down, weights, expert_ids)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)  # [T, H]
    flat_ids = expert_ids.reshape(-1)  # [A]
    if flat_ids.numel() == 0:
        return out.to(x.dtype)
    lo, hi = torch.aminmax(flat_ids)
    if int(lo) < 0 or int(hi) >= E:
        raise ValueError(f"expert ids must be in [0, {E}), got [{int(lo)}, {int(hi)}]")
    order = torch.argsort(flat_ids, stable=True)  # [A] assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=E).tolist()  # [E] assignments per expert
    token_of = order // K  # [A] token of each sorted assignment
    weight_of = weights.reshape(-1).float()[order]  # [A]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tokens = token_of[start : start + n]  # [n]
        h = swiglu(F.linear(x[tokens], w_gate_up[e]), swiglu_limit)  # [n, I]
        y = F.linear(h, w_down[e])  # [n, H]
        out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(x.dtype)
