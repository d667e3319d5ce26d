"""Lightning Indexer kernels against kernels/indexer/ref.py and transformers' scorer.

Scores (PyTorch path) against `DeepseekV4IndexerScorer`, top-k selection with its fixed
tie-break against a per-query sort, and the Triton scores under the interpreter on CPU
(KVMESH_TEST_DEVICE=cuda, as `python -m kvmesh.bench.kernels_gpu` sets it, runs them on a GPU).
"""

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

import kvmesh.kernels.indexer.ops as indexer_ops
from kvmesh.kernels.indexer import indexer_scores, indexer_scores_triton, indexer_topk
from kvmesh.kernels.indexer.ref import indexer_masked_scores_ref, indexer_scores_ref, indexer_topk_ref


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _inputs(T, Hi, Di, N, dtype=torch.float32):
    q, k = torch.randn(T, Hi, Di), torch.randn(N, Di)
    w = torch.randn(T, Hi) * Hi**-0.5  # signed, as weights_proj(h) * Hi^-0.5 is
    return q.to(dtype), k.to(dtype), w


# --- scores ------------------------------------------------------------------------------


@pytest.mark.parametrize("T,Hi,Di,N", [(1, 8, 16, 5), (7, 3, 40, 70), (13, 64, 128, 33)])
def test_indexer_scores_matches_reference(T, Hi, Di, N):
    q, k, w = _inputs(T, Hi, Di, N)
    out = indexer_scores(q, k, w, Di**-0.5)
    assert out.dtype == torch.float32 and out.shape == (T, N)
    torch.testing.assert_close(out, indexer_scores_ref(q, k, w, Di**-0.5))


def test_indexer_scores_matches_transformers_scorer():
    cfg = DeepseekV4Config(hidden_size=32, num_hidden_layers=2, vocab_size=50, index_n_heads=4, index_head_dim=16)
    scorer = DeepseekV4IndexerScorer(cfg)
    with torch.no_grad():
        scorer.weights_proj.weight.copy_(torch.randn(4, 32))
    S, N = 9, 21
    q = torch.randn(1, S, 4, 16)  # [B, S, Hi, Di] after RoPE
    compressed_kv = torch.randn(1, N, 16)  # [B, N, Di]
    hidden = torch.randn(1, S, 32)
    with torch.no_grad():
        hf = scorer(q, compressed_kv, hidden)[0]  # [S, N]
        head_weights = scorer.weights_proj(hidden[0]).float() * scorer.weights_scaling  # [S, Hi]
    out = indexer_scores(q[0], compressed_kv[0], head_weights, scorer.softmax_scale)
    torch.testing.assert_close(out, hf, rtol=1e-6, atol=1e-6)


def test_indexer_scores_in_chunks_equals_one_chunk(monkeypatch):
    q, k, w = _inputs(10, 4, 16, 9)
    whole = indexer_scores(q, k, w, 0.25)
    monkeypatch.setattr(indexer_ops, "_CHUNK_ELEMENTS", 3 * 4 * 9)  # 3 queries a chunk: 3+3+3+1
    torch.testing.assert_close(indexer_scores(q, k, w, 0.25), whole, rtol=0, atol=0)


def test_indexer_scores_relu_drops_negative_logits():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one query, two heads
    k = torch.tensor([[2.0, -3.0], [-1.0, -1.0]])
    w = torch.tensor([[0.5, -2.0]])
    # entry 0: head 0 sees 2 -> 0.5*2, head 1 sees -3 -> 0; entry 1: both negative -> 0
    torch.testing.assert_close(indexer_scores(q, k, w, 1.0), torch.tensor([[1.0, 0.0]]))


def test_indexer_scores_rejects_mismatched_shapes():
    q, k, w = _inputs(3, 4, 16, 5)
    with pytest.raises(ValueError, match=r"need q \[T, Hi, Di\], k \[N, Di\]"):
        indexer_scores(q, k[:, :8], w, 1.0)
    with pytest.raises(ValueError, match="head_weights"):
        indexer_scores(q, k, w[:, :3], 1.0)


# --- top-k -------------------------------------------------------------------------------


def test_indexer_topk_equal_scores_go_to_the_lower_index():
    # ReLU zeros tie: 0.0404 first, 0.0052 second, then the zeros in index order
    scores = torch.tensor([[0.0404, 0.0, 0.0, 0.0052, 0.0]])
    got = indexer_topk(scores, 4, torch.tensor([5]))
    assert got.tolist() == [[0, 3, 1, 2]]
    assert got.dtype == torch.int64
    assert indexer_topk_ref(scores, 4, torch.tensor([5])).tolist() == [[0, 3, 1, 2]]


