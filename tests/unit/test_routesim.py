"""kvmesh routesim: the simulator's figures on examples computed by hand, and the router's
load guard on a trace whose every request shares its first block."""

import random

from kvmesh.bench.routing_sim import LRUBlocks, TraceRequest, fixed_chooser, oracle_hit_rate, router_chooser, simulate

# four requests, all at t=0, prefill at 1024 tokens/s, 512-token blocks
TINY = [
    TraceRequest(0.0, 1024, (0, 1)),
    TraceRequest(0.0, 1024, (0, 2)),
    TraceRequest(0.0, 1536, (0, 1, 3)),
    TraceRequest(0.0, 2048, (0, 2, 4, 5)),
]


def test_round_robin_and_oracle_by_hand():
    res = simulate(TINY, 2, 0, router_chooser("round_robin"), 1024.0, "round_robin")
    # round robin starts at instance 1: r1 -> 1, r2 -> 0, r3 -> 1, r4 -> 0
    # hits: r3 finds (0, 1) on instance 1, r4 finds (0, 2) on instance 0: 4 of 11 blocks
    assert res.hit_rate == 4 / 11
    # one shared cache: r2 finds 0, r3 finds 0 1, r4 finds 0 2: 5 of 11
    assert res.oracle_hit_rate == 5 / 11
    # computed: instance 1 = 1024 + 512, instance 0 = 1024 + 1024 -> mean 1792 / max 2048
    assert res.tokens_per_instance == (2048, 1536)
    assert res.balancedness == 1792 / 2048
    # r1, r2 start at once; r3 and r4 wait 1 s behind them: delays 0, 0, 1, 1
    assert res.queue_p50_s == 0.5 and res.queue_p90_s == 1.0


def test_per_request_records_by_hand():
    res = simulate(TINY, 2, 0, router_chooser("round_robin"), 1024.0, "round_robin")
    # the same schedule as above, request by request: (instance, hit blocks, computed, start, finish)
    assert [(r.instance, r.hit_blocks, r.computed_tokens, r.start_s, r.finish_s) for r in res.requests] == [
        (1, 0, 1024, 0.0, 1.0),
        (0, 0, 1024, 0.0, 1.0),
        (1, 2, 512, 1.0, 1.5),
        (0, 2, 1024, 1.0, 2.0),
    ]


def test_scaled_blocks_save_their_own_tokens():
    # a trace scaled to 16-token blocks: a hit of 2 blocks saves 32 tokens, not 2 x 512
    scaled = [TraceRequest(0.0, 16 * len(r.hash_ids), r.hash_ids) for r in TINY]
    res = simulate(scaled, 2, 0, router_chooser("round_robin", 16), 1024.0, "round_robin", 16)
    assert [r.computed_tokens for r in res.requests] == [32, 32, 16, 32]
    assert res.tokens_per_instance == (64, 48)


def test_lru_capacity_and_oracle_capacity():
    cache = LRUBlocks(2)
    cache.touch([1, 2])
    cache.touch([3])  # evicts 1, the least recently used
    assert cache.prefix_hits([2, 3]) == 2 and cache.prefix_hits([1, 2]) == 0
    # a single cache of 2 blocks: r2 finds 0 (cache 0 1 -> 0 2), r3 finds 0 (1 was evicted),
    # r4: cache holds 1 3 after r3, so nothing
    assert oracle_hit_rate(TINY, 2) == 2 / 11


def test_shared_first_block_does_not_pile_onto_one_instance():
    # 600 requests of 4-40 blocks, every one starting with block 0 and otherwise unique,
    # arriving every 0.2 s at 4 instances of 20k tokens/s (about 70% busy)
    rng = random.Random(0)
    nxt, trace = 1, []
    for i in range(600):
        n = rng.randint(4, 40)
        trace.append(TraceRequest(0.2 * i, n * 512, (0, *range(nxt, nxt + n - 1))))
        nxt += n
    res = simulate(trace, 4, 0, router_chooser("cache_aware"), 20000.0, "cache_aware")
    mean = sum(res.tokens_per_instance) / 4
    assert max(res.tokens_per_instance) <= 1.3 * mean, res.tokens_per_instance


