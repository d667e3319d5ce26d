"""The prefill router's choices, narrated."""

from __future__ import annotations

import pytest

from gateway.router import InstanceLoad, PrefillRouter, pick_decode

PAGE = 16


def _router(**kw) -> PrefillRouter:
    return PrefillRouter([InstanceLoad("a:1", "A"), InstanceLoad("b:1", "B")], **kw)


def test_long_cached_prefix_wins():
    r = _router()
    # B holds 12 of the 13 blocks of a 200-token prompt: it computes 8 tokens, A all 200
    d = r.choose(200, {"B": 12}, PAGE)
    assert d.address == "b:1" and d.cached_tokens == 192 and d.cost_tokens == 8


def test_short_shared_prefix_does_not_steer_routing():
    r = _router()
    # A holds only the first block (a shared system prompt) of 100 tokens: below the
    # 0.5 threshold it counts for nothing, and ties go to the instance sent less so far
    r.instances[0].total_routed_tokens = 500
    assert r.choose(100, {"A": 1}, PAGE).address == "b:1"


def test_load_outweighs_a_small_saving():
    r = _router()
    # B caches 64 of 100 tokens but has 1000 prefill tokens queued
    r.instances[1].in_flight_tokens = 1000
    assert r.choose(100, {"B": 4}, PAGE).address == "a:1"


def test_at_least_one_token_is_always_computed():
    r = _router()
    # the whole prompt is cached: the last token is recomputed for its logits
    assert r.choose(32, {"A": 2}, PAGE).cached_tokens == 31


def test_unhealthy_instances_are_skipped_and_none_left_raises():
    r = _router()
    r.instances[1].healthy = False
    assert r.choose(10, {"B": 5}, PAGE).address == "a:1"
    r.instances[0].healthy = False
    with pytest.raises(LookupError):
        r.choose(10, {}, PAGE)


def test_bad_weights_are_rejected():
    with pytest.raises(ValueError, match="cache_threshold"):
        _router(cache_threshold=1.5)


def test_decode_is_least_active_requests():
    ds = [InstanceLoad("d0", in_flight_requests=3), InstanceLoad("d1", in_flight_requests=1),
          InstanceLoad("d2", reported_active_requests=2)]
    assert pick_decode(ds, 0).address == "d1"
    ds[1].healthy = False
    assert pick_decode(ds, 0).address == "d2"
