# T=tokens, H=hidden, E=experts, I=expert intermediate, K=experts per token (MoE) or kv heads
# (attention), Hi/Di=indexer heads/head_dim, N=indexer entries, B=sequences, Q=query heads,
# D=head_dim, P=pages, L=layers, S=page_size, M=pages of one sequence
"""The kernels the models call, as PyTorch custom ops (`torch.library.custom_op`): one op each,
whatever the device, dispatched by the tensors' device.

- `kvmesh::moe_experts` (kernels.moe.moe_experts' contract)
- `kvmesh::indexer_scores` (kernels.indexer.indexer_scores')
- `kvmesh::paged_decode_attention` (kernels.paged_decode's)

On CUDA each runs its Triton kernel; on CPU its PyTorch path, or the Triton kernel in Triton's
interpreter when TRITON_INTERPRET=1 (how the tests check the kernels through the ops). Each has
a fake implementation (shapes and dtypes only), so FakeTensorMode, meta tensors and
torch.compile trace through them without running a kernel. No op copies between devices: the
tensors stay where the caller keeps them.

The ops follow PyTorch's custom-op tutorial (torch.library.custom_op, register_kernel,
register_fake), as vLLM registers its own kernels; they are registered when this module is
imported.
"""

from __future__ import annotations

import os

import torch

from kernels.indexer import indexer_scores as _indexer_scores_torch
from kernels.moe import moe_experts as _moe_experts_torch
from kernels.paged_decode import paged_decode_attention_torch


def _interpret() -> bool:
    """Triton kernels run in the interpreter on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# --- routed experts ---------------------------------------------------------------------------


@torch.library.custom_op("kvmesh::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts, x [T, H] -> [T, H] in x.dtype (kernels.moe.moe_experts: shapes, errors)."""
    if _interpret():
        from kernels.moe import moe_experts_triton

        return moe_experts_triton(x, w_gate_up, w_down, weights, expert_ids, swiglu_limit)
    return _moe_experts_torch(x, w_gate_up, w_down, weights, expert_ids, swiglu_limit)


@moe_experts.register_kernel("cuda")
def _moe_experts_cuda(x, w_gate_up, w_down, weights, expert_ids, swiglu_limit):
    from kernels.moe import moe_experts_triton

    return moe_experts_triton(x, w_gate_up, w_down, weights, expert_ids, swiglu_limit)


@moe_experts.register_fake
def _moe_experts_fake(x, w_gate_up, w_down, weights, expert_ids, swiglu_limit):
    return torch.empty_like(x)


# --- Lightning Indexer scores -------------------------------------------------------------------


@torch.library.custom_op("kvmesh::indexer_scores", mutates_args=())
def indexer_scores(q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """q [T, Hi, Di], k [N, Di], head_weights [T, Hi] -> fp32 [T, N] (kernels.indexer.indexer_scores)."""
    if _interpret():
        from kernels.indexer import indexer_scores_triton

        return indexer_scores_triton(q, k, head_weights, softmax_scale)
    return _indexer_scores_torch(q, k, head_weights, softmax_scale)


@indexer_scores.register_kernel("cuda")
def _indexer_scores_cuda(q, k, head_weights, softmax_scale):
    from kernels.indexer import indexer_scores_triton

    return indexer_scores_triton(q, k, head_weights, softmax_scale)


@indexer_scores.register_fake
def _indexer_scores_fake(q, k, head_weights, softmax_scale):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


# --- paged decode attention ---------------------------------------------------------------------


@torch.library.custom_op("kvmesh::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """q [B, Q, D] over kv_cache [P, L, 2, S, K, D] -> [B, Q, D] in q.dtype
    (kernels.paged_decode.paged_decode_attention_triton: arguments, errors)."""
    if _interpret():
        from kernels.paged_decode import paged_decode_attention_triton

        return paged_decode_attention_triton(q, kv_cache, layer, block_table, context_lens)
    return paged_decode_attention_torch(q, kv_cache, layer, block_table, context_lens)


@paged_decode_attention.register_kernel("cuda")
def _paged_decode_attention_cuda(q, kv_cache, layer, block_table, context_lens):
    from kernels.paged_decode import paged_decode_attention_triton

    return paged_decode_attention_triton(q, kv_cache, layer, block_table, context_lens)


@paged_decode_attention.register_fake
def _paged_decode_attention_fake(q, kv_cache, layer, block_table, context_lens):
    return torch.empty_like(q)