def test_bad_arguments_and_traces_are_refused(tmp_path):
    import argparse

    import pytest

    from kvmesh.bench.routesim import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    good = tmp_path / "t.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n')
    with pytest.raises(ValueError, match="--instances must be >= 1"):
        run(parser.parse_args([str(good), "--instances", "0"]))
    with pytest.raises(ValueError, match="--capacity-blocks must be >= 0"):
        run(parser.parse_args([str(good), "--capacity-blocks", "-1"]))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no requests"):
        run(parser.parse_args([str(tmp_path / "empty.jsonl")]))
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a Mooncake trace row"):
        run(parser.parse_args([str(tmp_path / "bad.jsonl")]))
    assert run(parser.parse_args([str(good), "--policy", "round_robin"])) == 0


def test_out_of_range_trace_values_are_refused(tmp_path):
    import pytest

    from kvmesh.bench.routing_sim import load_trace

    for row, what in (
        ('{"timestamp": 0, "input_length": 600, "hash_ids": [-1]}', "hash_ids"),
        ('{"timestamp": NaN, "input_length": 600, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 1.5e400, "hash_ids": [1]}', "input_length"),
    ):
        path = tmp_path / "t.jsonl"
        path.write_text(row + "\n")
        with pytest.raises(ValueError, match=what):
            load_trace(str(path))


def test_multiturn_conversations_follow_whole_earlier_prompts_by_hand():
    from kvmesh.bench.multiturn import conversations

    def req(t: float, tokens: int, ids) -> TraceRequest:
        return TraceRequest(t, tokens, tuple(ids))

    trace = [
        req(0, 2600, [0, 1, 2, 3, 4, 5]),  # a: 5 full blocks
        req(1, 700, [0, 9]),  # alone: shares only the system block
        req(2, 3100, [0, 1, 2, 3, 4, 6, 7]),  # a's 2nd turn: a's 5 full blocks, then new ones
        req(3, 1100, [0, 20, 21]),  # b
        req(4, 4000, [0, 1, 2, 3, 4, 6, 7, 8]),  # a's 3rd turn: extends the 2nd's 6 full blocks
        req(5, 1600, [0, 20, 21, 22]),  # b's 2nd turn: b's 2 full blocks
    ]
    turns = conversations(trace, limit=10)
    assert [(t.request.arrival_s, t.parent, t.shared_blocks) for t in turns] == [
        (0, None, 0),
        (2, 0, 5),
        (3, None, 0),
        (4, 1, 6),
        (5, 2, 2),  # b's whole prompt is its 2 full blocks (1,100 tokens): [0, 20]
    ]
    # conversations go whole or not at all: a's three turns fit in 4, b's two would not
    assert [t.request.arrival_s for t in conversations(trace, limit=4)] == [0, 2, 4]


def test_a_tier_keeps_what_the_cache_evicts_and_a_pull_takes_what_a_peer_holds_by_hand():
    trace = [
        TraceRequest(0.0, 2048, (1, 2, 3, 4)),  # -> instance 0 (fixed), cache of 4: holds 1 2 3 4
        TraceRequest(1.0, 2048, (5, 6, 7, 8)),  # -> instance 0: evicts 1 2 3 4, which its tier keeps
        TraceRequest(2.0, 2048, (1, 2, 3, 9)),  # -> instance 0: 1 2 3 from the tier, 9 computed
        TraceRequest(3.0, 2048, (1, 2, 3, 10)),  # -> instance 1: 1 2 3 pulled from instance 0's cache
    ]
    res = simulate(trace, 2, 4, fixed_chooser([0, 0, 0, 1]), 1024.0, "fixed", tier_blocks=8, pull_min_blocks=2)
    got = [(r.instance, r.hit_blocks, r.tier_blocks, r.pulled_blocks, r.computed_tokens) for r in res.requests]
    assert got == [(0, 0, 0, 0, 2048), (0, 0, 0, 0, 2048), (0, 0, 3, 0, 512), (1, 0, 0, 3, 512)]
    assert res.tier_hit_rate == 3 / 16 and res.pull_rate == 3 / 16
    # one cache of the whole size (2 x (4 + 8) blocks) would compute the same: 2048 + 2048 + 512 + 512
    assert res.computed_tokens == res.oracle_computed_tokens == 5120
    # a pull costs pull_cost (5%) of computing its blocks: instance 1's prefill takes 0.5 + 0.075 s
    assert abs(res.requests[3].finish_s - res.requests[3].start_s - (512 + 0.05 * 1536) / 1024.0) < 1e-9
