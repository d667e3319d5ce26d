"""Expert-parallel decode on real processes and real torch.distributed (gloo): a tiny DeepSeek-V4
with skewed routers, 2 layers, decoded greedily by one process and by EP worlds of 2 and 4
ranks (this process is rank 0). Each world starts once; the steps' logits must agree at a tight
tolerance and the greedy tokens exactly; the ranks' measured loads must match EPLB's
prediction; a new placement mid-generation changes no token; a killed rank is an error within
seconds.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from engine.checkpoint import ModelFiles
from engine.ep_runner import EPWorldError, ExpertParallelRunner
from engine.eplb import balancedness, default_placement, plan
from engine.forward import ForwardItem
from engine.models.deepseek_v4_weights import routed_expert_key
from engine.tiny_models import make_tiny_model
from engine.v4_runner import DeepseekV4Runner

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

PAGE = 16
PAGES_PER_SEQ = 4
# 6 sequences of different lengths: EP 4 splits them 2, 2, 1, 1; one-token prompts too
PROMPTS = [
    [5, 17, 230, 4111, 90, 7, 7, 301, 12],
    [1],
    [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
    [900, 3],
    [31] * 6,
    [2048, 77, 19000, 5, 6],
]
STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = make_tiny_model(
        "deepseek_v4",
        tmp_path_factory.mktemp("v4ep"),
        skew_routers=1.0,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
    )
    return ModelFiles("tiny-v4-ep", path)


def _runner(files) -> DeepseekV4Runner:
    return DeepseekV4Runner(files, num_pages=len(PROMPTS) * PAGES_PER_SEQ + 1, page_size=PAGE, num_state_slots=8)


def _greedy(runner, steps: int = STEPS, on_step=None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill every prompt in one batch, then `steps` greedy decode steps; per-step logits and
    each sequence's tokens. Page 0 stays for warmup; sequence b owns pages 1 + 4b .. 4 + 4b."""
    tables = [list(range(1 + PAGES_PER_SEQ * b, 1 + PAGES_PER_SEQ * (b + 1))) for b in range(len(PROMPTS))]
    items = [ForwardItem(p, 0, tables[b], b) for b, p in enumerate(PROMPTS)]
    computed = [0] * len(PROMPTS)
    out: list[list[int]] = [[] for _ in PROMPTS]
    all_logits = []
    for step in range(steps + 1):
        if on_step:
            on_step(step)
        logits = runner.forward(items)
        all_logits.append(logits)
        nxt = logits.argmax(dim=-1).tolist()
        for b, it in enumerate(items):
            computed[b] += len(it.token_ids)
            out[b].append(nxt[b])
        items = [ForwardItem([nxt[b]], computed[b], tables[b], b) for b in range(len(PROMPTS))]
    return all_logits, out


@pytest.fixture(scope="module")
def single(files):
    runner = _runner(files)
    logits, tokens = _greedy(runner)
    return logits, tokens, runner.expert_token_counts()


