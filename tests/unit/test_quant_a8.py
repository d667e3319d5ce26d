"""int8 activations against Q4_1 blocks (kernels/quant_a8.py, `--quantization int8`): the
activations' quantization against llama.cpp's rule, the integer block sums exact (vpmaddubsw over
pairs, vpdpbusd over quads, and the plain-IR fallback of each), each output within the bound the
quantization allows, the same bits from either instruction, a row's bits the same alone or in a
batch, and the setting's refusals."""

import numba
import numpy as np
import pytest
import torch

from kvmesh.engine.precision import apply_quantization, check_quantization_spec
from kvmesh.kernels.quant import TN, pack_q4_1, quantized_matmul
from kvmesh.kernels.quant_a8 import A8_QUADS, A8_ROWS, has_vpdpbusd, make_q4_1_tile_a8, q4_1_tile_a8, quantize_rows_q8
from kvmesh.kernels.quant_a8_ir import _a8_block_rows
from kvmesh.kernels.ref import dequantize_q4_1_ref


def _q4_1(rng, n, k):
    qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    d = (rng.random((n, k // 32)) * 0.02).astype(np.float16)
    m = (-rng.random((n, k // 32)) * 0.1).astype(np.float16)
    return qs, d, m


def test_activations_quantize_as_llama_cpp_q8_1_rounds():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 96)) * rng.choice([1e-3, 1.0, 50.0], (3, 96))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, every value 0
    x[2, 0:32] = np.linspace(-127, 127, 32, dtype=np.float32) / 127 * 3  # exact steps of 3/127
    xq, xd, xsum = quantize_rows_q8(x)
    blocks = x.reshape(3, 3, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    assert np.allclose(xd, amax / 127, rtol=1e-6)
    scaled = blocks / np.where(amax > 0, amax / 127, 1)[..., None]
    expected = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)  # roundf: halves away from zero
    assert np.array_equal(xq.reshape(3, 3, 32), expected.astype(np.int8))
    assert np.abs(xq).max() == 127 and not xq[1, 32:64].any() and xd[1, 1] == 0
    assert np.allclose(xsum, blocks.sum(-1), rtol=1e-5, atol=1e-5)


def _block_rows_caller(R, native, quads):
    block = _a8_block_rows(R, native, quads)

    @numba.njit
    def call(xq, r0, k0, w8, blk):
        block(xq, r0, k0, w8, blk)

    return call


INSTRUCTIONS = [("vpmaddubsw", True, False), ("pairs in plain IR", False, False), ("quads in plain IR", False, True)]
if has_vpdpbusd():  # AVX-512 VNNI (Zen 4, Cascade Lake on); elsewhere its plain IR stands in
    INSTRUCTIONS.append(("vpdpbusd", True, True))


@pytest.mark.parametrize("name, native, quads", INSTRUCTIONS)
@pytest.mark.parametrize("R", [1, 4, A8_ROWS])
def test_block_sums_are_exact_integers_at_the_extremes(name, native, quads, R):
    rng = np.random.default_rng(R)
    xq = rng.integers(-128, 128, (A8_ROWS + 2, 96), dtype=np.int8)
    xq[0, 32:64] = -128  # the largest products of both signs, summed over the whole block
    xq[1, 32:64] = 127
    w8 = rng.integers(0, 16, (16, 2 * TN), dtype=np.uint8)
    w8[:, :8] = 15
    blk = np.full((A8_ROWS, TN), 7, np.int32)  # overwritten, not added to
    _block_rows_caller(R, native, quads)(xq, 1, 32, w8, blk)
    x = xq[1 : 1 + R, 32:64].astype(np.int64)  # [R, 32]: the inputs of block 1
    if quads:  # w8's bytes as [8, TN, 4]: inputs 4j .. 4j+3 of output n
        expected = np.einsum("rje,jne->rn", x.reshape(R, 8, 4), w8.reshape(8, TN, 4).astype(np.int64))
    else:  # [16, TN, 2]: inputs 2j, 2j+1 of output n
        expected = x[:, 0::2] @ w8[:, 0::2].astype(np.int64) + x[:, 1::2] @ w8[:, 1::2].astype(np.int64)
    assert np.array_equal(blk[:R], expected)
    assert np.array_equal(blk[R:], np.full((A8_ROWS - R, TN), 7))


@pytest.mark.parametrize("rows", [1, 5, 13])
def test_outputs_stay_within_the_activations_rounding_and_rows_keep_their_bits(rows):
    rng = np.random.default_rng(rows)
    qs, d, m = _q4_1(rng, 100, 96)  # a padded last tile too
    w4 = pack_q4_1(qs, d, m)
    x = (torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3).numpy()
    xq, xd, xsum = quantize_rows_q8(x)
    out = np.empty((rows, w4.qs.shape[0] * TN), np.float32)
    for t in range(w4.qs.shape[0]):
        q4_1_tile_a8(xq, xd, xsum, w4.qs, w4.d, w4.m, t, out)
    w = dequantize_q4_1_ref(*map(torch.from_numpy, (qs, d, m))).double().numpy()  # [N, K]
    exact = x.astype(np.float64) @ w.T
    # each input is off by at most half its block's step, and only d * q carries it (m takes exact sums)
    step = np.repeat(xd.astype(np.float64), 32, axis=1)  # [rows, K]
    dq = w - np.repeat(m.astype(np.float64), 32, axis=1)  # d * q
    bound = (step / 2) @ np.abs(dq).T + 1e-4 * np.abs(exact) + 1e-5
    error = np.abs(out[:, :100] - exact)
    assert (error <= bound).all(), float((error / bound).max())
    assert error.max() > 1e-4  # it is int8 arithmetic, not the fp32 path
    # the other instruction (pairs on vpmaddubsw, or quads on vpdpbusd / their plain IR): the same bits
    other, other_tile = np.empty_like(out), make_q4_1_tile_a8(not A8_QUADS)
    for t in range(w4.qs.shape[0]):
        other_tile(xq, xd, xsum, w4.qs, w4.d, w4.m, t, other)
    assert np.array_equal(other, out)
    # prefill's torch entry point (any rows, numba's threads) gives the fused step's tiles' bits
    assert np.array_equal(quantized_matmul(torch.from_numpy(x), w4, int8_activations=True).numpy(), out[:, :100])
    for r in range(rows):  # a row alone: the same bits as among the others
        alone = np.empty((1, out.shape[1]), np.float32)
        q1 = quantize_rows_q8(x[r : r + 1])
        for t in range(w4.qs.shape[0]):
            q4_1_tile_a8(*q1, w4.qs, w4.d, w4.m, t, alone)
        assert np.array_equal(alone[0], out[r])


def test_the_setting_refuses_what_it_cannot_do():
    for bad in ("int4", "fp8", "", "INT8"):
        with pytest.raises(ValueError, match=r"--quantization must be one of none\|int8, got"):
            check_quantization_spec(bad)
    assert "dtype" in apply_quantization(object(), "none")
    with pytest.raises(ValueError, match="object has no int8 path"):
        apply_quantization(object(), "int8")  # DeepSeek-V4's runner, say

    from kvmesh.engine.llama.runner import LlamaRunner
    from kvmesh.engine.loader import resolve_model

    dense = LlamaRunner(resolve_model(), num_pages=2, gguf_blocks=False)  # steps from dense weights, as on a GPU
    with pytest.raises(ValueError, match="needs the layers' Q4_1 blocks from a GGUF file on the CPU"):
        apply_quantization(dense, "int8")
