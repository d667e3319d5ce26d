"""Model architecture -> runner: the one place that reads which architecture a checkpoint is and
builds its `Runner` (engine/forward.py). Add an architecture by adding its builder here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.checkpoint import ModelFiles, architecture
from kernels.backend import KernelBackend, create_kernel_backend

if TYPE_CHECKING:
    from engine.forward import Runner


def _llama(files: ModelFiles, num_pages: int, page_size: int, num_state_slots: int, kernels: KernelBackend) -> Runner:
    # Llama has no MoE or indexer: its decode runs the GGUF block kernels (kernels.quant) whatever the backend
    from engine.llama_runner import LlamaRunner  # imported on use: each pulls in its model code

    return LlamaRunner(files, num_pages, page_size)


def _deepseek_v4(
    files: ModelFiles, num_pages: int, page_size: int, num_state_slots: int, kernels: KernelBackend
) -> Runner:
    from engine.v4_runner import DeepseekV4Runner

    return DeepseekV4Runner(files, num_pages, page_size, num_state_slots, kernels)


RUNNERS: dict[str, Callable[[ModelFiles, int, int, int, KernelBackend], Runner]] = {
    "LlamaForCausalLM": _llama,
    "DeepseekV4ForCausalLM": _deepseek_v4,
}
"""config.json's `architectures[0]` -> builder(files, num_pages, page_size, num_state_slots, kernels)."""


def create_runner(
    files: ModelFiles, num_pages: int, page_size: int = 16, num_state_slots: int = 64, kernel_backend: str = "torch"
) -> Runner:
    """The runner for the checkpoint's architecture, with `num_pages` pages of `page_size` tokens
    (and `num_state_slots` state slots where the architecture keeps per-request state), its
    MoE and indexer kernels from `kernel_backend` (kernels/backend.py).

    Raises ValueError for an architecture no runner serves (naming the ones that are served), an
    unknown or unavailable kernel backend, and whatever the runner raises for a bad checkpoint.
    """
    arch = architecture(files)
    if arch not in RUNNERS:
        raise ValueError(f"model {files.name!r} has architecture {arch!r}; supported: {sorted(RUNNERS)}")
    return RUNNERS[arch](files, num_pages, page_size, num_state_slots, create_kernel_backend(kernel_backend))
