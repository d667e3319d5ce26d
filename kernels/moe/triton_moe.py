# T=tokens, H=hidden, I=expert intermediate size, E=routed experts, K=experts per token,
# A=T*K (token, expert) assignments, P=assignments after padding each expert's group to
# BLOCK_M, BM/BN/BK=block sizes along rows (assignments), output columns, reduction
"""Routed experts as Triton kernels, vLLM's `fused_moe` design (DeepSeek-V4 §2.1).

1. Align (`align_block_size` of kvmesh.kernels.moe.align, PyTorch ops, no host sync): the
   A = T*K assignments are sorted by expert and each expert's group padded to a multiple of
   BLOCK_M with a sentinel (A), so every row block belongs to one expert (vLLM's / sglang's
   `moe_align_block_size`).
2. `_gate_up_kernel`, one program per (row block, BN columns of I): the grouped GEMM
   x[token] @ w_gate_up[e]^T for the gate and the up columns together, then the clamped SwiGLU
   fused in registers; writes act [A, I] in x.dtype.
3. `_down_kernel`, one program per (row block, BN columns of H): act @ w_down[e]^T times the
   routing weight, written to [A, H] fp32 by assignment.
4. The sum of each token's K weighted rows (vLLM's `moe_sum`), in fp32, cast to x.dtype.

Kernels are jitted at first launch, not at import, and call only triton.language builtins
(tl.full, not tl.zeros; exp, not tl.sigmoid: those are @triton.jit functions themselves, fixed
in one mode when triton is imported). So a process that imported triton first (transformers
does) can still set TRITON_INTERPRET=1 later and run them on CPU tensors, as the tests do.
The reference is `kvmesh.kernels.moe.ref.moe_experts_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.moe.align import (  # importable from here too
    Alignment,
    BlockSizes,
    align_block_size,
    default_block_sizes,
)
from kvmesh.kernels.moe.experts import check_moe_args
from kvmesh.kernels.triton_jit import jit

__all__ = ["Alignment", "BlockSizes", "align_block_size", "default_block_sizes", "moe_experts_triton"]


def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assignments,
    H,
    I,
    limit,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_aa,
    stride_ai,
    TOP_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return  # past the last expert's padded group
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slot = tl.load(sorted_ids_ptr + pid_m * BM + tl.arange(0, BM))  # [BM] assignments
    row_ok = slot < num_assignments  # padding rows compute nothing useful and store nothing
    token = (slot // TOP_K).to(tl.int64)  # [BM]
    cols = pid_n * BN + tl.arange(0, BN)  # [BN] columns of I
    col_ok = cols < I
    w_e = w_ptr + e * stride_we
    acc_gate = tl.full((BM, BN), 0.0, tl.float32)
    acc_up = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)  # [BK]
        k_ok = ks < H
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + ks[None, :] * stride_xh,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        b_mask = k_ok[:, None] & col_ok[None, :]
        b_gate = tl.load(
            w_e + cols[None, :] * stride_wn + ks[:, None] * stride_wh, mask=b_mask, other=0.0
        )  # [BK, BN] rows [0, I) of w_gate_up[e]
        b_up = tl.load(
            w_e + (cols[None, :] + I) * stride_wn + ks[:, None] * stride_wh, mask=b_mask, other=0.0
        )  # [BK, BN] rows [I, 2I)
        if DOT_FP32:  # full fp32 products, not TF32 (see _dot_fp32)
            a = a.to(tl.float32)
            acc_gate = tl.dot(a, b_gate.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, b_up.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, b_gate, acc_gate)
            acc_up = tl.dot(a, b_up, acc_up)
    if HAS_LIMIT:
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # silu(gate) * up, [BM, BN]
    tl.store(
        act_ptr + slot[:, None].to(tl.int64) * stride_aa + cols[None, :] * stride_ai,
        act.to(act_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_assignments,
    H,
    I,
    stride_aa,
    stride_ai,
    stride_we,
    stride_wn,
    stride_wi,
    stride_oa,
    stride_oh,
    DOT_FP32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slot = tl.load(sorted_ids_ptr + pid_m * BM + tl.arange(0, BM))  # [BM]
    row_ok = slot < num_assignments
    slot64 = slot.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)  # [BN] columns of H
    col_ok = cols < H
    w_e = w_ptr + e * stride_we
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, I, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < I
        a = tl.load(
            act_ptr + slot64[:, None] * stride_aa + ks[None, :] * stride_ai,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        b = tl.load(
            w_e + cols[None, :] * stride_wn + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )  # [BK, BN] of w_down[e]
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    w = tl.load(weight_ptr + slot64, mask=row_ok, other=0.0)  # [BM] fp32 routing weights
    tl.store(
        out_ptr + slot64[:, None] * stride_oa + cols[None, :] * stride_oh,
        acc * w[:, None],
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _dot_fp32(dtype: torch.dtype, interpret: bool) -> bool:
    """Whether tl.dot runs on fp32 operands (IEEE products): for fp32 inputs, where the GPU
    default would be TF32, and under the interpreter, whose tl.dot multiplies bf16 bit
    patterns as integers (triton-lang/triton#11584); products of 16-bit floats are exact in
    fp32, so the numbers do not change."""
    return dtype == torch.float32 or interpret


def moe_experts_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    swiglu_limit: float | None,
    *,
    block_sizes: BlockSizes | None = None,
) -> torch.Tensor:
    """Routed experts by Triton fused-MoE kernels; same inputs and result as `moe_experts`.

    x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows); w_down [E, H, I]; weights [T, K]
    fp32; expert_ids [T, K] int64 in [0, E) (not checked here: that would need a host sync).
    Returns [T, H] in x.dtype: sum_k weights[t, k] * down_e(silu(clamp(gate, max=limit)) *
    clamp(up, -limit, limit)). Matmuls accumulate in fp32 (fp32 inputs: IEEE, not TF32); the
    activation is stored in x.dtype between the two GEMMs, as in vLLM.
    CUDA tensors, or CPU tensors with TRITON_INTERPRET=1. block_sizes overrides
    `default_block_sizes`. Raises ValueError for mismatched shapes or dtypes, or block sizes
    that are not powers of two >= 16.
    Reference: `kvmesh.kernels.moe.ref.moe_experts_ref`.
    """
    T, H, E, I, K = check_moe_args(x, w_gate_up, w_down, weights, expert_ids)
    A = T * K
    if A == 0:
        return x.new_zeros(T, H)
    bs = block_sizes or default_block_sizes(A, E)
    if any(b < 16 or b & (b - 1) for b in bs):
        raise ValueError(f"block sizes must be powers of two >= 16, got {tuple(bs)}")
    al = align_block_size(expert_ids, E, bs.m)
    interpret = triton.knobs.runtime.interpret
    dot_fp32 = _dot_fp32(x.dtype, interpret)
    act = torch.empty(A, I, dtype=x.dtype, device=x.device)  # [A, I] by assignment
    _launch_gate_up(x, w_gate_up, act, al, swiglu_limit, K, bs, dot_fp32, interpret)
    routed = torch.empty(A, H, dtype=torch.float32, device=x.device)  # [A, H] weighted outputs
    _launch_down(act, w_down, routed, weights, al, bs, dot_fp32, interpret)
    return routed.view(T, K, H).sum(dim=1).to(x.dtype)  # [T, H]


def _launch_gate_up(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    act: torch.Tensor,
    al: Alignment,
    swiglu_limit: float | None,
    K: int,
    bs: BlockSizes,
    dot_fp32: bool,
    interpret: bool,
) -> None:
    """Step 2: act [A, I] = clamped SwiGLU of x[token] @ w_gate_up[e]^T, one program per (row
    block, BN columns of I)."""
    (A, I), H = act.shape, x.shape[1]
    jit(_gate_up_kernel, interpret)[(al.block_expert.numel(), triton.cdiv(I, bs.n))](
        x,
        w_gate_up,
        act,
        al.sorted_ids,
        al.block_expert,
        al.num_padded,
        A,
        H,
        I,
        0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0),
        x.stride(1),
        *w_gate_up.stride(),
        *act.stride(),
        TOP_K=K,
        HAS_LIMIT=swiglu_limit is not None,
        DOT_FP32=dot_fp32,
        BM=bs.m,
        BN=bs.n,
        BK=bs.k,
    )


def _launch_down(
    act: torch.Tensor,
    w_down: torch.Tensor,
    routed: torch.Tensor,
    weights: torch.Tensor,
    al: Alignment,
    bs: BlockSizes,
    dot_fp32: bool,
    interpret: bool,
) -> None:
    """Step 3: routed [A, H] fp32 = act @ w_down[e]^T times each assignment's routing weight
    (weights [T, K]), one program per (row block, BN columns of H)."""
    (A, I), H = act.shape, routed.shape[1]
    jit(_down_kernel, interpret)[(al.block_expert.numel(), triton.cdiv(H, bs.n))](
        act,
        w_down,
        routed,
        weights.reshape(-1).float().contiguous(),
        al.sorted_ids,
        al.block_expert,
        al.num_padded,
        A,
        H,
        I,
        *act.stride(),
        *w_down.stride(),
        *routed.stride(),
        DOT_FP32=dot_fp32,
        BM=bs.m,
        BN=bs.n,
        BK=bs.k,
    )
