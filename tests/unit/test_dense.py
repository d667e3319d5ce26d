"""kernels.dense: prefill's fp32 GEMMs through oneDNN give x @ w's numbers (to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch

from kernels.dense import MIN_ROWS, dense_matmul, onednn_weight


@pytest.mark.parametrize("rows", [MIN_ROWS, 100, 513])
def test_onednn_matches_the_blas_gemm(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(576, 960, generator=g)
    dnn = onednn_weight(w)
    assert dnn is not None and dnn.is_mkldnn, "this CPU build of torch has oneDNN"
    y = dense_matmul(x, w, dnn)
    assert y.shape == (rows, 960) and y.dtype == torch.float32 and not y.is_mkldnn
    # another library's summation order: fp32 rounding of 576-term dot products, no more
    torch.testing.assert_close(y, x @ w, rtol=1e-5, atol=1e-4)
    # and really another code path (a pass-through would be bit-identical)
    assert not torch.equal(y, x @ w)


def test_strided_rows_and_few_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    dnn = onednn_weight(w)
    wide = torch.randn(40, 128, generator=g)
    x = wide[:, ::2]  # a strided view, as slices of fused outputs are
    torch.testing.assert_close(dense_matmul(x, w, dnn), x @ w, rtol=1e-5, atol=1e-5)
    few = x[: MIN_ROWS - 1]
    assert torch.equal(dense_matmul(few, w, dnn), few @ w)  # below MIN_ROWS: x @ w itself
    assert torch.equal(dense_matmul(x, w, None), x @ w)


def test_no_onednn_copy_for_other_dtypes():
    assert onednn_weight(torch.zeros(4, 4, dtype=torch.bfloat16)) is None
