"""The Triton paged decode attention kernel (kernels/paged_decode.py) against the references,
under Triton's interpreter on CPU (on a GPU with KVMESH_TEST_DEVICE=cuda)."""

import pytest
import torch

from kvmesh.kernels.paged_decode import paged_decode_attention_triton
from kvmesh.kernels.ref import paged_attention_ref, paged_decode_attention_ref
from tests.unit.paged_cases import decode_case


def _triton(q, kv, layer, table, lens, device, dtype=None):
    """The kernel on `device` (the page table and lengths as tensors of `dtype`), back on the CPU."""
    table_t, lens_t = (torch.tensor(x, dtype=dtype, device=device) for x in (table, lens))
    return paged_decode_attention_triton(q.to(device), kv.to(device), layer, table_t, lens_t).cpu()


@pytest.mark.parametrize(
    "B, Q, K, D, S, lens",
    [
        (3, 6, 2, 16, 4, [1, 5, 13]),  # R = 3, pages of 4: a one-token context, partial last pages
        (4, 9, 3, 24, 16, [16, 17, 40, 2]),  # SmolLM2's 9/3 heads; head_dim not a power of two
        (2, 4, 4, 32, 8, [8, 23]),  # R = 1 (no GQA)
    ],
)
def test_triton_paged_decode_equals_the_reference(triton_device, B, Q, K, D, S, lens):
    q, kv, table = decode_case(B, Q, K, D, S, lens)
    want = paged_decode_attention_ref(q, kv, 1, table, lens)
    got = _triton(q, kv, 1, table, lens, triton_device, torch.int32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_paged_decode_equals_the_models_reference_after_its_write(triton_device):
    # kvmesh.kernels.ref.paged_attention_ref writes each sequence's new token's K/V into its page, then
    # attends (what the model's step does); the kernel reads that cache and must agree
    B, Q, K, D, S, prior = 3, 9, 3, 16, 4, [0, 6, 11]
    q, kv, table = decode_case(B, Q, K, D, S, [n + 1 for n in prior], seed=1)
    g = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn(B, K, D, generator=g), torch.randn(B, K, D, generator=g)
    want = paged_attention_ref(q, k_new, v_new, kv, 0, prior, [1] * B, table).reshape(B, Q, D)
    got = _triton(q, kv, 0, table, [n + 1 for n in prior], triton_device)  # int64 page ids work too
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_slots_past_the_context_are_never_read(triton_device):
    # NaN in every slot past each context (the last pages' tails, the padding page): the CPU path
    # needs those finite (kernels/attention.py); this kernel masks its loads and stays exact
    B, Q, K, D, S, lens = 2, 4, 2, 16, 8, [3, 9]
    q, kv, table = decode_case(B, Q, K, D, S, lens, seed=3)
    want = paged_decode_attention_ref(q, kv, 0, table, lens)
    for pages, n in zip(table, lens):
        for p in range(n, len(pages) * S):
            kv[pages[p // S], :, :, p % S] = float("nan")
    got = _triton(q, kv, 0, table, lens, triton_device)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_paged_decode_bf16(triton_device):
    # bf16 K/V and queries: products exact in fp32, the softmax and sums in fp32, one rounding
    # to bf16 at the end; the reference computes in fp32 from the same bf16 values
    B, Q, K, D, S, lens = 2, 6, 2, 32, 16, [5, 30]
    q, kv, table = decode_case(B, Q, K, D, S, lens, dtype=torch.bfloat16, seed=4)
    want = paged_decode_attention_ref(q.float(), kv.float(), 1, table, lens)
    got = _triton(q, kv, 1, table, lens, triton_device)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_shapes_that_disagree_are_refused():
    q, kv, table = decode_case(2, 6, 2, 16, 4, [3, 5])
    t, n = torch.tensor(table), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="Q % K"):
        paged_decode_attention_triton(q[:, :5], kv, 0, t, n)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention_triton(q[..., :8].contiguous(), kv, 0, t, n)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention_triton(q.double(), kv, 0, t, n)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention_triton(q, kv, 0, t, n[:1])
    with pytest.raises(ValueError, match="layer"):
        paged_decode_attention_triton(q, kv, 2, t, n)