def _exact_and_balanced(ep: ExpertParallelRunner, single, num_ranks: int) -> None:
    ref_logits, ref_tokens, ref_counts = single
    # each rank holds its own slots' experts and no others (workers never loaded the rest;
    # rank 0 dropped its model's copy), E / R of them per layer with one replica each
    c = ep.runner.model.config
    per_expert = ep.moe.gate_up[0][0].nbytes + ep.moe.down[0][0].nbytes
    assert ep.expert_nbytes == [c.num_hidden_layers * c.n_routed_experts // num_ranks * per_expert] * num_ranks
    assert not [k for k in ep.runner.model.w if routed_expert_key(k)]
    # experts in order, one replica each: the hot experts 0 and 1 share rank 0
    logits, tokens = _greedy(ep)
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
    assert tokens == ref_tokens
    loads = ep.loads
    np.testing.assert_array_equal(loads.expert_tokens, ref_counts)  # every rank's routings, added up
    before = balancedness(loads.expert_tokens, default_placement(c.num_hidden_layers, c.n_routed_experts, num_ranks))
    np.testing.assert_allclose(loads.balancedness(), before, atol=1e-9)  # one replica each: exact
    assert before.max() < 0.7, before  # the skew shows

    # EPLB from the measured counts, loaded mid-generation (before step 3): same logits and
    # tokens, and the ranks' loads since then as the planner predicts from the counts since then
    placement = plan(loads.expert_tokens, num_ranks, 2 if num_ranks == 2 else 4)
    marks = {}

    def swap(step: int) -> None:
        if step == 3:
            ep.set_placement(placement)
            marks["ranks"], marks["experts"] = ep.loads.rank_tokens.copy(), ep.loads.expert_tokens.copy()

    logits, tokens = _greedy(ep, on_step=swap)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ranks = ep.loads.rank_tokens - marks["ranks"]
    measured = ranks.mean(axis=1) / ranks.max(axis=1)
    predicted = balancedness(ep.loads.expert_tokens - marks["experts"], placement)
    print(
        f"EP {num_ranks}: balancedness without EPLB {before.round(3)}, planned {predicted.round(3)}, "
        f"measured {measured.round(3)}"
    )
    np.testing.assert_allclose(measured, predicted, atol=0.05)
    assert (predicted > before).all()


def _speculative_rows(runner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill three prompts, then a speculative verification step (sequence 0 with two drafts
    as three rows chaining scratch slots 6 and 7; the others one row each), keep both drafts
    (slot 7 becomes sequence 0's) and take a plain step: (verify logits, their last hidden
    streams, the plain step's logits)."""
    tables = [list(range(1 + PAGES_PER_SEQ * b, 1 + PAGES_PER_SEQ * (b + 1))) for b in range(3)]
    runner.forward([ForwardItem(PROMPTS[b], 0, tables[b], b) for b in range(3)])
    n = [len(PROMPTS[b]) for b in range(3)]
    # sequence 0 last: split by sequence count over 2 ranks, its three rows run on rank 1
    rows = [
        ForwardItem([7], n[1], tables[1], 1),
        ForwardItem([8], n[2], tables[2], 2),
        ForwardItem([9], n[0], tables[0], 0),
        ForwardItem([10], n[0] + 1, tables[0], 6, state_from=0),
        ForwardItem([11], n[0] + 2, tables[0], 7, state_from=6),
    ]
    verify = runner.forward(rows)
    hidden = runner.last_hidden().clone()
    runner.copy_state_slot(7, 0)
    plain = runner.forward(
        [ForwardItem([12], n[0] + 3, tables[0], 0), ForwardItem([13], n[1] + 1, tables[1], 1)]
        + [ForwardItem([14], n[2] + 1, tables[2], 2)]
    )
    return verify, hidden, plain


def test_ep2_equals_single_process_then_a_killed_rank_is_an_error_within_seconds(files, single):
    ep = ExpertParallelRunner(_runner(files), files, 2, timeout_s=20, torch_threads=1, gather_streams=True)
    try:
        _exact_and_balanced(ep, single, 2)
        # speculative verification rows: a sequence's rows stay on one rank (here rank 1), the
        # state slots roll forward in shared memory, and the MTP drafter's streams come back
        assert ep.has_mtp
        want = _speculative_rows(_runner(files))
        for got, ref in zip(_speculative_rows(ep), want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        os.kill(ep.ranks.procs[0].pid, signal.SIGKILL)
        ep.ranks.procs[0].join(5)
        start = time.monotonic()
        with pytest.raises(EPWorldError, match="rank 1"):
            ep.warmup()
        assert time.monotonic() - start < 10
        with pytest.raises(EPWorldError, match="down"):  # and stays down
            ep.warmup()
    finally:
        ep.close()


def test_ep4_equals_single_process(files, single):
    ep = ExpertParallelRunner(_runner(files), files, 4, timeout_s=20, torch_threads=1)
    try:
        _exact_and_balanced(ep, single, 4)
        # without an MTP drafter the streams stay on their ranks: no collective for them
        with pytest.raises(ValueError, match="does not gather hidden streams"):
            ep.last_hidden()
    finally:
        ep.close()
