# T=rows of activations (tokens), K=input features, N=output features
"""fp32 GEMMs for prefill through oneDNN (PyTorch's MKL-DNN build) instead of `x @ w`, on the
CPUs where that is faster: those not made by Intel; and bf16 GEMMs as fp32 ones where the CPU
only emulates bf16 (`prefill_copy`).

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
    return w.t().contiguous().to_mkldnn()  # .contiguous() copies nothing when w is the view .t() of [N, K]


def prefill_copy(w: torch.Tensor, bf16_native: bool = True) -> torch.Tensor | None:
    """The copy of an input-major weight w [K, N] (contiguous, or the view .t() of an [N, K]
    tensor, which spares oneDNN's copy a transpose) that `dense_matmul` computes with: oneDNN's for
    an fp32 w (`onednn_weight`); w in fp32 ([K, N], K*N*4 bytes more) for a bf16 w on a CPU that
    only emulates bf16 (bf16_native False: no AVX-512 BF16 or AMX, `kvmesh.engine.precision.native_bf16`);
    else None. Emulated, torch's bf16 GEMM ran 90x slower than its fp32 one (`x @ w`, [160, 576] @
    [576, 1536], 251 against 2.8 ms; 27 ms with w [N, K]; AMD EPYC Zen 3, AVX2, 2 cores)."""
    if w.dtype == torch.bfloat16 and w.device.type == "cpu" and not bf16_native:
        return w.float().contiguous()  # [K, N] in rows, whatever w's strides
    return onednn_weight(w)


def dense_matmul(x: torch.Tensor, w: torch.Tensor, dnn: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ w [K, N] -> [T, N] in x.dtype, through oneDNN when `dnn` (`onednn_weight(w)`)
    is given and T >= MIN_ROWS. For bf16 x with `dnn` (`prefill_copy`: w in fp32 where bf16 is
    emulated), the GEMM runs in fp32 on x's values and rounds its output to bf16: what a native
    bf16 GEMM computes (the products of bf16 values exact in fp32, summed in fp32), in another
    order. Raises RuntimeError (from PyTorch) when the shapes disagree."""
    if dnn is not None and x.dtype == torch.bfloat16:
        return (x.float() @ dnn).to(torch.bfloat16)
    if dnn is None or x.shape[0] < MIN_ROWS:
        return x @ w
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), dnn, None).to_dense()
