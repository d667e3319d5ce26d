"""The prefill engine's queue around a test-double runner (the model is not under test here)."""

import concurrent.futures

import pytest
import torch

from engine.request import Request
from engine.sampling_params import SamplingParams
from kvstore.block_pool import NoFreeBlocksError
from prefill_svc.engine import PrefillEngine


class ArgmaxRunner:
    """Logits whose argmax is the last token + 1."""

    num_state_slots = 0

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


def test_hashes_from_the_caller_are_used_instead_of_hashing_again(monkeypatch):
    # the gateway hashed the prompt for routing; prefill caches its blocks under those hashes
    # and never hashes the prompt itself
    import engine.kv_cache as prefill_engine  # where prefill hashes a prompt
    from kvstore.block_hash import hash_blocks

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
