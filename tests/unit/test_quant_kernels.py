"""The GGUF block kernels (kernels/quant.py) against their references, and the blocks the loader
keeps (engine/gguf_blocks.py) against gguf-py and transformers' fp32 conversion."""

import numpy as np
import pytest
import torch

from kvmesh.engine.checkpoint import load_checkpoint_tensors
from kvmesh.engine.gguf_blocks import GGUFBlocks, _from_raw, extract_blocks, load_blocks
from kvmesh.engine.loader import default_gguf_path, resolve_model
from kvmesh.kernels.quant import TN, block_sums, pack_q4_1, pack_q8_0, q4_1_tile, q8_0_tile, quantized_matmul
from kvmesh.kernels.ref import dequantize_q4_1_ref, dequantize_q8_0_ref, quantized_matmul_ref


def _q4_1(rng, n, k):
    qs = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    d = (rng.random((n, k // 32)) * 0.02).astype(np.float16)
    m = (-rng.random((n, k // 32)) * 0.1).astype(np.float16)
    return qs, d, m


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("n", [TN, 100])  # one whole tile, and a padded last tile
def test_q4_1_matmul_matches_dequantized_reference(rows, n):
    rng = np.random.default_rng(rows * n)
    qs, d, m = _q4_1(rng, n, 96)
    w = dequantize_q4_1_ref(*map(torch.from_numpy, (qs, d, m)))  # [N, K]
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(n)) * 3
    out = quantized_matmul(x, pack_q4_1(qs, d, m))
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, quantized_matmul_ref(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_q8_0_matmul_matches_dequantized_reference(rows):
    rng = np.random.default_rng(rows)
    q = rng.integers(-128, 128, (130, 64), dtype=np.int8)
    d = (rng.random((130, 2)) * 0.01).astype(np.float16)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    out = quantized_matmul(x, pack_q8_0(q, d))
    ref = quantized_matmul_ref(x, dequantize_q8_0_ref(torch.from_numpy(q), torch.from_numpy(d)))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_each_row_is_computed_the_same_alone_or_in_a_batch():
    # batched decode must give each sequence the logits it gets alone, bit for bit: 7 rows go
    # through an unpacked block in groups of 6 and 1 (2 rows: one group of 2); alone, a row
    # streams the bytes
    rng = np.random.default_rng(7)
    w = pack_q4_1(*_q4_1(rng, 192, 64))
    w8 = pack_q8_0(rng.integers(-128, 128, (192, 64), dtype=np.int8), (rng.random((192, 2)) * 0.01).astype(np.float16))
    x = torch.randn(7, 64)
    for weight in (w, w8):
        alone = torch.cat([quantized_matmul(x[i : i + 1], weight) for i in range(7)])
        assert torch.equal(quantized_matmul(x, weight), alone)
        assert torch.equal(quantized_matmul(x[1:3], weight), alone[1:3])  # a group of 2 at rows 1, 2


@pytest.mark.parametrize("rows", [1, 2, 5, 13])  # one row streams; several: unpacked once, groups of <= 6
def test_tiles_give_the_batched_kernels_bits(rows):
    # the fused decode step (kvmesh.engine.llama.step) multiplies tile by tile with
    # q4_1_tile / q8_0_tile: its rows must come out exactly as quantized_matmul computes them
    rng = np.random.default_rng(3)
    w4 = pack_q4_1(*_q4_1(rng, 100, 96))  # a padded last tile too
    w8 = pack_q8_0(rng.integers(-128, 128, (130, 64), dtype=np.int8), (rng.random((130, 2)) * 0.01).astype(np.float16))
    x4, x8 = (torch.randn(rows, 96) * 3).numpy(), torch.randn(rows, 64).numpy()
    out4 = np.empty((rows, w4.qs.shape[0] * TN), np.float32)
    out8 = np.empty((rows, w8.q.shape[0] * TN), np.float32)
    for t in range(w4.qs.shape[0]):
        q4_1_tile(x4, block_sums(x4), w4.qs, w4.d, w4.m, t, out4)
    for t in range(w8.q.shape[0]):
        q8_0_tile(x8, w8.q, w8.d, t, out8)
    assert np.array_equal(out4[:, :100], quantized_matmul(torch.from_numpy(x4), w4).numpy())
    assert np.array_equal(out8[:, :130], quantized_matmul(torch.from_numpy(x8), w8).numpy())
    # and each row alone (the one-row path) gives the bits it got among the others
    for r in range(rows):
        alone4 = quantized_matmul(torch.from_numpy(x4[r : r + 1]), w4).numpy()
        alone8 = quantized_matmul(torch.from_numpy(x8[r : r + 1]), w8).numpy()
        assert np.array_equal(alone4[0], out4[r, :100]) and np.array_equal(alone8[0], out8[r, :130])


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(0)
    qs, d, m = _q4_1(rng, 64, 64)
    with pytest.raises(ValueError, match="blocks of 32"):
        pack_q4_1(qs[:, :24], d, m)  # 48 inputs: not whole blocks
    with pytest.raises(ValueError, match="one row per output"):
        pack_q4_1(qs, d[:10], m)
    w = pack_q4_1(qs, d, m)
    with pytest.raises(ValueError, match=r"fp32 \[M, 64\]"):
        quantized_matmul(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match=r"fp32 \[M, 64\]"):
        quantized_matmul(torch.randn(2, 64, dtype=torch.float64), w)


def test_unpacked_ggml_rows_dequantize_like_gguf_py():
    # the real file's first rows of a Q4_1 and the Q8_0 tensor, unpacked by us and by gguf-py
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(default_gguf_path())
    seen = set()
    for tensor in reader.tensors:
        kind = {"Q4_1": "q4_1", "Q8_0": "q8_0"}.get(tensor.tensor_type.name)
        if kind is None or kind in seen:
            continue
        seen.add(kind)
        raw = np.asarray(tensor.data)[:8]  # 8 output rows
        ours = _from_raw(kind, raw).dequantize()
        theirs = dequantize(raw, tensor.tensor_type).reshape(8, -1)
        assert ours.shape == theirs.shape and np.array_equal(ours.numpy(), theirs), kind
    assert seen == {"q4_1", "q8_0"}


def test_loader_keeps_blocks_equal_to_the_fp32_checkpoint():
    files = resolve_model()
    blocks = load_blocks(files.checkpoint_dir)
    # 30 layers x 7 projections (Q4_1) and the tied embedding (Q8_0): none fell back to fp32
    assert len(blocks) == 30 * 7 + 1
    assert blocks["model.embed_tokens.weight"].kind == "q8_0"
    fp32 = load_checkpoint_tensors(files.checkpoint_dir)
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]:
        # q_proj and k_proj rows went through transformers' RoPE un-permutation too
        assert torch.equal(blocks[name].dequantize(), fp32[name]), name


def test_blocks_that_differ_from_the_checkpoint_are_left_out(tmp_path):
    import json

    files = resolve_model()
    config = json.loads((files.checkpoint_dir / "config.json").read_text())
    fp32 = load_checkpoint_tensors(files.checkpoint_dir)
    name = "model.layers.3.mlp.up_proj.weight"
    fp32[name] = fp32[name].clone()
    fp32[name][5, 5] += 1e-3  # one weight off: this tensor must be served from fp32
    kept = extract_blocks(default_gguf_path(), config, fp32)
    assert name not in kept and len(kept) == 30 * 7
    assert isinstance(kept["model.layers.3.mlp.gate_proj.weight"], GGUFBlocks)
