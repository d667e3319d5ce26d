"""kvmesh.kernels.dense: prefill's fp32 GEMMs through oneDNN give x @ w's numbers (to fp32 rounding),
and go through oneDNN only where it is the faster library (or where KVMESH_PREFILL_GEMM says);
bf16 GEMMs where the CPU only emulates bf16 run in fp32 and give a bf16 GEMM's numbers."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.dense import MIN_ROWS, dense_matmul, onednn_is_faster, onednn_weight, prefill_copy


@pytest.fixture(autouse=True)
def gemm_choice(monkeypatch):
    """oneDNN chosen, whatever this CPU's vendor; the cached choice forgotten before and after."""
    monkeypatch.setenv("KVMESH_PREFILL_GEMM", "onednn")
    onednn_is_faster.cache_clear()
    yield monkeypatch
    onednn_is_faster.cache_clear()


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


@pytest.mark.parametrize("rows", [1, 100])
def test_emulated_bf16_gemms_run_in_fp32_and_round_as_a_bf16_gemm(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g).bfloat16(), torch.randn(576, 960, generator=g).bfloat16()
    assert prefill_copy(w, bf16_native=True) is None  # native: torch's own bf16 GEMM (oneDNN)
    copy = prefill_copy(w, bf16_native=False)
    assert copy is not None and copy.dtype == torch.float32 and torch.equal(copy, w.float())
    y = dense_matmul(x, w, copy)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 960)
    # exactly the fp32 sums of the exact products, rounded once to bf16
    exact = x.double() @ w.double()
    assert torch.equal(y, (x.float() @ w.float()).bfloat16())
    # so within a bf16 rounding (and fp32 summation) of the exact result, as torch's bf16 GEMM is
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close((x @ w).double(), exact, rtol=2**-8, atol=1e-3)
    assert prefill_copy(w.float(), bf16_native=False) is not None  # fp32: oneDNN's copy, as before
    assert prefill_copy(w.float(), bf16_native=False).is_mkldnn


def test_mkl_chosen_means_no_onednn_copy(gemm_choice):
    gemm_choice.setenv("KVMESH_PREFILL_GEMM", "MKL")
    onednn_is_faster.cache_clear()
    w = torch.randn(64, 32)
    assert onednn_weight(w) is None
    x = torch.randn(40, 64)
    assert torch.equal(dense_matmul(x, w, onednn_weight(w)), x @ w)


def test_choice_by_vendor_and_a_bad_setting(gemm_choice):
    gemm_choice.delenv("KVMESH_PREFILL_GEMM")
    onednn_is_faster.cache_clear()
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    assert onednn_is_faster() is (not intel)  # MKL's own fast path on Intel's CPUs
    gemm_choice.setenv("KVMESH_PREFILL_GEMM", "openblas")
    onednn_is_faster.cache_clear()
    with pytest.raises(ValueError, match="KVMESH_PREFILL_GEMM"):
        onednn_is_faster()
