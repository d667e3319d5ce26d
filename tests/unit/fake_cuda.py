"""Fake `cuda` tensors on a CPU-only torch, and a recorder of what a step does with them.

PyTorch's `FakeTensorMode` creates tensors that claim a device and hold no data. On a CPU-only
build every Python-level indexing, `index_copy_` or `F.embedding` on a fake `cuda` tensor still
asks c10 for the CUDA device guard, which such a build never registered ("PyTorch is not linked
with support for cuda devices"; torch's own `_ensureCUDADeviceGuardSet` only patches CUDA builds
without a device). `load_fake_cuda_guard` compiles c10's `FakeGuardImpl<CUDA>` registration (six
lines of C++, against the headers the torch wheel ships) and loads it, after which the model code
runs unchanged on fake `cuda` tensors. `torch.cuda.is_available()` stays False.
"""

from __future__ import annotations

import ctypes
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_GUARD_SOURCE = """
#include <c10/core/impl/FakeGuardImpl.h>
namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;
c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::CUDA, &fake_cuda_guard);
}
"""


def load_fake_cuda_guard(build_dir: Path) -> None:
    """Compile (g++, ~2 s) and load the fake CUDA device guard into this process; a no-op on a
    torch that has one already (a CUDA build)."""
    if torch.version.cuda is not None:
        return
    root = Path(torch.__file__).parent
    src, lib = build_dir / "fake_cuda_guard.cpp", build_dir / "fake_cuda_guard.so"
    src.write_text(_GUARD_SOURCE)
    subprocess.run(
        ["g++", "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{root / 'include'}", str(src), f"-L{root / 'lib'}"]
        + ["-lc10", f"-Wl,-rpath,{root / 'lib'}", "-o", str(lib)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    ctypes.CDLL(str(lib))


@dataclass
class Trace:
    """What a step dispatched: each op with its tensor inputs' and outputs' devices."""

    ops: list[tuple[str, list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)

    def violations(self, allowed_to_host: int = 1) -> list[str]:
        """What breaks device residency: an op that reads a device tensor and leaves a result on
        the host (a device-to-host copy; the first `allowed_to_host` of them, the sampled ids, are
        the step's own), and every `.item()` of a device tensor (`aten._local_scalar_dense`, a
        host sync; reading the host copy of the ids is none)."""
        found, to_host = [], 0
        for name, inputs, outputs in self.ops:
            on_device = any(t.device.type == "cuda" for t in inputs)
            if name.startswith("aten._local_scalar_dense") and on_device:
                found.append(f"{name}: a host sync (.item(), int(), bool() of a tensor)")
                continue
            if on_device:
                host = [t for t in outputs if t.device.type != "cuda"]
                if host:
                    to_host += 1
                    if to_host > allowed_to_host:
                        found.append(f"{name}: device to host, {[tuple(t.shape) for t in host]}")
        return found

    def to_host_copies(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The device-to-host results, in order: (op, shape, dtype)."""
        out = []
        for name, inputs, outputs in self.ops:
            if any(t.device.type == "cuda" for t in inputs):
                out += [(name, tuple(t.shape), t.dtype) for t in outputs if t.device.type != "cuda"]
        return out

    def names(self) -> set[str]:
        return {name for name, _, _ in self.ops}


class Recorder(TorchDispatchMode):
    """Records every op dispatched inside it (entered inside the FakeTensorMode, so the fake
    mode runs them) into `trace`."""

    def __init__(self) -> None:
        super().__init__()
        self.trace = Trace()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors_out: list[torch.Tensor] = []
        tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.trace.ops.append((str(func), tensors_in, tensors_out))  # recorded even if the op raises
        out = func(*args, **(kwargs or {}))
        tensors_out += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def tensors_of(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, dataclass fields, lists, tuples and
    dicts (a runner's weights, pages and slots), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors_of(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors_of(x, seen)]
    module = type(obj).__module__ or ""
    if hasattr(obj, "__dict__") and module.startswith(("kvmesh.engine.", "kvmesh.kernels.")):
        return [t for x in vars(obj).values() for t in tensors_of(x, seen)]
    return []
