"""Where a model instance computes: the one place `--device` is read and turned into a torch
device and the dtypes that go with it (weights, KV pages, state slots).

- `cpu`: fp32 weights and pages in host memory (shared memory, kvmesh.engine.kv_layout), the numba
  block kernels for Llama's decode, the PyTorch paths of the other kernels.
- `cuda[:N]`: bf16 weights (dequantized from GGUF at load for Llama; V4 keeps its checkpoint's
  fp32 state layout), KV pages and state slots allocated on the device, the Triton kernels as
  torch custom ops (kvmesh.kernels.custom_ops), sampling on the device.
- `auto`: `cuda:0` when torch sees a CUDA device, else `cpu`.

As vLLM's `--device` and SGLang's `--device` do, the choice is made once at start; a service
asked for a device it cannot see refuses to start (`DeviceUnavailableError`, a ValueError, which
`kvmesh serve` turns into "error: ..." and exit status 2 before any port opens).
"""

from __future__ import annotations

import re

import torch

DEVICE_CHOICES = "auto|cpu|cuda[:N]"

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceUnavailableError(ValueError):
    """`--device` names a device torch cannot see on this machine."""


def check_device_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is auto, cpu, cuda or cuda:N (N >= 0)."""
    m = _SPEC.match(spec)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {spec!r}")


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device `spec` (auto|cpu|cuda[:N]) means on this machine, always with an index
    for CUDA (`cuda:0` for `cuda`).

    Raises ValueError for a malformed spec, and DeviceUnavailableError when `spec` asks for CUDA
    and torch sees no CUDA device (a CPU-only build of torch, no driver, CUDA_VISIBLE_DEVICES
    empty) or fewer devices than index N + 1; the message names the cause and the flag.
    """
    check_device_spec(spec)
    kind, _, index = spec.partition(":")
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    n = int(index or 0)
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
        raise DeviceUnavailableError(
            f"--device {spec}: torch {torch.__version__} ({build}) sees no CUDA device; install a CUDA build of "
            "torch on a machine with a GPU (docs/gpu.md), or use --device cpu"
        )
    if n >= torch.cuda.device_count():
        raise DeviceUnavailableError(
            f"--device {spec}: torch sees {torch.cuda.device_count()} CUDA device(s), so cuda:{n} does not exist"
        )
    return torch.device("cuda", n)


def weight_dtype(device: torch.device) -> torch.dtype:
    """The dtype a runner built without one takes on `device`: fp32 on the CPU (the parity tests
    hold transformers' fp32 numbers there), bf16 on a GPU. Services choose theirs with `--dtype`
    (kvmesh.engine.precision)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16
