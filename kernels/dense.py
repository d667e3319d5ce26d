# T=rows of activations (tokens), K=input features, N=output features
"""fp32 GEMMs for prefill through oneDNN (PyTorch's MKL-DNN build) instead of `x @ w`, on the
CPUs where that is faster: those not made by Intel.

`x @ w` in PyTorch's x86 wheels calls MKL's sgemm, which runs a generic code path on non-Intel
processors; oneDNN JIT-compiles for the host's AVX-512 whatever its vendor. One core, `python -m
kvmesh.bench.dense` (GFLOP/s, layout conversions included):
- AMD EPYC (Zen 5): [2048, 576] @ [576, 1536], MKL 97, oneDNN 208: oneDNN;
- Intel Xeon (AVX-512, AMX): the four matmuls of a layer, MKL 206-218, oneDNN 125-191: MKL.
transformers' forward goes through MKL, so on AMD this is where prefill gets ahead of it.
`KVMESH_PREFILL_GEMM=onednn` or `=mkl` overrides the choice by vendor.

The numbers are an fp32 GEMM's like MKL's, summed in another order: within the rounding two
BLAS libraries differ by, which the prefill parity tests bound (logits within 1e-4 of
transformers). oneDNN's threads are PyTorch's OpenMP team (`torch.set_num_threads`).
"""

from __future__ import annotations

import functools
import os

import torch

MIN_ROWS = 16
"""GEMMs with fewer rows stay on `x @ w`: the two layout conversions around a oneDNN call cost
more than they save on a few rows (decode steps use `kvmesh.kernels.quant` anyway)."""


@functools.cache
def onednn_is_faster() -> bool:
    """Whether prefill's GEMMs go through oneDNN here: `KVMESH_PREFILL_GEMM` ("onednn" or "mkl")
    when set, else True unless the CPU is Intel's (`vendor_id` in /proc/cpuinfo: MKL's own fast
    path) or unknown. Raises ValueError for another value of the variable."""
    chosen = os.environ.get("KVMESH_PREFILL_GEMM", "").strip().lower()
    if chosen:
        if chosen not in ("onednn", "mkl"):
            raise ValueError(f"KVMESH_PREFILL_GEMM must be 'onednn' or 'mkl', got {chosen!r}")
        return chosen == "onednn"
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        vendor = ""
    return vendor not in ("", "GenuineIntel")


def onednn_weight(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's copy of an input-major weight w [K, N] fp32, as `dense_matmul` takes it
    ([N, K] in MKL-DNN layout, K*N*4 bytes more); None where MKL is the faster (`onednn_is_faster`),
    oneDNN is not built in or w is not an fp32 CPU tensor (then `dense_matmul` uses `x @ w`)."""
    if (
        not onednn_is_faster()
        or not torch.backends.mkldnn.is_available()
        or w.dtype != torch.float32
        or w.device.type != "cpu"
    ):
        return None
    return w.t().contiguous().to_mkldnn()


def dense_matmul(x: torch.Tensor, w: torch.Tensor, dnn: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ w [K, N] -> [T, N] in x.dtype, through oneDNN when `dnn` (`onednn_weight(w)`)
    is given and T >= MIN_ROWS. Raises RuntimeError (from PyTorch) when the shapes disagree."""
    if dnn is None or x.shape[0] < MIN_ROWS:
        return x @ w
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), dnn, None).to_dense()
