# T=tokens, H=hidden, E=experts, I=expert intermediate, K=experts per token (MoE) or kv heads
# (attention), Hi/Di=indexer heads/head_dim, N=indexer entries, B=sequences, Q=query heads,
# D=head_dim, P=pages, L=layers, S=page_size, M=pages of one sequence
"""The kernels the models call, as PyTorch custom ops: one op each, whatever the device,
dispatched by the tensors' device.

- `kvmesh::moe_experts` (kvmesh.kernels.moe.moe_experts' contract)
- `kvmesh::indexer_scores` (kvmesh.kernels.indexer.indexer_scores')
- `kvmesh::paged_decode_attention` (kvmesh.kernels.paged_decode's)

On CUDA each runs its Triton kernel; on CPU its PyTorch path, or the Triton kernel in Triton's
interpreter when TRITON_INTERPRET=1 (how the tests check the kernels through the ops). Each has
a fake implementation (shapes and dtypes only), so FakeTensorMode, meta tensors and
torch.compile trace through them without running a kernel. No op copies between devices: the
tensors stay where the caller keeps them.

Each op is a schema (`torch.library.Library.define`) with a kernel a device (`torch.library.impl`)
and a fake one (`torch.library.register_fake`), as PyTorch's custom-op guide and vLLM's own
kernels do; they are registered when this module is imported and called as
`torch.ops.kvmesh.<name>`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kvmesh.kernels.indexer import indexer_scores, indexer_scores_triton
from kvmesh.kernels.moe import moe_experts, moe_experts_triton
from kvmesh.kernels.paged_decode import paged_decode_attention_torch, paged_decode_attention_triton

_lib = torch.library.Library("kvmesh", "DEF")  # kept: the ops live as long as this module


def _interpret() -> bool:
    """Triton kernels run in the interpreter on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _define(schema: str, torch_path: Callable, triton_kernel: Callable, fake: Callable) -> None:
    """Define `kvmesh::<schema>` with its CPU kernel (torch_path, or triton_kernel in the
    interpreter), its CUDA kernel (triton_kernel) and its fake implementation."""
    name = "kvmesh::" + schema.split("(")[0]
    _lib.define(schema)

    def cpu(*args):
        return (triton_kernel if _interpret() else torch_path)(*args)

    torch.library.impl(name, "cpu", lib=_lib)(cpu)
    torch.library.impl(name, "cuda", lib=_lib)(triton_kernel)
    torch.library.register_fake(name, lib=_lib)(fake)


_define(
    "moe_experts(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor weights, Tensor expert_ids, float? swiglu_limit)"
    " -> Tensor",
    moe_experts,
    moe_experts_triton,
    lambda x, *_: torch.empty_like(x),  # [T, H] in x.dtype
)
_define(
    "indexer_scores(Tensor q, Tensor k, Tensor head_weights, float softmax_scale) -> Tensor",
    indexer_scores,
    indexer_scores_triton,
    lambda q, k, *_: q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32),  # fp32 [T, N]
)
_define(
    "paged_decode_attention(Tensor q, Tensor kv_cache, int layer, Tensor block_table, Tensor context_lens) -> Tensor",
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    lambda q, *_: torch.empty_like(q),  # [B, Q, D] in q.dtype
)
