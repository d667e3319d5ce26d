# T=tokens, E=routed experts, K=experts per token, A=T*K (token, expert) assignments,
# P=assignments after padding each expert's group to BM, BM/BN/BK=block sizes along rows
# (assignments), output columns, reduction
"""The grouped-GEMM tiling of the Triton fused-MoE kernels (kvmesh.kernels.moe.triton_moe), and
their step 1, the alignment (`align_block_size`, PyTorch ops, no host sync): the A = T*K
assignments sorted by expert and each expert's group padded to a multiple of BLOCK_M with a
sentinel (A), so every row block belongs to one expert (vLLM's / sglang's `moe_align_block_size`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockSizes(NamedTuple):
    """Tile shape of both grouped GEMMs (each >= 16, as tl.dot needs on a GPU)."""

    m: int  # assignments per row block, the padding unit of each expert's group
    n: int  # output columns per program
    k: int  # reduction step


def default_block_sizes(num_assignments: int, num_experts: int) -> BlockSizes:
    """vLLM's default fused_moe config: small row blocks when experts get few tokens (decode)."""
    if num_assignments <= 2 * num_experts:
        return BlockSizes(16, 64, 64)
    return BlockSizes(64, 64, 64)


class Alignment(NamedTuple):
    sorted_ids: torch.Tensor  # [P_max] int32 assignment of each row, A where padding
    block_expert: torch.Tensor  # [P_max / BM] int32 expert of each row block
    num_padded: torch.Tensor  # [1] int32 rows in use (P); blocks past it exit at once


def align_block_size(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort assignments by expert and pad each expert's group to a multiple of block_m.

    expert_ids [T, K] int64 in [0, E). Assignment a = t*K + k. P_max = A + min(E, A)*(BM-1)
    bounds P without reading it back (at most A experts get tokens), so no host sync.
    """
    flat = expert_ids.reshape(-1)  # [A]
    A = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [A] assignments grouped by expert
    expert_of = flat[order]  # [A]
    rank = torch.arange(A, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # [A] within group
    rows = (padded_end - padded)[expert_of] + rank  # [A] padded row of each sorted assignment
    p_max = A + min(num_experts, A) * (block_m - 1)
    sorted_ids = torch.full((p_max,), A, dtype=torch.int32, device=dev)
    sorted_ids[rows] = order.to(torch.int32)
    block_start = torch.arange(0, p_max, block_m, device=dev)  # [P_max / BM]
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # E past the end
    return Alignment(sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32))
