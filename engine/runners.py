"""Model architecture -> runner: the one place that reads which architecture a checkpoint is and
builds its `Runner` (engine/forward.py). Add an architecture by adding its builder here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmesh.engine.checkpoint import ModelFiles, architecture
from kvmesh.engine.device import resolve_device
from kvmesh.engine.precision import Precision, resolve_dtype
from kvmesh.kernels.backend import KernelBackend, create_kernel_backend

if TYPE_CHECKING:
    from kvmesh.engine.forward import Runner


@dataclass(frozen=True)
class RunnerSpec:
    """What a builder gets: the checkpoint, the pool's pages (page_size tokens each), the state
    slots where the architecture keeps per-request state, the MoE and indexer kernels, the device
    and the dtype weights, activations and pages take there."""

    files: ModelFiles
    num_pages: int
    page_size: int
    num_state_slots: int
    kernels: KernelBackend
    device: torch.device
    dtype: torch.dtype = torch.float32


def _llama(s: RunnerSpec) -> Runner:
    # Llama has no MoE or indexer: on the CPU its decode runs the GGUF block kernels (kvmesh.kernels.quant)
    # whatever the backend, on a GPU the paged decode attention op (kvmesh.kernels.custom_ops)
    from kvmesh.engine.llama.runner import LlamaRunner  # imported on use: each pulls in its model code

    return LlamaRunner(s.files, s.num_pages, s.page_size, s.dtype, device=s.device)


def _deepseek_v4(s: RunnerSpec) -> Runner:
    from kvmesh.engine.deepseek_v4.runner import DeepseekV4Runner

    return DeepseekV4Runner(s.files, s.num_pages, s.page_size, s.num_state_slots, s.kernels, device=s.device)


RUNNERS: dict[str, Callable[[RunnerSpec], Runner]] = {
    "LlamaForCausalLM": _llama,
    "DeepseekV4ForCausalLM": _deepseek_v4,
}
"""config.json's `architectures[0]` -> builder(RunnerSpec)."""

DTYPES: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("float32", "bfloat16"),
    "DeepseekV4ForCausalLM": ("float32",),
}
"""The dtypes each architecture's runner computes in (`--dtype`, kvmesh.engine.precision). DeepSeek-V4's
state rows and kernels are fp32 only so far: its `auto` is fp32 and `--dtype bfloat16` is refused."""


def runner_precision(files: ModelFiles, device: torch.device, dtype: str = "float32") -> Precision:
    """What `dtype` (auto|float32|bfloat16) resolves to for `files`' architecture on `device`, and
    why (kvmesh.engine.precision.resolve_dtype). Raises ValueError for an architecture no runner
    serves (naming those served), and as resolve_dtype does."""
    arch = architecture(files)
    if arch not in RUNNERS:
        raise ValueError(f"model {files.name!r} has architecture {arch!r}; supported: {sorted(RUNNERS)}")
    return resolve_dtype(dtype, device, DTYPES[arch], arch.removesuffix("ForCausalLM"))


def create_runner(
    files: ModelFiles,
    num_pages: int,
    page_size: int = 16,
    num_state_slots: int = 64,
    kernel_backend: str = "torch",
    device: str | torch.device = "cpu",
    dtype: str = "float32",
) -> Runner:
    """The runner for the checkpoint's architecture, with `num_pages` pages of `page_size` tokens
    (and `num_state_slots` state slots where the architecture keeps per-request state), its
    MoE and indexer kernels from `kernel_backend` (kernels/backend.py), its weights, pages and
    slots on `device` (auto|cpu|cuda[:N], kvmesh.engine.device, or a torch.device), computing in
    `dtype` (auto|float32|bfloat16: `runner_precision`).

    Raises ValueError for an architecture no runner serves (naming the ones that are served), an
    unknown or unavailable kernel backend, device or dtype, and whatever the runner raises for a
    bad checkpoint.
    """
    where = device if isinstance(device, torch.device) else resolve_device(device)
    precision = runner_precision(files, where, dtype)
    kernels = create_kernel_backend(kernel_backend, where)
    spec = RunnerSpec(files, num_pages, page_size, num_state_slots, kernels, where, precision.dtype)
    return RUNNERS[architecture(files)](spec)
