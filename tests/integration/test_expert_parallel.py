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
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.engine.checkpoint import ModelFiles
from kvmesh.engine.deepseek_v4.runner import DeepseekV4Runner
from kvmesh.engine.deepseek_v4.weights import routed_expert_key
from kvmesh.engine.ep.eplb import balancedness, default_placement, plan
from kvmesh.engine.ep.runner import EPWorldError, ExpertParallelRunner
from kvmesh.engine.forward import ForwardItem

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


# -- ranks on other hosts: no shared memory (here over loopback; tests/multihost: separate hosts) --
SECRET = "kvmesh-ep-test-secret-0123456789"


def _churn(runner, steps: int = 24) -> tuple[list[torch.Tensor], dict[int, list[int]]]:
    """A batch whose sequences come and go, so that sequences move between ranks: prefill 0-3;
    4 and 5 join at step 5 (prefill rows beside decode rows); 2 and 3 end at step 9; at step 12
    5 ends and sequence 6 forks from 0 into 3's old pages and slot (copied through page_buffer
    and copy_state_slot, as decode's n > 1 does), so it must go on exactly as 0 does; with 2 or
    4 ranks it lands on the rank that ran 3, whose copies of those pages are stale by then.
    Greedy to `steps`, crossing page boundaries (16-token pages). (per-step logits, each
    sequence's tokens)."""
    tables = {b: list(range(1 + PAGES_PER_SEQ * b, 1 + PAGES_PER_SEQ * (b + 1))) for b in range(6)}
    joins = {0: [0, 1, 2, 3], 5: [4, 5]}
    live: dict[int, list] = {}  # sequence -> [slot, table, computed, next token]
    tokens: dict[int, list[int]] = {b: [] for b in range(7)}
    all_logits = []
    for step in range(steps):
        if step == 9:
            del live[2], live[3]
        if step == 12:
            del live[5]
            for src, dst in zip(tables[0], tables[3]):
                runner.page_buffer(dst)[...] = runner.page_buffer(src)
            runner.copy_state_slot(0, 3)
            live[6] = [3, tables[3], live[0][2], live[0][3]]
        order = sorted(live)
        items = [ForwardItem([live[b][3]], live[b][2], live[b][1], live[b][0]) for b in order]
        for b in joins.get(step, []):
            order.append(b)
            items.append(ForwardItem(PROMPTS[b], 0, tables[b], b))
            live[b] = [b, tables[b], 0, None]
        logits = runner.forward(items)
        all_logits.append(logits)
        for row, b in enumerate(order):
            live[b][2] += len(items[row].token_ids)
            live[b][3] = int(logits[row].argmax())
            tokens[b].append(live[b][3])
    return all_logits, tokens


@pytest.fixture(scope="module")
def churned(files):
    return _churn(_runner(files))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_rank(files, port: int, rank: int, secret: str = SECRET, **kw) -> subprocess.Popen:
    """`kvmesh serve ep-rank` joining 127.0.0.1:port as `rank` with `secret`."""
    argv = [sys.executable, "-m", "kvmesh.cli", "serve", "ep-rank", "--ep-init-addr", f"127.0.0.1:{port}"]
    argv += ["--rank", str(rank), "--model", str(files.checkpoint_dir), "--torch-threads", "1"]
    return subprocess.Popen(argv, env={**os.environ, "KVMESH_EP_SECRET": secret}, **kw)


def _remote_world(files, num_ranks: int, timeout_s: float = 20.0):
    """An EP world whose ranks 1..N-1 join over TCP as `kvmesh serve ep-rank` processes (no
    memory shared with this process): (runner, the ranks' processes)."""
    port = _free_port()
    procs = [_ep_rank(files, port, r) for r in range(1, num_ranks)]
    try:
        ep = ExpertParallelRunner(
            _runner(files),
            files,
            num_ranks,
            timeout_s=timeout_s,
            torch_threads=1,
            init_addr=("127.0.0.1", port),
            authkey=SECRET.encode(),
            start_timeout_s=300,
        )
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return ep, procs


def _exact_when_sequences_move(ep: ExpertParallelRunner, churned) -> None:
    ref_logits, ref_tokens = churned
    logits, tokens = _churn(ep)
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
    assert tokens == ref_tokens
    assert tokens[6] == tokens[0][12:]  # the fork went on exactly as its parent
    times = ep.times.per_step_ms()
    assert times["pages_s"] > 0 and times["dispatch_s"] > 0 and times["sync_s"] > 0, times
    print(f"EP {ep.num_ranks} on other hosts (loopback): ms per step {times}")


def test_ep2_on_other_hosts_equals_one_process_as_sequences_move_then_a_stopped_rank_is_named(files, churned):
    ep, procs = _remote_world(files, 2, timeout_s=5.0)
    try:
        _exact_when_sequences_move(ep, churned)
        # a rank that hangs (SIGSTOP, as a cut link looks): the step fails within the timeout and names it
        os.kill(procs[0].pid, signal.SIGSTOP)
        time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(EPWorldError, match=r"rank 1 \(host 127\.0\.0\.1\) silent"):
            ep.warmup()
        assert time.monotonic() - start < 5.0 + 5.0
        with pytest.raises(EPWorldError, match="down"):
            ep.warmup()
    finally:
        ep.close()
        for p in procs:
            p.kill()
            p.wait(10)


def test_ep4_on_other_hosts_equals_one_process_as_sequences_move(files, churned):
    ep, procs = _remote_world(files, 4)
    try:
        _exact_when_sequences_move(ep, churned)
        with pytest.raises(ValueError, match="MTP drafting with EP ranks on other hosts"):
            ExpertParallelRunner(ep.runner, files, 2, init_addr=("127.0.0.1", 1), authkey=b"x", gather_streams=True)
    finally:
        ep.close()
        for p in procs:  # STOP ends their world: they exit by themselves
            assert p.wait(30) == 0


def test_a_rank_with_the_wrong_key_is_refused_and_the_world_still_forms(files):
    """Rank 0 waiting for its rank 1: a `kvmesh serve ep-rank` with another KVMESH_EP_SECRET is
    refused (it exits 2 saying so) and the listener goes on; a rank with the key joins; a world
    whose ranks never come fails after its start timeout, naming them."""
    from multiprocessing.connection import Client
    from threading import Thread

    from kvmesh.engine.ep.ranks import RemoteRanks

    port = _free_port()
    made: dict = {}

    def listen() -> None:
        try:
            made["ranks"] = RemoteRanks("127.0.0.1", port, 2, SECRET.encode(), timeout_s=120)
        except BaseException as exc:  # reported by the assert below
            made["error"] = exc

    thread = Thread(target=listen)
    thread.start()
    intruder = _ep_rank(files, port, 1, secret="not-the-secret-of-this-world", stderr=subprocess.PIPE, text=True)
    assert intruder.wait(120) == 2
    assert "refused this rank's KVMESH_EP_SECRET" in intruder.stderr.read()
    conn = Client(("127.0.0.1", port), authkey=SECRET.encode())
    conn.send(("hello", 1))
    thread.join(30)
    assert "error" not in made, made
    ranks = made["ranks"]
    assert len(ranks.links) == 1 and ranks.where(0) == "rank 1 (host 127.0.0.1)"
    ranks.close()
    conn.close()
    with pytest.raises(EPWorldError, match=r"EP ranks \[1, 2\] did not join .* within 1 s"):
        RemoteRanks("127.0.0.1", _free_port(), 3, SECRET.encode(), timeout_s=1)