def test_indexer_topk_negative_zero_ties_with_zero():
    # 0 * (negative head weight) is -0.0; it must tie with +0.0, not rank below it
    scores = torch.tensor([[0.0, -0.0, 0.0, -0.0, -1.0], [-0.0, 0.0, -2.0, 0.0, 3.0]])
    got = indexer_topk(scores, 5, torch.tensor([5, 5]))
    assert got.tolist() == [[0, 1, 2, 3, 4], [4, 0, 1, 3, 2]]


def test_indexer_topk_num_valid_masks_with_minus_one():
    scores = torch.tensor(
        [[0.1, 0.9, 0.5, 0.7], [0.1, 0.9, 0.5, 0.7], [0.1, 0.9, 0.5, 0.7], [float("-inf"), 0.9, 0.5, 0.7]]
    )
    num_valid = torch.tensor([0, 1, 3, 4])  # query 3's entry 0 is valid though -inf
    got = indexer_topk(scores, 3, num_valid)
    assert got.tolist() == [[-1, -1, -1], [0, -1, -1], [1, 2, 0], [1, 3, 2]]
    assert torch.equal(got, indexer_topk_ref(scores, 3, num_valid))
    got = indexer_topk(scores, 4, num_valid)
    assert got[3].tolist() == [1, 3, 2, 0]  # a selectable -inf is still selected, last


def test_indexer_topk_larger_than_the_entries():
    scores = torch.tensor([[0.3, 0.0, 0.3], [1.0, 2.0, 3.0]])
    got = indexer_topk(scores, 8, torch.tensor([3, 2]))
    assert got.tolist() == [[0, 2, 1], [1, 0, -1]]  # min(top_k, N) = 3 slots
    assert indexer_topk(scores[:, :0], 8, torch.tensor([0, 0])).shape == (2, 0)


def test_indexer_topk_matches_reference_with_many_ties():
    T, N = 12, 300
    scores = torch.relu(torch.randint(-4, 5, (T, N)).float() * 0.25)  # many exact ties, zeros
    scores[::2] *= -1  # -0.0 and negatives in half the rows
    num_valid = torch.randint(0, N + 1, (T,))
    num_valid[0] = N
    for top_k in (1, 17, 128, 300):
        torch.testing.assert_close(
            indexer_topk(scores, top_k, num_valid), indexer_topk_ref(scores, top_k, num_valid), rtol=0, atol=0
        )


def test_indexer_topk_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        indexer_topk(torch.zeros(2, 4), 0, torch.tensor([4, 4]))
    with pytest.raises(ValueError, match=r"num_valid \[T\]"):
        indexer_topk(torch.zeros(2, 4), 2, torch.tensor([4]))


# --- Triton scores -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,Hi,Di,N,block_n",
    [
        (21, 3, 40, 70, 32),  # nothing a multiple of a block: 2 query blocks, 3 entry blocks
        (1, 8, 16, 37, 16),  # decode: one query, 8 heads
        (3, 64, 128, 20, 16),  # V4's indexer heads and head_dim
    ],
)
def test_indexer_scores_triton_matches_reference(triton_device, T, Hi, Di, N, block_n):
    q, k, w = _inputs(T, Hi, Di, N)
    dev = triton_device
    out = indexer_scores_triton(q.to(dev), k.to(dev), w.to(dev), Di**-0.5, block_n=block_n).cpu()
    torch.testing.assert_close(out, indexer_scores_ref(q, k, w, Di**-0.5), rtol=1e-5, atol=1e-5)


def test_indexer_scores_triton_masks_unselectable_entries(triton_device):
    T, Hi, Di, N = 6, 4, 24, 50
    q, k, w = _inputs(T, Hi, Di, N)
    num_valid = torch.tensor([0, 1, 17, 49, 50, 33])
    dev = triton_device
    out = indexer_scores_triton(q.to(dev), k.to(dev), w.to(dev), 0.2, num_valid.to(dev), block_n=16).cpu()
    ref = indexer_masked_scores_ref(q, k, w, 0.2, num_valid)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(out[0]).all() and torch.isfinite(out[4]).all()
    # the PyTorch top-k on the Triton scores picks what the reference picks
    assert torch.equal(indexer_topk(out, 10, num_valid), indexer_topk_ref(ref, 10, num_valid))


def test_indexer_scores_triton_bf16(triton_device):
    q, k, w = _inputs(4, 8, 32, 45, dtype=torch.bfloat16)
    dev = triton_device
    out = indexer_scores_triton(q.to(dev), k.to(dev), w.to(dev), 32**-0.5, block_n=16).cpu()
    # bf16 products are exact in fp32: only the summation order differs from the reference
    torch.testing.assert_close(out, indexer_scores_ref(q, k, w, 32**-0.5), rtol=1e-5, atol=1e-5)
