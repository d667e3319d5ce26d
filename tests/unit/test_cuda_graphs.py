"""Decode steps through kvmesh.engine.cuda_graphs' fixed-shape buckets (run eagerly on the CPU: the same
padding, tables and copies a captured graph replays) give the plain step's logits and pages."""

import pytest
import torch

from kvmesh.engine.cuda_graphs import DecodeGraphs
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.kernels import build_attention_metadata
from tests.unit.tiny_llama import tiny_llama

PAGE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama, 64 positions: 16 pages a sequence at most."""
    return tiny_llama(tmp_path_factory.mktemp("ckpt"))[0]


def _prefilled(files, graphs: int):
    runner = LlamaRunner(files, 24, PAGE)
    if graphs:
        runner.enable_decode_graphs(graphs)
    # five sequences of 3..11 prompt tokens, pages drawn out of order
    seqs = [(list(range(5, 8 + 2 * b)), [23 - 4 * b, 21 - 4 * b, 22 - 4 * b, 20 - 4 * b]) for b in range(5)]
    for tokens, pages in seqs:
        runner.forward([ForwardItem(tokens, 0, pages)])  # a prefill: eager either way
    return runner, seqs


def test_bucketed_decode_steps_equal_plain_ones(tiny):
    plain, seqs = _prefilled(tiny, 0)
    graphed, _ = _prefilled(tiny, 8)
    assert graphed.decode_graphs is not None and graphed.decode_graphs.batch_sizes == [1, 2, 4, 8]
    scratch_before = graphed.memory.pages[graphed.scratch_page].clone()
    lengths = [len(t) for t, _ in seqs]
    for batch in ([0], [1, 3, 4], [0, 1, 2, 3, 4], [2, 4]):  # buckets 1, 4, 8, 2
        items = [ForwardItem([40 + b], lengths[b], seqs[b][1]) for b in batch]
        want, got = plain.forward(items), graphed.forward(items)
        assert got.shape == want.shape == (len(batch), 97)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for b in batch:
            lengths[b] += 1
    # the pool's pages alike (a GEMM of 8 rows may round a row's K/V apart from one of 5 in the last bit)
    torch.testing.assert_close(graphed.kv_cache, plain.kv_cache, rtol=1e-5, atol=1e-6)
    assert not torch.equal(graphed.memory.pages[graphed.scratch_page], scratch_before)  # padding went there
    assert graphed.memory.pages.shape[0] == graphed.num_pages + 1


def test_a_buckets_inputs_are_the_attention_plan_padded(tiny):
    # the inputs a graph reads, built with numpy each step, are build_attention_metadata's plan
    # of the padded batch (pad_pages: tables padded to the longest context a sequence can have)
    graphed, seqs = _prefilled(tiny, 8)
    graphs = graphed.decode_graphs
    assert graphs is not None
    items = [ForwardItem([40], len(seqs[b][0]), seqs[b][1]) for b in (4, 0, 2)]
    got = graphs._host_inputs(items, 4)
    padded = [*items, ForwardItem([0], 0, [graphed.scratch_page])]
    want = build_attention_metadata(
        [it.num_computed_tokens for it in padded],
        [1] * 4,
        [it.block_ids for it in padded],
        PAGE,
        2,
        graphed.num_pages + 1,
        pad_pages=graphs.max_pages,
    )
    g = want.decode
    assert g is not None and g.mask is not None and graphs.max_pages == 16
    assert torch.equal(got["write_rows"], want.write_rows)
    assert torch.equal(got["block_table"], g.block_table) and torch.equal(got["context_lens"], g.context_lens)
    assert torch.equal(got["read_blocks"], g.read_blocks) and torch.equal(got["mask"], g.mask)
    assert got["ids"].tolist() == [40, 40, 40, 0] and got["positions"].tolist() == [11, 3, 7, 0]


def test_steps_outside_the_buckets_run_eagerly_and_bad_pages_are_refused(tiny):
    graphed, seqs = _prefilled(tiny, 3)
    graphs = graphed.decode_graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 3]
    assert not graphs.fits([ForwardItem([1, 2], 0, [0])])  # a prefill item: not a decode step
    assert not graphs.fits([ForwardItem([1], 3, [22])] * 4)  # past the largest bucket
    with pytest.raises(ValueError, match=r"page ids must be in \[0, 24\)"):
        graphed.forward([ForwardItem([1], 3, [graphed.scratch_page])])  # never a request's page
    with pytest.raises(ValueError, match=r"page_id must be in \[0, 24\), got 24"):
        graphed.page_buffer(24)
    with pytest.raises(ValueError, match="max_batch >= 1"):
        DecodeGraphs(graphed, 0, capture=False)
