# T=rows of activations (tokens), K=input features, N=output features
"""fp32 GEMMs for prefill through oneDNN (PyTorch's MKL-DNN build) instead of `x @ w`.

On the CPUs this project runs on (AMD EPYC, AVX-512), `x @ w` in PyTorch's wheels calls MKL's
sgemm, which runs a generic code path on non-Intel processors; oneDNN JIT-compiles for the
host's AVX-512 whatever its vendor. One core, [2048, 576] @ [576, 1536] fp32: MKL 97 GFLOP/s,
oneDNN 208 (with its layout conversions), numpy's OpenBLAS 219 (`kernels.bench_dense`).
transformers' forward goes through MKL, so this is where prefill gets ahead of it.

The numbers are an fp32 GEMM's like MKL's, summed in another order: within the rounding two
BLAS libraries differ by, which the prefill parity tests bound (logits within 1e-4 of
transformers). oneDNN's threads are PyTorch's OpenMP team (`torch.set_num_threads`).
"""

from __future__ import annotations

import torch

MIN_ROWS = 16
"""GEMMs with fewer rows stay on `x @ w`: the two layout conversions around a oneDNN call cost
more than they save on a few rows (decode steps use `kernels.quant` anyway)."""


def onednn_weight(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's copy of an input-major weight w [K, N] fp32, as `dense_matmul` takes it
    ([N, K] in MKL-DNN layout, K*N*4 bytes more); None where oneDNN is not built in or w is
    not an fp32 CPU tensor (then `dense_matmul` uses `x @ w`)."""
    if not torch.backends.mkldnn.is_available() or w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    return w.t().contiguous().to_mkldnn()


def dense_matmul(x: torch.Tensor, w: torch.Tensor, dnn: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ w [K, N] -> [T, N] in x.dtype, through oneDNN when `dnn` (`onednn_weight(w)`)
    is given and T >= MIN_ROWS. Raises RuntimeError (from PyTorch) when the shapes disagree."""
    if dnn is None or x.shape[0] < MIN_ROWS:
        return x @ w
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), dnn, None).to_dense()
