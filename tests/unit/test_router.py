"""The prefill router's choices, narrated."""

from __future__ import annotations

import pytest

from kvmesh.gateway.router import InstanceLoad, PrefillRouter, pick_decode

PAGE = 16


def _router(**kw) -> PrefillRouter:
    return PrefillRouter([InstanceLoad("a:1", "A"), InstanceLoad("b:1", "B")], **kw)


def test_long_cached_prefix_wins():
    r = _router()
    # B holds 12 of the 13 blocks of a 200-token prompt: it computes 8 tokens, A all 200
    d = r.choose(200, {"B": 12}, PAGE)
    assert d.address == "b:1" and d.cached_tokens == 192 and d.cost_tokens == 8


def test_short_shared_prefix_does_not_steer_routing_under_a_threshold():
    r = _router(cache_threshold=0.5)
    # A holds only the first block (a shared system prompt) of 100 tokens: below the
    # 0.5 threshold it counts for nothing, and ties go to the instance sent less so far
    r.instances[0].total_routed_tokens = 500
    assert r.choose(100, {"A": 1}, PAGE).address == "b:1"


def test_load_outweighs_a_small_saving():
    r = _router()
    # B caches 64 of 100 tokens; at the default weight 0.02 a queue of 1500 tokens costs it 30
    # (36 + 30 < 100) but one of 4000 costs it 80 (36 + 80 > 100)
    r.instances[1].in_flight_tokens = 1500
    assert r.choose(100, {"B": 4}, PAGE).address == "b:1"
    r.instances[1].in_flight_tokens = 4000
    assert r.choose(100, {"B": 4}, PAGE).address == "a:1"


def test_at_least_one_token_is_always_computed():
    r = _router()
    # the whole prompt is cached: the last token is recomputed for its logits, and prefill
    # reuses whole blocks only, so a prompt ending on a page boundary reuses one block less,
    # (n - 1) // page * page tokens, which is what the index hint must say too
    assert r.choose(32, {"A": 2}, PAGE).cached_tokens == 16
    assert r.choose(33, {"A": 2}, PAGE).cached_tokens == 32
    assert r.choose(40, {"A": 3}, PAGE).cached_tokens == 32


def test_unhealthy_instances_are_skipped_and_none_left_raises():
    r = _router()
    r.instances[1].reachable = False
    assert r.choose(10, {"B": 5}, PAGE).address == "a:1"
    r.instances[0].reachable = False
    with pytest.raises(LookupError):
        r.choose(10, {}, PAGE)


def test_bad_weights_are_rejected():
    with pytest.raises(ValueError, match="cache_threshold"):
        _router(cache_threshold=1.5)
    with pytest.raises(ValueError, match="load_weight must be a finite number"):
        _router(load_weight=float("nan"))


def test_decode_is_least_active_requests():
    ds = [
        InstanceLoad("d0", in_flight_requests=3),
        InstanceLoad("d1", in_flight_requests=1),
        InstanceLoad("d2", reported_active_requests=2),
    ]
    assert pick_decode(ds, 0).address == "d1"
    ds[1].reachable = False
    assert pick_decode(ds, 0).address == "d2"


def _four(**kw) -> PrefillRouter:
    return PrefillRouter([InstanceLoad(f"h{k}:1", f"I{k}") for k in range(4)], **kw)


def test_round_robin_cycles_and_least_load_takes_the_shortest_queue():
    r = _four(policy="round_robin")
    assert [r.choose(10, {"I0": 9}, PAGE).address for _ in range(5)] == ["h1:1", "h2:1", "h3:1", "h0:1", "h1:1"]
    r = _four(policy="least_load")
    for k, q in enumerate([50, 10, 30, 10]):
        r.instances[k].in_flight_tokens = q
    r.instances[3].reported_queued_tokens = 40  # the instance's own report counts too
    assert r.choose(10, {"I0": 9}, PAGE).address == "h1:1"


def test_random_is_seeded():
    def picks(seed: int, n: int = 50) -> list[str]:
        r = _four(policy="random", seed=seed)
        return [r.choose(10, {}, PAGE).address for _ in range(n)]

    # three routers with one seed make the same 50 picks; another seed makes other picks
    runs = [picks(7) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert picks(8) != runs[0]
    # and the picks spread: 40 of them reach all four instances
    assert len(set(runs[0][:40])) == 4


def test_consistent_hash_keeps_keys_when_another_instance_goes():
    r = _four(policy="consistent_hash")
    keys = [[bytes([a, b])] * 3 for a in range(10) for b in range(10)]
    before = [r.choose(40, {}, PAGE, k).address for k in keys]
    assert before == [r.choose(40, {}, PAGE, k).address for k in keys]  # stable
    assert len(set(before)) == 4
    r.instances[2].reachable = False
    after = [r.choose(40, {}, PAGE, k).address for k in keys]
    # only the keys that lived on the missing instance move
    assert all(a == b for a, b in zip(before, after) if a != "h2:1")
    assert all(a != "h2:1" for a in after)


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="policy must be one of"):
        _router(policy="fastest")


def test_request_ids_that_could_forge_log_lines_are_refused():
    from kvmesh.runtime.wire import check_request_id

    assert check_request_id("req-1_a.b:c@d/e+f=g") == "req-1_a.b:c@d/e+f=g"
    for bad in ("a\nb] prefill forged", "\x1b[31mred", "x" * 129, "tab\there", "ünïcode"):
        with pytest.raises(ValueError, match="request_id must be"):
            check_request_id(bad)


def test_a_second_tier_hit_counts_below_a_pool_hit_and_above_a_miss():
    a, b, c = InstanceLoad("a", instance_id="a"), InstanceLoad("b", instance_id="b"), InstanceLoad("c", instance_id="c")
    router = PrefillRouter([a, b, c], cache_threshold=0.3, load_weight=0.02, tier_hit_weight=0.5)
    # 100 prompt tokens (6 reusable blocks of 16): a holds 5 in its pool, b 5 in its tier, c none
    pick = router.choose(100, {"a": 5, "b": 0, "c": 0}, 16, tiered_blocks={"a": 5, "b": 5, "c": 0})
    assert pick.address == "a" and pick.cached_tokens == 80
    # a busy: its queue outweighs the tier's half-price saving over b, and b over a miss (c)
    a.in_flight_tokens = 3000
    pick = router.choose(100, {"a": 5, "b": 0, "c": 0}, 16, tiered_blocks={"a": 5, "b": 5, "c": 0})
    assert pick.address == "b" and pick.cached_tokens == 80  # prefill will not compute those 80
    assert pick.cost_tokens == 100 - 0.5 * 80
    # blocks in the pool then the tier: the pool's count fully, the tier's at half
    b.in_flight_tokens = 1000
    pick = router.choose(100, {"a": 0, "b": 2, "c": 0}, 16, tiered_blocks={"a": 0, "b": 6, "c": 0})
    assert pick.address == "b" and pick.cost_tokens == 100 - (32 + 0.5 * 64) + 0.02 * (1000 + 0)
    with pytest.raises(ValueError, match="tier_hit_weight"):
        PrefillRouter([a], tier_hit_weight=1.5)
