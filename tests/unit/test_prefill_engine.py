"""The prefill engine's queue around a test-double runner (the model is not under test here)."""

import concurrent.futures
import contextlib
import threading
import time

import pytest
import torch

from kvmesh.engine.kv_layout import llama_layout
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kvstore.block_pool import NoFreeBlocksError
from kvmesh.prefill_svc.engine import PrefillEngine


class ArgmaxRunner:
    """Logits whose argmax is the last token + 1."""

    num_state_slots = 0
    page_layout = llama_layout(1, 4, 1, 2, torch.float32)  # pages in host memory: pushes move them in place

    def forward(self, items):
        logits = torch.zeros(len(items), 100)
        for b, it in enumerate(items):
            logits[b, (it.token_ids[-1] + 1) % 100] = 1.0
        return logits

    def resume_state_slot(self, slot, page):
        raise AssertionError("no slots here")

    def expert_token_counts(self):
        return None  # dense


def _job(rid, tokens):
    return Request(rid, tokens, SamplingParams(seed=0))


def test_a_job_short_of_pages_waits_for_a_release_instead_of_failing():
    # 4 pages of 4 tokens, no prefix caching: A takes 3 pages and holds them until its push
    # is done; B also needs 3, so it waits; C needs 5, more than the whole pool: fails at once
    engine = PrefillEngine(ArgmaxRunner(), 4, 4, enable_prefix_caching=False)
    try:
        a = engine.submit(_job("a", list(range(10, 22)))).result(timeout=10)
        assert a.first_token == 22 and len(a.block_ids) == 3
        b = engine.submit(_job("b", list(range(30, 42))))
        with pytest.raises(NoFreeBlocksError):
            engine.submit(_job("c", list(range(50, 70)))).result(timeout=10)
        with pytest.raises(concurrent.futures.TimeoutError):
            b.result(timeout=0.3)  # still waiting
        assert engine.call(engine.stats).result()["num_queued_tokens"] == 12
        engine.release(a.block_ids, a.state_slot)
        assert b.result(timeout=10).first_token == 42
        engine.release(b.result().block_ids, None).result()
        stats = engine.call(engine.stats).result()
        assert stats["integrity_error"] == "" and stats["num_free_pages"] == 4 and stats["num_active_requests"] == 0
    finally:
        engine.shutdown()


class GatedRunner(ArgmaxRunner):
    """ArgmaxRunner that logs each forward's first token and holds its first forward until
    `gate` is set (`inside` is set once it is held)."""

    def __init__(self):
        self.log, self.inside, self.gate = [], threading.Event(), threading.Event()

    def forward(self, items):
        self.log.append(("forward", items[0].token_ids[0]))
        if len(self.log) == 1:
            self.inside.set()
            assert self.gate.wait(10), "the test never opened the gate"
        return super().forward(items)


@contextlib.contextmanager
def _held(first_tokens, **engine_args):
    """An engine on a GatedRunner (16 pages of 4 tokens) whose first forward, of a request of
    `first_tokens`, is held until the test opens the gate: yields (runner, engine, that
    request's future)."""
    runner = GatedRunner()
    engine = PrefillEngine(runner, 4, 16, enable_prefix_caching=False, **engine_args)
    try:
        first = engine.submit(_job("first", first_tokens))
        assert runner.inside.wait(10)
        yield runner, engine, first
    finally:
        runner.gate.set()
        engine.shutdown()


def test_a_call_runs_before_the_next_forward_not_behind_the_queued_batches():
    # A's 12 tokens take 3 forwards of a 4-token chunk; while its first forward computes, B
    # queues a batch of its own and a call (a pull's allocation, a peer's hold on blocks)
    # comes: it runs before A's second forward, not after A's batch and B's
    with _held(list(range(10, 22)), chunked_prefill_size=4) as (runner, engine, a):
        b = engine.submit(_job("b", list(range(30, 34))))
        called = engine.call(lambda: runner.log.append(("call", len(runner.log))))
        runner.gate.set()
        assert a.result(timeout=10).first_token == 22 and b.result(timeout=10).first_token == 34
        called.result(timeout=10)
    assert runner.log == [("forward", 10), ("call", 1), ("forward", 14), ("forward", 18), ("forward", 30)]


def test_a_request_back_from_a_pull_keeps_its_place_ahead_of_those_that_came_after_it():
    # A reached the engine first but pulled its prefix from a peer meanwhile; B came after it
    # and queued while X computed: A is computed before B (one request a batch here)
    with _held(list(range(10, 14)), max_batch_tokens=4) as (runner, engine, x):
        a = _job("a", list(range(20, 24)))  # arrived now
        b = engine.submit(_job("b", list(range(30, 34))))
        a_done = engine.submit(a)  # back from its pull
        runner.gate.set()
        assert [f.result(timeout=10).first_token for f in (x, a_done, b)] == [14, 24, 34]
    assert runner.log == [("forward", 10), ("forward", 20), ("forward", 30)]


