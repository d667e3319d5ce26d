"""Kernel backend by name: `torch` (runs anywhere) or `triton` (a CUDA GPU, or the Triton
interpreter on CPU with TRITON_INTERPRET=1, as the kernel tests run it).

A backend is the set of DeepSeek-V4 kernels that have a Triton path: the routed experts
(`kvmesh.kernels.moe`) and the Lightning Indexer scores (`kvmesh.kernels.indexer`). `--kernel-backend` on
`kvmesh serve prefill|decode` picks one on the CPU; on a GPU (`--device cuda`) the model calls
the custom ops of kvmesh.kernels.custom_ops, whose CUDA kernels are the Triton ones. The model code calls `backend.moe_experts(...)` and
`backend.indexer_scores(...)` and never chooses itself. Both backends compute the same result
as `kvmesh.kernels.moe.ref` / `kvmesh.kernels.indexer.ref` (tests compare them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelBackend:
    """The kernels one backend runs (signatures of `kvmesh.kernels.moe.moe_experts` and
    `kvmesh.kernels.indexer.indexer_scores`)."""

    name: str
    moe_experts: Callable[..., Any]
    """(x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights [T, K] fp32, expert_ids [T, K]
    int64, swiglu_limit) -> [T, H] in x.dtype."""
    indexer_scores: Callable[..., Any]
    """(q [T, Hi, Di], k [N, Di], head_weights [T, Hi], softmax_scale) -> fp32 [T, N]."""


def _torch() -> KernelBackend:
    from kvmesh.kernels.indexer import indexer_scores
    from kvmesh.kernels.moe import moe_experts

    return KernelBackend("torch", moe_experts, indexer_scores)


def _triton() -> KernelBackend:
    import torch

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret:
        gpu = "--device cuda" if torch.cuda.is_available() else "a CUDA GPU and --device cuda"
        raise ValueError(
            f"kernel backend 'triton' needs {gpu} (or TRITON_INTERPRET=1 to run the kernels in Triton's "
            "interpreter on CPU tensors); on the CPU use --kernel-backend torch"
        )
    from kvmesh.kernels.indexer import indexer_scores_triton
    from kvmesh.kernels.moe import moe_experts_triton

    return KernelBackend("triton", moe_experts_triton, indexer_scores_triton)


def _device_ops() -> KernelBackend:
    """The custom ops (kvmesh.kernels.custom_ops): Triton kernels on the tensors' GPU, no copies."""
    import torch

    import kvmesh.kernels.custom_ops  # noqa: F401  # registers torch.ops.kvmesh.*

    return KernelBackend("triton", torch.ops.kvmesh.moe_experts, torch.ops.kvmesh.indexer_scores)


BACKENDS: dict[str, Callable[[], KernelBackend]] = {"torch": _torch, "triton": _triton}
"""Kernel backends by name; `--kernel-backend` picks one."""


def check_backend(name: str) -> None:
    """Raise ValueError naming the known backends when `name` is not one of them."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {list(BACKENDS)}, got {name!r}")


def create_kernel_backend(name: str = "torch", device: Any = "cpu") -> KernelBackend:
    """The backend called `name` for a model on `device` (a torch.device or its name). On a GPU
    that is always the custom ops (`torch.ops.kvmesh.*`, the Triton kernels on the tensors'
    device: no copies), whatever `name`. Raises ValueError for an unknown name (naming the known
    ones) or for `triton` on the CPU without the interpreter."""
    check_backend(name)
    if str(device) != "cpu":
        return _device_ops()
    return BACKENDS[name]()
