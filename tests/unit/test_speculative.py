"""Speculative decoding on decode: n-gram drafts, their verification, and the engine's output
with speculation equal to its output without it (the real default model, in process)."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.engine.kv_layout import llama_layout
from kvmesh.engine.sampler import _filtered_probs, verify_drafts
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.speculative.governor import SpeculationGovernor
from kvmesh.engine.speculative.ngram import propose_ngram


def test_ngram_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    # [1, 2, 3] recurs (the 4-token suffix [9, 1, 2, 3] does not): what followed it comes next
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], k=3) == [4, 9, 1]
    # [5, 6] occurred twice: the latest occurrence's continuation, cut at the sequence's end
    assert propose_ngram([5, 6, 7, 5, 6, 8, 5, 6], k=5) == [8, 5, 6]
    assert propose_ngram([1, 2, 3, 4], k=3) == []  # nothing recurs
    assert propose_ngram([7, 7], k=2, min_ngram=1) == [7]  # a 1-gram, when allowed
    assert propose_ngram([7, 7], k=2) == []  # by default n >= 2
    assert propose_ngram([1, 2, 1], k=0) == []


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((3, 10), -1.0)
    for row, best in enumerate([4, 6, 8]):
        logits[row, best] = 1.0
    assert verify_drafts(logits, [4, 6], SamplingParams(), None) == [4, 6, 8]  # both kept, plus row 2's
    assert verify_drafts(logits, [4, 5], SamplingParams(), None) == [4, 6]  # 5 rejected: row 1's 6
    assert verify_drafts(logits, [3, 6], SamplingParams(), None) == [4]  # the first rejected
    with pytest.raises(ValueError, match="3 rows"):
        verify_drafts(logits[:2], [4, 6], SamplingParams(), None)


def test_sampled_verification_keeps_the_target_distribution():
    # one draft (always token 3) against a target p: the first token's frequencies are p's
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 1.5], [0.0, 0.0, 0.0, 0.0]])
    p = _filtered_probs(logits[:1], [params])[0]
    gen = torch.Generator().manual_seed(7)
    trials = 3000
    counts = torch.zeros(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops on 4 numbers: a thread team only costs (10 ms a call on a busy machine)
    try:
        for _ in range(trials):
            counts[verify_drafts(logits, [3], params, gen)[0]] += 1
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(counts / trials, p, atol=0.03), (counts / trials, p)  # ~4 standard errors


def test_the_governor_drafts_what_pays_for_its_rows():
    # acceptance 0.9, a row costing 0.35 of a step: 4 drafts give 4.1 tokens for 2.4 steps' work
    g = SpeculationGovernor(row_cost=0.35, kept=9.0, rejected=1.0)
    assert g.num_drafts(4) == 4 and g.num_drafts(2) == 2
    # acceptance 0.5: only 1 draft pays (1.5 / 1.35 = 1.11; 2 drafts: 1.75 / 1.7 = 1.03)
    assert SpeculationGovernor(row_cost=0.35, kept=1.0, rejected=1.0).num_drafts(4) == 1
    # acceptance 0.2: none pays, but every 8th step probes with one draft
    low = SpeculationGovernor(row_cost=0.35, kept=1.0, rejected=4.0, probe_every=8)
    assert [low.num_drafts(4) for _ in range(8)] == [0] * 7 + [1]
    # rejections lower the estimate, kept drafts raise it
    g = SpeculationGovernor()
    before = g.acceptance
    g.record(drafted=4, accepted=0)
    assert g.acceptance < before
    g.record(drafted=4, accepted=4)
    g.record(drafted=4, accepted=4)
    assert g.acceptance > before


def test_speculation_is_refused_without_the_slots_or_the_module_it_needs():
    class Stateful:
        num_state_slots = 4  # a DeepSeek-V4 runner sized for requests only: no scratch slots
        page_layout = llama_layout(1, 4, 1, 2, torch.float32)  # pages in host memory: pushes move them in place

    with pytest.raises(ValueError, match="needs 96 state slots"):
        DecodeEngine(DecodeConfig(num_pages=8, speculative="ngram"), Stateful())  # type: ignore[arg-type]

    class NoMTP:
        num_state_slots = 0
        page_layout = llama_layout(1, 4, 1, 2, torch.float32)  # pages in host memory: pushes move them in place

    with pytest.raises(ValueError, match="mtp.. tensors"):
        DecodeEngine(DecodeConfig(num_pages=8, speculative="mtp"), NoMTP())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def runner():
    from kvmesh.engine.llama.runner import LlamaRunner
    from kvmesh.engine.loader import resolve_model

    r = LlamaRunner(resolve_model(None), num_pages=64)
    r.warmup()
    return r


def _generate(runner, config: DecodeConfig, prompt: list[int], max_tokens: int) -> tuple[list[int], SimpleNamespace]:
    """Prefill `prompt` into decode's reserved pages in process, then decode with `config`."""
    from kvmesh.engine.forward import ForwardItem

    engine = DecodeEngine(config, runner)
    res = engine.reserve("r", len(prompt), max_tokens)
    first = int(runner.forward([ForwardItem(prompt, 0, list(res.block_ids), res.state_slot)]).argmax())
    out: queue.Queue = queue.Queue()
    engine.begin(res.transfer_id, prompt, first, SamplingParams(), frozenset(), lambda t, f, lp: out.put((t, f)))
    engine.start()
    tokens = [first]
    try:
        while True:
            t, f = out.get(timeout=120)
            tokens += t
            if f is not None:
                break
    finally:
        engine.shutdown()
    engine.pool.check_integrity()
    return tokens, SimpleNamespace(drafted=res.num_drafted, accepted=res.num_accepted)


def test_greedy_output_with_ngram_drafts_equals_output_without(runner):
    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import resolve_model

    tok = load_tokenizer(resolve_model(None))
    quote = "The quick brown fox jumps over the lazy dog. " * 3
    prompt = tok.encode(f"Repeat this text exactly: {quote}\nRepeated: {quote[:20]}")
    plain, none = _generate(runner, DecodeConfig(num_pages=64), prompt, 24)
    assert none.drafted == 0
    for k in (1, 2, 3, 4):
        got, counts = _generate(
            runner, DecodeConfig(num_pages=64, speculative="ngram", num_draft_tokens=k, draft_row_cost=0.1), prompt, 24
        )
        assert got == plain, k  # the same tokens, exactly
        assert counts.accepted > 0 and counts.drafted >= counts.accepted, (k, counts)
