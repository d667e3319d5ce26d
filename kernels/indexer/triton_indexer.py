# T=queries, N=compressed indexer keys (entries), Hi=indexer heads, Di=indexer head_dim,
# BT=queries per program, BN=entries per program, BD=Di rounded up to a power of two
"""Lightning Indexer scores as one Triton kernel (DeepSeek-V4 §2.3.1, eqs. 13-17).

One program scores BT queries against BN entries: it loads the [BD, BN] key tile once, then
for each head h runs one [BT, BD] x [BD, BN] tl.dot and adds w[:, h] * relu(.) * scale into a
[BT, BN] fp32 accumulator, heads in order as the reference adds them. Entries a query may not
select (n >= num_valid[t]) are set to -inf before the store. The [T, Hi, N] intermediate of
the PyTorch path never exists.

Top-k selection is not a Triton kernel: `indexer_topk` (PyTorch, any device) runs on these
scores; its own masking of n >= num_valid[t] then changes nothing.

The kernel is jitted at first launch and calls only triton.language builtins (tl.full, not
tl.zeros, which is itself @triton.jit and fixed in one mode when triton is imported), so
TRITON_INTERPRET=1 set after triton's import still runs it on CPU tensors.
The reference is `kvmesh.kernels.indexer.ref.indexer_scores_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.indexer.ops import check_score_args
from kvmesh.kernels.triton_jit import jit


def _indexer_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    valid_ptr,
    out_ptr,
    T,
    N,
    Hi,
    Di,
    scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kd,
    stride_wt,
    stride_wh,
    stride_ot,
    stride_on,
    HAS_VALID: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)  # [BT] queries
    t_ok = t < T
    t64 = t.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)  # [BN] entries
    n_ok = n < N
    n64 = n.to(tl.int64)
    d = tl.arange(0, BD)  # the whole head_dim in one step
    d_ok = d < Di
    kb = tl.load(
        k_ptr + n64[None, :] * stride_kn + d[:, None] * stride_kd, mask=d_ok[:, None] & n_ok[None, :], other=0.0
    )  # [BD, BN], reused by all heads
    if DOT_FP32:
        kb = kb.to(tl.float32)
    score = tl.full((BT, BN), 0.0, tl.float32)
    for h in range(0, Hi):
        qa = tl.load(
            q_ptr + t64[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
            mask=t_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BT, BD]
        if DOT_FP32:  # full fp32 products (fp32 inputs; 16-bit ones under the interpreter)
            logits = tl.dot(qa.to(tl.float32), kb, input_precision="ieee")  # [BT, BN]
        else:
            logits = tl.dot(qa, kb)
        w = tl.load(w_ptr + t64 * stride_wt + h * stride_wh, mask=t_ok, other=0.0)  # [BT]
        # ReLU, * softmax_scale, * head weight, summed over heads: DeepseekV4IndexerScorer's order
        score += tl.maximum(logits, 0.0) * scale * w.to(tl.float32)[:, None]
    if HAS_VALID:
        nv = tl.load(valid_ptr + t, mask=t_ok, other=0)  # [BT]
        score = tl.where(n[None, :] < nv[:, None], score, float("-inf"))
    tl.store(out_ptr + t64[:, None] * stride_ot + n64[None, :] * stride_on, score, mask=t_ok[:, None] & n_ok[None, :])


def indexer_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    head_weights: torch.Tensor,
    softmax_scale: float,
    num_valid: torch.Tensor | None = None,
    *,
    block_t: int = 16,
    block_n: int = 64,
) -> torch.Tensor:
    """`indexer_scores` by a Triton kernel, optionally masking entries a query may not select.

    q [T, Hi, Di]; k [N, Di]; head_weights [T, Hi] (already scaled); num_valid [T] int64 or
    None. Returns fp32 [T, N]: sum_h head_weights[t, h] * relu(q[t, h] . k[n]) * softmax_scale,
    and -inf where n >= num_valid[t]. q and k of different dtypes are both computed in fp32;
    fp32 inputs use IEEE fp32 products (not TF32), 16-bit inputs accumulate in fp32.
    CUDA tensors, or CPU tensors with TRITON_INTERPRET=1. block_t/block_n: queries and entries
    per program. Raises ValueError for mismatched shapes or block sizes that are not powers of
    two >= 16.
    Reference: `kvmesh.kernels.indexer.ref.indexer_scores_ref` (masked: `indexer_masked_scores_ref`).
    """
    T, Hi, Di = check_score_args(q, k, head_weights)
    N = k.shape[0]
    if num_valid is not None and num_valid.shape != (T,):
        raise ValueError(f"num_valid must have shape [{T}], got {list(num_valid.shape)}")
    if any(b < 16 or b & (b - 1) for b in (block_t, block_n)):
        raise ValueError(f"block_t and block_n must be powers of two >= 16, got {block_t}, {block_n}")
    out = torch.empty(T, N, dtype=torch.float32, device=q.device)
    if T == 0 or N == 0:
        return out
    if q.dtype != k.dtype:
        q, k = q.float(), k.float()
    interpret = triton.knobs.runtime.interpret
    # the interpreter multiplies bf16 bit patterns as integers in tl.dot
    # (triton-lang/triton#11584); 16-bit products are exact in fp32, so upcasting is lossless
    dot_fp32 = q.dtype == torch.float32 or interpret
    jit(_indexer_scores_kernel, interpret)[(triton.cdiv(T, block_t), triton.cdiv(N, block_n))](
        q,
        k,
        head_weights,
        num_valid if num_valid is not None else out,
        out,
        T,
        N,
        Hi,
        Di,
        float(softmax_scale),
        *q.stride(),
        *k.stride(),
        *head_weights.stride(),
        *out.stride(),
        HAS_VALID=num_valid is not None,
        DOT_FP32=dot_fp32,
        BT=block_t,
        BN=block_n,
        BD=max(16, triton.next_power_of_2(Di)),
    )
    return out
