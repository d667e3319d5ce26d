"""Prefill attention in query blocks (`kvmesh.kernels.attention._causal_blocks`) against the references.

Blocks of 256 queries never split the tiny prompts of test_kernels.py, so these tests shrink
the block to a few queries (every block boundary, the diagonal and the merge of the keys before
it run on a handful of tokens), then check the real block size at the default model's shapes
and, on the real checkpoint, prompts longer than one block against transformers.
"""

import random

import pytest
import torch

import kvmesh.kernels.attention as attention
from kvmesh.kernels import build_attention_metadata, paged_attention
from tests.unit.paged_cases import run_both


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)


@pytest.mark.parametrize("block", [1, 3, 4, 256])
@pytest.mark.parametrize(
    "num_computed,num_new",
    [
        ([0], [7]),  # no prefix: blocks of 3, 3, 1; the first has no keys before it
        ([0], [6]),  # no prefix, a whole number of blocks
        ([0], [2]),  # the smallest prefill
        ([5], [6]),  # a cached prefix ending mid-page, then blocks
        ([8], [9]),  # a page-aligned prefix
        ([3], [10]),  # prefix and blocks both off every boundary
        ([0, 6], [7, 5]),  # two prefills, no decode: each scattered into its rows
        ([3, 0, 9, 4, 0, 2], [1, 5, 1, 7, 1, 4]),  # decodes and three prefills, one after a prefix
    ],
)
def test_blocked_prefill_matches_reference(monkeypatch, block, num_computed, num_new):
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    out, ref, cache, cache_ref = run_both(num_computed, num_new, layer=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)  # the same K/V written, nothing else


@pytest.mark.parametrize("nc,n", [(0, 600), (45, 600), (1536, 512), (1920, 128)])
def test_default_block_at_model_shapes_matches_fp64(nc, n):
    # SmolLM2-135M's heads (9 over 3, D=64), pages of 16, the real block: several blocks per
    # chunk, prefixes off the page and block boundaries, and the service's last chunks
    Qm, Km, Dm, Sm, Lm = 9, 3, 64, 16, 2
    pages = torch.randperm(200)[: (nc + n + Sm - 1) // Sm].tolist()
    cache = torch.randn(200, Lm, 2, Sm, Km, Dm)
    q, k, v = torch.randn(n, Qm, Dm), torch.randn(n, Km, Dm), torch.randn(n, Km, Dm)
    meta = build_attention_metadata([nc], [n], [pages], Sm, Lm, 200)
    out = paged_attention(q, k, v, cache, 1, meta)
    # dense fp64 causal GQA over the same keys, read back from the written pages
    rows = torch.arange(nc + n)
    page_of = torch.tensor(pages)[rows // Sm]
    keys, values = cache[page_of, 1, 0, rows % Sm].double(), cache[page_of, 1, 1, rows % Sm].double()  # [N, K, D]
    keys, values = keys.repeat_interleave(Qm // Km, 1), values.repeat_interleave(Qm // Km, 1)  # [N, Q, D]
    scores = torch.einsum("nhd,mhd->hnm", q.double(), keys) / Dm**0.5  # [Q, n, N]
    visible = rows[None, :] <= torch.arange(nc, nc + n)[:, None]  # [n, N]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    ref = torch.einsum("hnm,mhd->nhd", probs, values).reshape(n, Qm * Dm)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def runner_and_hf():
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.llama.runner import LlamaRunner
    from kvmesh.engine.loader import resolve_model

    files = resolve_model()
    r = LlamaRunner(files, num_pages=100, page_size=16)
    r.warmup()
    hf = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    return r, hf


def test_long_prefill_matches_transformers_and_chunks(runner_and_hf):
    # 600 tokens: three query blocks in one forward, then the same prompt after a cached prefix of
    # 277 tokens (mid-page, mid-block) as the prefill service's chunks would leave it
    from kvmesh.engine.forward import ForwardItem

    runner, hf = runner_and_hf
    rng = random.Random(5)
    ids = [1] + [rng.randrange(3, 49152) for _ in range(599)]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0, -1]
    whole = runner.forward([ForwardItem(ids, 0, list(range(1, 39)))])
    torch.testing.assert_close(whole[0], theirs, atol=1e-4, rtol=0)
    pages = list(range(40, 78))
    runner.forward([ForwardItem(ids[:277], 0, pages)])
    rest = runner.forward([ForwardItem(ids[277:], 277, pages)])
    torch.testing.assert_close(rest, whole, atol=1e-4, rtol=0)
