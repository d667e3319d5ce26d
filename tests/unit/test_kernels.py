"""Each kernel against its plain reference in kernels/ref.py, at odd shapes."""

import random

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels import apply_rotary, build_attention_metadata, paged_attention, rms_norm, rope_table, silu_and_mul
from kvmesh.kernels.ref import apply_rotary_ref, paged_attention_ref, rms_norm_ref, rope_cos_sin_ref, silu_and_mul_ref
from tests.unit.paged_cases import D, K, L, P, Q, S, run_both

# a tiny GQA layout: 6 query heads over 2 kv heads, pages of 4 token slots


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


def test_rms_norm_matches_transformers_formula():
    x = torch.randn(7, 33) * 50  # large values, like Llama's massive activations
    w = torch.randn(33)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


def test_rope_table_is_bit_identical_to_transformers_angles():
    cos, sin_rot = rope_table(300, 64, 1e5)
    pos = torch.tensor([0, 1, 17, 299])
    cos_ref, sin_ref = rope_cos_sin_ref(pos, 64, 1e5)
    torch.testing.assert_close(cos[pos], cos_ref, rtol=0, atol=0)
    # sin_rot carries rotate_half's sign in its first half
    torch.testing.assert_close(sin_rot[pos, 32:], sin_ref[:, 32:], rtol=0, atol=0)
    torch.testing.assert_close(sin_rot[pos, :32], -sin_ref[:, :32], rtol=0, atol=0)


def test_apply_rotary_on_a_strided_slice():
    T, X, Dh = 5, 3, 64
    fused = torch.randn(T, (X + 2) * Dh)  # like the fused qkv output; rotate only the first X heads
    x = fused[:, : X * Dh].view(T, X, Dh)
    pos = torch.tensor([0, 3, 4, 15, 100])
    cos, sin_rot = rope_table(128, Dh, 1e4)
    cos_ref, sin_ref = rope_cos_sin_ref(pos, Dh, 1e4)
    got = apply_rotary(x, cos[pos][:, None], sin_rot[pos][:, None])
    torch.testing.assert_close(got, apply_rotary_ref(x, cos_ref, sin_ref), rtol=0, atol=0)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 13)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))


def test_reference_attention_equals_dense_causal_sdpa():
    # guard the guard: one sequence written from scratch is plain causal GQA attention
    n = 9
    q, k, v = torch.randn(n, Q, D), torch.randn(n, K, D), torch.randn(n, K, D)
    cache = torch.zeros(P, L, 2, S, K, D)
    out = paged_attention_ref(q, k, v, cache, 1, [0], [n], [[5, 2, 7]])
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(Q // K, 1).transpose(0, 1),
        v.repeat_interleave(Q // K, 1).transpose(0, 1),
        is_causal=True,
    )  # [Q, n, D]
    torch.testing.assert_close(out, dense.transpose(0, 1).reshape(n, Q * D))


@pytest.mark.parametrize(
    "num_computed,num_new",
    [
        ([0], [1]),  # first token of a sequence
        ([4, 0, 12, 6], [1, 1, 1, 1]),  # decode batch, lengths 5, 1, 13, 7: partial pages
        ([7, 7], [1, 1]),  # equal lengths: the unmasked decode path
        ([0], [7]),  # prefill, partial last page
        ([0], [8]),  # prefill, exactly two pages
        ([5], [6]),  # prefill after a cached prefix ending mid-page
        ([8], [3]),  # prefill after a page-aligned cached prefix
        ([3, 0, 9, 4, 0], [1, 5, 1, 4, 1]),  # mixed: decode, prefill, decode, prefix+prefill, first
    ],
)
def test_paged_attention_matches_reference(num_computed, num_new):
    out, ref, cache, cache_ref = run_both(num_computed, num_new, layer=1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    # the same slots were written, with the same values, and nothing else changed
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)


def test_strided_q_k_v_are_accepted():
    # the model passes slices of the fused qkv output, not contiguous tensors
    T = 5
    qkv = torch.randn(T, (Q + 2 * K) * D)
    q = qkv[:, : Q * D].view(T, Q, D)
    k = qkv[:, Q * D : (Q + K) * D].view(T, K, D)
    v = qkv[:, (Q + K) * D :].view(T, K, D)
    cache, cache_ref = torch.zeros(P, L, 2, S, K, D), torch.zeros(P, L, 2, S, K, D)
    meta = build_attention_metadata([2], [T], [[3, 9]], S, L, P)
    cache_ref[[3, 3]] = cache[[3, 3]] = 0.5  # a prefix of two tokens of constant K/V
    out = paged_attention(q, k, v, cache, 0, meta)
    ref = paged_attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), cache_ref, 0, [2], [T], [[3, 9]])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_metadata_rejects_short_page_lists_and_bad_page_ids():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_attention_metadata([4], [5], [[0, 1]], S, L, P)  # 2 pages of 4 < 9 tokens
    with pytest.raises(ValueError, match=r"page ids must be in \[0, 24\)"):
        build_attention_metadata([0], [1], [[P]], S, L, P)
    with pytest.raises(ValueError, match="1 new token"):
        build_attention_metadata([0], [0], [[0]], S, L, P)