class FailingRunner(ArgmaxRunner):
    """ArgmaxRunner whose forward raises for a batch holding token 99, and first calls
    `on_forward` (once); `batches` records each forward's first tokens."""

    def __init__(self, on_forward=None):
        self.on_forward, self.batches = on_forward, []

    def forward(self, items):
        self.batches.append([it.token_ids[0] for it in items])
        if self.on_forward is not None:
            self.on_forward, hook = None, self.on_forward
            hook()
        if any(99 in it.token_ids for it in items):
            raise RuntimeError("forward failed")
        return super().forward(items)


def test_a_failed_compute_frees_its_pages_for_the_request_waiting_for_them_first():
    # one drain takes X and Y together (the worker was busy while both came): X gets 3 of the
    # 4 pages, Y needs 3 too and waits; Z comes while X computes. X's forward fails, its pages
    # come back, and Y, which came before Z, runs no later than Z
    import threading

    def submit_z():
        futures["z"] = engine.submit(_job("z", list(range(50, 54))))

    futures: dict = {}
    runner = FailingRunner(on_forward=submit_z)
    engine = PrefillEngine(runner, 4, 4, enable_prefix_caching=False)
    try:
        busy = threading.Event()
        engine.call(busy.wait, 10)
        x = engine.submit(_job("x", [99, *range(10, 21)]))
        y = engine.submit(_job("y", list(range(30, 42))))
        busy.set()
        with pytest.raises(RuntimeError, match="forward failed"):
            x.result(timeout=10)
        assert y.result(timeout=10).first_token == 42 and futures["z"].result(timeout=10).first_token == 54
        first_seen = {t: i for i, batch in reversed(list(enumerate(runner.batches))) for t in batch}
        assert first_seen[99] == 0 and first_seen[30] <= first_seen[50], runner.batches
        for f in (y, futures["z"]):
            engine.release(f.result().block_ids, None).result()
        stats = engine.call(engine.stats).result()
        assert stats["integrity_error"] == "" and stats["num_free_pages"] == 4 and stats["num_active_requests"] == 0
    finally:
        engine.shutdown()


def test_hashes_from_the_caller_are_used_instead_of_hashing_again(monkeypatch):
    # the gateway hashed the prompt for routing; prefill caches its blocks under those hashes
    # and never hashes the prompt itself
    import kvmesh.engine.kv_cache as prefill_engine  # where prefill hashes a prompt
    from kvmesh.kvstore.block_hash import hash_blocks

    tokens = list(range(10, 22))  # 3 full pages of 4
    given = hash_blocks(tokens, 4)
    calls = []
    monkeypatch.setattr(prefill_engine, "hash_blocks", lambda *a: calls.append(a) or hash_blocks(*a))
    engine = PrefillEngine(ArgmaxRunner(), 4, 8, enable_prefix_caching=True)
    try:
        a = engine.submit(Request("a", tokens, SamplingParams(seed=0), block_hashes=given)).result(timeout=10)
        engine.release(a.block_ids, a.state_slot).result()
        assert calls == []
        assert engine.call(lambda: engine.pool.cached_hashes()).result() == set(given)
        # a request without hashes is hashed here, to the same keys: its prefix is found
        b = engine.submit(_job("b", tokens)).result(timeout=10)
        assert len(calls) == 1 and b.num_cached_tokens == 8  # 2 of 3 pages: the last token is recomputed
        engine.release(b.block_ids, b.state_slot).result()
    finally:
        engine.shutdown()


class WaitingShare:
    """A CpuShare double: each forward waits WAIT_S for its turn and says so; a decode is busy."""

    WAIT_S = 0.2
    shared = True
    group = "host:/dev/shm/kvmesh-test-share"

    @contextlib.contextmanager
    def prefill_forward(self, since_ns=None, while_waiting=None):
        time.sleep(self.WAIT_S)
        yield self.WAIT_S

    def decode_busy(self):
        return True

    def wake(self):
        pass

    def close(self):
        pass


def test_the_profile_leaves_out_the_turns_waited_and_the_stats_say_which_cores_and_forwards():
    # 8-token prompts in forwards of 4 tokens (the budget beside a busy decode): 0.4 s of turns
    # waited a prompt, which the profile must not count as compute (the gateway shares the cores
    # out itself: kvmesh.gateway.prefill_queues)
    share = WaitingShare()
    engine = PrefillEngine(
        ArgmaxRunner(), 4, 8, enable_prefix_caching=False, chunked_prefill_size=8, cpu_share=share,
        forward_tokens_beside_decode=4,
    )  # fmt: skip
    try:
        for i in range(5):
            done = engine.submit(_job(f"r{i}", list(range(10 + i, 18 + i)))).result(timeout=30)
            engine.release(done.block_ids, done.state_slot).result()
        stats = engine.call(engine.stats).result()
        per_forward, per_request, per_token, per_attention = stats["prefill_fit"]
        assert stats["cpu_share_wait_seconds"] == pytest.approx(5 * 2 * share.WAIT_S)
        # turns waited: 2 x 0.2 s a prompt, in 2 forwards
        assert 2 * per_forward + per_request + per_token * 8 + per_attention * 8 * 4 < share.WAIT_S
        assert stats["core_group"] == share.group and stats["max_forward_tokens"] == 4
    finally:
        engine.shutdown()
