"""Kernel backend by name: `torch` (runs anywhere) or `triton` (a CUDA GPU, or the Triton
interpreter on CPU with TRITON_INTERPRET=1, as the kernel tests run it).

A backend is the set of DeepSeek-V4 kernels that have a Triton path: the routed experts
(`kernels.moe`) and the Lightning Indexer scores (`kernels.indexer`). `--kernel-backend` on
`kvmesh serve prefill|decode` picks one; the model code calls `backend.moe_experts(...)` and
`backend.indexer_scores(...)` and never chooses itself. Both backends compute the same result
as `kernels.moe.ref` / `kernels.indexer.ref` (tests compare them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelBackend:
    """The kernels one backend runs (signatures of `kernels.moe.moe_experts` and
    `kernels.indexer.indexer_scores`)."""

    name: str
    moe_experts: Callable[..., Any]
    """(x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights [T, K] fp32, expert_ids [T, K]
    int64, swiglu_limit) -> [T, H] in x.dtype."""
    indexer_scores: Callable[..., Any]
    """(q [T, Hi, Di], k [N, Di], head_weights [T, Hi], softmax_scale) -> fp32 [T, N]."""


def _torch() -> KernelBackend:
    from kernels.indexer import indexer_scores
    from kernels.moe import moe_experts

    return KernelBackend("torch", moe_experts, indexer_scores)


def _triton() -> KernelBackend:
    import torch

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpret:
        raise ValueError(
            "kernel backend 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels "
            "in Triton's interpreter on CPU); this machine has no GPU: use --kernel-backend torch"
        )
    from kernels.indexer import indexer_scores_triton
    from kernels.moe import moe_experts_triton

    if interpret:
        return KernelBackend("triton", moe_experts_triton, indexer_scores_triton)
    return KernelBackend("triton", _on_gpu(moe_experts_triton), _on_gpu(indexer_scores_triton))


def _on_gpu(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel run on the GPU whatever device its tensor arguments are on, its result returned
    to the first argument's device (the runners keep weights on the CPU today)."""

    def run(*args: Any) -> Any:
        import torch

        home = args[0].device
        moved = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        return kernel(*moved).to(home)

    return run


BACKENDS: dict[str, Callable[[], KernelBackend]] = {"torch": _torch, "triton": _triton}
"""Kernel backends by name; `--kernel-backend` picks one."""


def check_backend(name: str) -> None:
    """Raise ValueError naming the known backends when `name` is not one of them."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {list(BACKENDS)}, got {name!r}")


def create_kernel_backend(name: str = "torch") -> KernelBackend:
    """The backend called `name`. Raises ValueError for an unknown name (naming the known ones)
    or for `triton` without a GPU or the interpreter."""
    check_backend(name)
    return BACKENDS[name]()
