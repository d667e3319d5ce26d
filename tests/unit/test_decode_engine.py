"""The decode loop's scheduling: reservations, admission limits, batching, aborts.

The model runner is a test double here (this tests the loop around it): its "model"
predicts token (last + 1) so every expectation is exact.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import numpy as np
import pytest
import torch

from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.engine import CapacityError, DecodeEngine, RequestReleased
from kvmesh.engine.kv_layout import llama_layout
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kvstore.block_hash import hash_blocks, tenant_root
from kvmesh.kvstore.kv_events import BlockStored

VOCAB = 100


class CountingRunner:
    """Returns logits whose argmax is last token + 1; records each forward's batch."""

    page_layout = llama_layout(1, 4, 1, 2, torch.float32)  # pages in host memory: pushes move them in place

    def __init__(self, num_state_slots: int = 0) -> None:
        self.num_state_slots = num_state_slots
        self.slots_seen: list[int | None] = []
        self.batches: list[list[tuple[int, int, int]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def forward(self, items):
        self.entered.set()
        self.gate.wait()
        self.batches.append([(it.token_ids[0], it.num_computed_tokens, len(it.block_ids)) for it in items])
        self.slots_seen.extend(it.state_slot for it in items)
        logits = torch.zeros(len(items), VOCAB)
        for row, it in enumerate(items):
            logits[row, (it.token_ids[-1] + 1) % VOCAB] = 1.0
        return logits

    def expert_token_counts(self):
        return None  # dense

    def page_buffer(self, page_id: int):
        """A page's bytes (this double's model writes none: only what the push lands is read)."""
        if not hasattr(self, "pages"):
            self.pages = np.zeros((64, 8), dtype=np.uint8)
        return self.pages[page_id]

    def state_buffers(self, slot):
        return []


def _engine(**kw) -> tuple[DecodeEngine, CountingRunner]:
    runner = CountingRunner(kw.pop("num_state_slots", 0))
    engine = DecodeEngine(DecodeConfig(num_pages=kw.pop("num_pages", 32), page_size=4, **kw), runner)
    return engine, runner


def _start(engine, rid, prompt, first, max_tokens, stop=frozenset(), sampling=None, logprobs=None):
    """Reserve and begin a request; its (tokens, ending) go to the queue returned, and their
    logprobs onto the `logprobs` list when one is given."""
    res = engine.reserve(rid, len(prompt), max_tokens)
    out: queue.Queue = queue.Queue()

    def emit(t, f, lp):
        if logprobs is not None and lp is not None:
            logprobs.extend(lp)
        out.put((t, f))

    engine.begin(res.transfer_id, prompt, first, sampling or SamplingParams(), stop, emit)
    return res, out


def _start_reserved(engine, res, prompt, first):
    out: queue.Queue = queue.Queue()
    engine.begin(res.transfer_id, prompt, first, SamplingParams(), frozenset(), lambda t, f, lp: out.put((t, f)))
    return out


def _drain(out: queue.Queue) -> tuple[list[int], str]:
    tokens = []
    while True:
        t, f = out.get(timeout=10)
        tokens += t
        if f is not None:
            return tokens, f


def test_reserve_sizes_pages_for_prompt_and_answer():
    engine, _ = _engine()
    # 10 prompt tokens + 7 answer tokens, the last without KV: 16 tokens = 4 pages of 4
    res = engine.reserve("r", 10, 7)
    assert len(res.block_ids) == 4 and res.num_prompt_pages == 3
    assert engine.pool.num_free_blocks == 28
    assert engine.release(res.transfer_id) and engine.pool.num_free_blocks == 32
    engine.pool.check_integrity()


def test_capacity_errors_say_what_is_short():
    engine, _ = _engine(num_pages=4, max_batch_size=1)
    with pytest.raises(CapacityError, match="needs 5 KV pages"):
        engine.reserve("big", 16, 5)
    engine.reserve("one", 4, 1)
    with pytest.raises(CapacityError, match="batch is full"):
        engine.reserve("two", 4, 1)


def test_tokens_continue_from_first_token_and_stop_at_length_or_eos():
    engine, runner = _engine()
    engine.start()
    try:
        _, out = _start(engine, "a", [1, 2, 3], first=10, max_tokens=4)
        assert _drain(out) == ([11, 12, 13], "length")  # the first token counts toward max_tokens
        # decode started at position 3 (after the prompt) with the first token as input
        assert runner.batches[0] == [(10, 3, 2)]
        _, out = _start(engine, "b", [5], first=20, max_tokens=50, stop=frozenset({22}))
        assert _drain(out) == ([21, 22], "stop")
    finally:
        engine.shutdown()
    assert engine.pool.num_free_blocks == 32
    engine.pool.check_integrity()


def test_admission_is_bounded_per_step_and_requests_share_steps():
    engine, runner = _engine(max_admit_per_step=2)
    runner.gate.clear()  # hold the first step until every request is queued
    outs = [_start(engine, f"r{i}", [i], first=i * 10, max_tokens=3)[1] for i in range(5)]
    engine.start()
    runner.gate.set()
    try:
        results = [_drain(o) for o in outs]
    finally:
        engine.shutdown()
    assert results == [([i * 10 + 1, i * 10 + 2], "length") for i in range(5)]
    # 2 admitted in step 1, 2 more in step 2 (4 running), the last in step 3
    assert [len(b) for b in runner.batches[:3]] == [2, 4, 3]
    assert engine.max_batch_size_seen == 4
    # GetStats' figures: one step per forward, and the wall time they took (the held first step
    # alone lasted until the gate opened)
    stats = engine.stats()
    assert stats["num_steps"] == len(runner.batches) and stats["step_seconds"] > 0
    engine.pool.check_integrity()
    assert engine.pool.num_free_blocks == 32


def test_release_of_a_running_request_frees_its_pages_between_steps():
    engine, runner = _engine()
    runner.gate.clear()  # the first step will block inside the forward
    res, out = _start(engine, "long", [1], first=1, max_tokens=20)
    engine.start()
    try:
        assert runner.entered.wait(10)  # the request is in the batch being computed
        assert engine.release(res.transfer_id)
        assert engine.pool.num_free_blocks == 32 - 5  # not freed under a running forward
        runner.gate.set()
        deadline = time.monotonic() + 10
        while engine.pool.num_free_blocks != 32 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        runner.gate.set()
        engine.shutdown()
    assert engine.pool.num_free_blocks == 32  # freed between steps
    # the aborted request got no token from the step it was dropped in, only the news that it
    # was released (so a Generate call streaming it ends instead of waiting forever)
    tokens, end = out.get_nowait()
    assert tokens == [] and isinstance(end, RequestReleased) and out.empty()
    assert engine.stats()["num_active_requests"] == 0
    engine.pool.check_integrity()


def test_state_slots_are_reserved_with_pages_and_freed_with_them():
    # a runner with per-request state (DeepSeek-V4) gets one slot per reservation; the third
    # reservation waits for a slot even though pages are free, and finishing frees the slot
    engine, runner = _engine(num_state_slots=2)
    a = engine.reserve("a", 3, 2)
    b = engine.reserve("b", 3, 2)
    assert {a.state_slot, b.state_slot} == {0, 1}
    with pytest.raises(CapacityError, match="state slots"):
        engine.reserve("c", 3, 2)
    assert engine.stats()["integrity_error"] == ""
    engine.start()
    try:
        out = _start_reserved(engine, a, [1, 2, 3], 10)
        assert _drain(out) == ([11], "length")
        c = engine.reserve("c", 3, 2)
        assert c.state_slot == a.state_slot
        assert runner.slots_seen == [a.state_slot]
        engine.release(b.transfer_id)
        engine.release(c.transfer_id)
        assert engine.stats()["integrity_error"] == ""
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        engine.shutdown()


def test_a_finished_request_s_blocks_stay_cached_and_a_later_turn_reuses_them():
    """Decode-side prefix reuse: the prompt's and the answer's full blocks with KV stay cached
    under the prompt's hashes chained on over the answer (one KV event), and a later Reserve
    that may reuse references them, short of its last prompt token's page."""
    events: list = []
    runner = CountingRunner()
    engine = DecodeEngine(DecodeConfig(num_pages=32, page_size=4), runner, on_events=events.extend)
    root = tenant_root("team-a")
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    engine.start()
    try:
        first = engine.reserve("t1", len(prompt), 8, block_hashes=hash_blocks(prompt, 4, root))
        assert first.num_reused_pages == 0 and first.num_prompt_pages == 3
        t1_pages = list(first.block_ids)
        assert _drain(_start_reserved(engine, first, prompt, 11)) == ([12, 13, 14, 15, 16, 17, 18], "length")
        # tokens 1..18; the last has no KV, so 17 have: 4 full blocks, hashed as one chain
        conversation = list(range(1, 19))
        (stored,) = events
        assert stored == BlockStored(tuple(hash_blocks(conversation[:16], 4, root)))
        assert engine.pool.num_cached_blocks == 4 and engine.pool.num_referenced_blocks == 0

        # the next turn: the conversation so far and 2 new tokens (20 tokens, 5 full blocks); its
        # last token's block is pushed, so 4 of the 4 reusable blocks are decode's own pages
        turn2 = [*conversation, 50, 51]
        hashes2 = hash_blocks(turn2, 4, root)
        second = engine.reserve("t2", len(turn2), 4, block_hashes=hashes2, reuse_cached=True)
        assert second.num_reused_pages == 4 and second.block_ids[:4] == t1_pages[:4]
        assert engine.pool.num_referenced_blocks == len(second.block_ids)
        # the push lands in the prompt's pages after them, never in a page decode held already
        landing = engine.transfer_buffers(second.transfer_id)
        assert len(landing) == second.num_prompt_pages - 4 == 1
        assert np.shares_memory(landing[0], runner.page_buffer(second.block_ids[4]))
        assert not any(np.shares_memory(landing[0], runner.page_buffer(b)) for b in second.block_ids[:4])
        # not asked to reuse (Prefill already went out pushing every page), another tenant's
        # hashes, or too short a prompt: nothing is referenced
        plain = engine.reserve("t3", len(turn2), 4, block_hashes=hashes2)
        other = engine.reserve(
            "t4", len(turn2), 4, block_hashes=hash_blocks(turn2, 4, tenant_root("b")), reuse_cached=True
        )
        short = engine.reserve("t5", 4, 4, block_hashes=hashes2[:1], reuse_cached=True)
        assert (plain.num_reused_pages, other.num_reused_pages, short.num_reused_pages) == (0, 0, 0)
        for r in (second, plain, other, short):
            engine.release(r.transfer_id)
        with pytest.raises(ValueError, match="one 16-byte hash per full block"):
            engine.reserve("bad", len(turn2), 4, block_hashes=hashes2[:2])
    finally:
        engine.shutdown()
    engine.pool.check_integrity()
    assert engine.pool.num_referenced_blocks == 0 and engine.pool.num_cached_blocks == 4


def test_logprobs_travel_only_for_the_requests_that_ask_and_stop_with_their_tokens():
    # the double's logits are 1 at last + 1 and 0 elsewhere: that token's logprob is
    # 1 - log(e + V - 1), every other token's -log(e + V - 1)
    engine, _ = _engine()
    engine.start()
    try:
        asked: list = []
        _, a = _start(engine, "a", [1, 2, 3], 4, 5, sampling=SamplingParams(logprobs=2), logprobs=asked)
        unasked: list = []
        _, b = _start(engine, "b", [7, 8], 9, 4, logprobs=unasked)
        assert _drain(a) == ([5, 6, 7, 8], "length") and _drain(b) == ([10, 11, 12], "length")
    finally:
        engine.shutdown()
    norm = float(np.log(np.e + VOCAB - 1))
    assert [lp.token_id for lp in asked] == [5, 6, 7, 8] and not unasked
    assert all(lp.logprob == pytest.approx(1 - norm, abs=1e-5) for lp in asked)
    assert all(lp.top_token_ids[0] == lp.token_id and len(lp.top_token_ids) == 2 for lp in asked)
    assert all(lp.top_logprobs[1] == pytest.approx(-norm, abs=1e-5) for lp in asked)


def _start_choices(engine, rid, prompt, firsts, max_tokens, before_begin=None):
    """Reserve n = len(firsts) choices and begin them; one queue of (tokens, ending) a choice."""
    res = engine.reserve(rid, len(prompt), max_tokens, n=len(firsts))
    if before_begin is not None:
        before_begin(res)
    outs = [queue.Queue() for _ in firsts]
    emits = [lambda t, f, lp, q=q: q.put((t, f)) for q in outs]
    engine.begin_choices(res.transfer_id, prompt, firsts, SamplingParams(), frozenset(), emits)
    return res, outs


def test_n_choices_share_the_prompt_s_full_pages_and_copy_its_partial_one():
    # page size 4: a 6-token prompt has one full page (shared) and a partial one (copied into
    # each choice's own first page: every choice writes its first token's KV there)
    engine, runner = _engine()
    runner.page_buffer(0)  # the double's pages exist
    res = engine.reserve("n", 6, 4, n=3)
    parent_pages = list(res.block_ids)  # 3 pages: (6 + 4 - 1) tokens
    assert len(parent_pages) == 3 and [len(c.block_ids) for c in res.choices[1:]] == [2, 2]
    assert engine.pool.num_free_blocks == 32 - 7
    runner.pages[parent_pages[1]] = 7  # the landed partial page
    outs = [queue.Queue() for _ in range(3)]
    engine.begin_choices(
        res.transfer_id, [1, 2, 3, 4, 5, 6], [7, 20, 30], SamplingParams(), frozenset(),
        [lambda t, f, lp, q=q: q.put((t, f)) for q in outs],
    )  # fmt: skip
    for c in res.choices[1:]:
        assert c.block_ids[0] == parent_pages[0]  # shared, one more reference each
        assert (runner.pages[c.block_ids[1]] == 7).all()  # a copy of the partial page, its own
        assert c.block_ids[1] not in parent_pages
    engine.start()
    try:
        # each choice continues after its own first token; the double's model counts on
        assert [_drain(q) for q in outs] == [([8, 9, 10], "length"), ([21, 22, 23], "length"), ([31, 32, 33], "length")]
    finally:
        engine.shutdown()
    assert engine.pool.num_free_blocks == 32 and engine.stats()["num_active_requests"] == 0
    engine.pool.check_integrity()


def test_releasing_n_choices_mid_answer_ends_them_all_and_frees_every_page():
    engine, runner = _engine()
    runner.gate.clear()
    res, outs = _start_choices(engine, "n", [1, 2, 3, 4, 5], [6, 6, 6, 6], 20)
    engine.start()
    try:
        assert runner.entered.wait(10)  # the choices are in the step being computed
        assert engine.release(res.transfer_id)
        runner.gate.set()
        deadline = time.monotonic() + 10
        while engine.pool.num_free_blocks != 32 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        runner.gate.set()
        engine.shutdown()
    assert engine.pool.num_free_blocks == 32 and engine.stats()["num_active_requests"] == 0
    for q in outs:  # every choice hears it was released
        tokens, end = q.get_nowait()
        assert tokens == [] and isinstance(end, RequestReleased)
    engine.pool.check_integrity()
    # a reservation of n choices counts n against the batch; more than the batch is refused
    small, _ = _engine(max_batch_size=4)
    small.reserve("a", 3, 2, n=3)
    with pytest.raises(CapacityError, match="batch is full"):
        small.reserve("b", 3, 2, n=2)
    with pytest.raises(ValueError, match="more than this decode's batch"):
        small.reserve("c", 3, 2, n=5)


def test_n_choices_that_end_at_different_times_free_their_pages_as_they_end():
    engine, _ = _engine()
    stop = frozenset({9})
    res = engine.reserve("n", 4, 6, n=2)
    outs = [queue.Queue() for _ in range(2)]
    engine.begin_choices(
        res.transfer_id, [1, 2, 3, 4], [7, 50], SamplingParams(), stop,
        [lambda t, f, lp, q=q: q.put((t, f)) for q in outs],
    )  # fmt: skip
    engine.start()
    try:
        # choice 0 reaches the stop id 9 after two tokens; choice 1 runs to max_tokens
        assert _drain(outs[0]) == ([8, 9], "stop") and _drain(outs[1]) == ([51, 52, 53, 54, 55], "length")
    finally:
        engine.shutdown()
    assert engine.pool.num_free_blocks == 32 and engine.stats()["num_active_requests"] == 0
    engine.pool.check_integrity()


class _Receiver:
    """A KV receiver double: every push it is told to expect lands when the test says."""

    num_sent = num_pulled = 0

    def __init__(self) -> None:
        self.expected: dict[int, asyncio.Future] = {}

    def expect(self, transfer_id, buffers):
        self.expected[transfer_id] = asyncio.get_running_loop().create_future()
        return self.expected[transfer_id]

    def cancel(self, transfer_id):
        self.expected[transfer_id].cancel()


def test_a_draining_decode_waits_until_every_reservation_is_claimed_or_released():
    """Shutting down, decode keeps serving until each reservation's Generate came (claim) or it
    ended (release, expiry): a request whose first token prefill sent must find it open."""
    from kvmesh.decode_svc.transfers import Transfers

    async def scenario():
        engine, _ = _engine()
        transfers = Transfers(engine, _Receiver())
        a = transfers.reserve("a", 8, 4, kv_deadline_s=60)
        b = transfers.reserve("b", 8, 4, kv_deadline_s=60)
        assert transfers.num_unclaimed() == 2
        assert await transfers.wait_claimed(0.1) == 2  # bounded: gives up with both unclaimed
        waiting = asyncio.ensure_future(transfers.wait_claimed(30))
        await asyncio.sleep(0.1)
        transfers.claim(a.transfer_id)
        await asyncio.sleep(0.1)
        assert not waiting.done()  # b is still to come
        transfers.release(b.transfer_id, "test")
        assert await asyncio.wait_for(waiting, 5) == 0

    asyncio.run(scenario())


def test_a_lost_ep_rank_ends_the_batch_as_instance_lost_and_breaks_the_instance_once():
    """The runner's EP world loses a rank: the requests of the step end with InstanceBroken (the
    servicer's INSTANCE_LOST, UNAVAILABLE), their pages come back, `broken` says why, and the
    on_broken callbacks run once although later steps fail the same way."""
    from kvmesh.decode_svc.delivery import InstanceBroken, StepFailed
    from kvmesh.engine.ep.ranks import EPWorldError

    engine, runner = _engine()
    calls: list[str] = []
    engine.on_broken.append(calls.append)
    lost = EPWorldError("expert-parallel step failed; rank 1 (host 10.0.0.2) silent for 5.1 s")

    def fail(items):
        raise lost

    runner.forward = fail
    engine.start()
    try:
        _, out = _start(engine, "a", [1, 2, 3], first=10, max_tokens=4)
        tokens, ending = _drain(out)
        _, out = _start(engine, "b", [4], first=20, max_tokens=4)  # the servicer refuses this; the engine fails it
        assert _drain(out)[1].__class__ is InstanceBroken
    finally:
        engine.shutdown()
    assert tokens == [] and isinstance(ending, InstanceBroken) and isinstance(ending, StepFailed)
    assert "rank 1 (host 10.0.0.2)" in str(ending)
    assert engine.broken == str(lost) and calls == [str(lost)]
    assert engine.pool.num_free_blocks == 32
    engine.pool.check_integrity()
