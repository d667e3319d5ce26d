"""EPLB (engine/ep/eplb.py) against small cases worked out by hand from DeepSeek's algorithm."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.engine.ep.eplb import balanced_packing, balancedness, default_placement, plan, rank_loads, replicate


def test_without_eplb_one_hot_expert_caps_balancedness():
    # 8 experts on 4 ranks, two each; expert 0 takes 10 tokens, the rest 1: rank 0 computes 11,
    # the others 2 each: mean 17 / 4 = 4.25, balancedness 4.25 / 11
    load = np.array([[10, 1, 1, 1, 1, 1, 1, 1]])
    none = default_placement(1, 8, 4)
    assert rank_loads(load, none).tolist() == [[11, 2, 2, 2]]
    assert balancedness(load, none)[0] == pytest.approx(4.25 / 11)
    # EPLB without redundant slots cannot split expert 0: packing gives the same loads
    assert sorted(rank_loads(load, plan(load, 4, 0))[0].tolist()) == [2, 2, 2, 11]


def test_four_redundant_slots_split_the_hot_expert_five_ways():
    # 12 slots: the 4 extra each go to the highest load per replica, all to expert 0 (10, 5,
    # 3.33, 2.5 > 1): 5 replicas of 2 tokens. Packing 3 a rank, heaviest first to the lightest
    # open rank (ties to the lower rank): 2 | 2 | 2 | 2, then 2 -> rank 0 (4), then the ones to
    # ranks 1, 2, 3, 1, 2, 3 and the last to rank 0, the only one with room: [5, 4, 4, 4]
    load = np.array([[10, 1, 1, 1, 1, 1, 1, 1]])
    placement = plan(load, num_ranks=4, num_redundant=4)
    assert placement.replicas[0].tolist() == [5, 1, 1, 1, 1, 1, 1, 1]
    assert rank_loads(load, placement)[0].tolist() == [5, 4, 4, 4]
    assert balancedness(load, placement)[0] == pytest.approx(4.25 / 5)
    # every slot holds an expert, every rank 3 slots, every expert at least once
    assert placement.phy2log.shape == (1, 12) and set(placement.phy2log[0]) == set(range(8))


def test_replicate_and_pack_by_hand():
    slots, replicas = replicate(np.array([6.0, 2.0, 1.0]), 5)
    # 6 > 2: expert 0 (3 each); 3 > 2: expert 0 again (2 each); slots 0, 1, 2, 0, 0
    assert slots.tolist() == [0, 1, 2, 0, 0] and replicas.tolist() == [3, 1, 1]
    pack, position = balanced_packing(np.array([5.0, 1.0, 4.0, 2.0]), 2)
    # 5 -> pack 0, 4 -> pack 1, 2 -> pack 1 (4 < 5), 1 -> pack 0 (the only one with room)
    assert pack.tolist() == [0, 0, 1, 1] and position.tolist() == [0, 1, 0, 1]


def test_hierarchical_keeps_groups_on_their_node_global_balances_freely():
    # 4 experts in 2 groups ({0, 1}, {2, 3}), 2 nodes of 1 rank, 6 slots (3 a node)
    load = np.array([[6, 2, 1, 1]])
    tiered = plan(load, num_ranks=2, num_redundant=2, num_groups=2, num_nodes=2)
    # group loads 8 and 2: one per node; node 0's extra slot goes to expert 0 (3, 3, 2 = 8),
    # node 1's to expert 2 (a tie, the lower index: 0.5, 0.5, 1 = 2)
    assert rank_loads(load, tiered)[0].tolist() == [8, 2]
    assert sorted(tiered.phy2log[0, :3].tolist()) == [0, 0, 1] and sorted(tiered.phy2log[0, 3:].tolist()) == [2, 2, 3]
    # globally both extra slots go to expert 0 (2, 2, 2) and the ranks even out: 5 and 5
    flat = plan(load, num_ranks=2, num_redundant=2)
    assert rank_loads(load, flat)[0].tolist() == [5, 5] and balancedness(load, flat)[0] == 1.0


def test_each_layer_is_planned_on_its_own_counts():
    load = np.array([[9, 1, 1, 1], [1, 1, 1, 9]])
    placement = plan(load, num_ranks=2, num_redundant=2)
    assert placement.replicas.tolist() == [[3, 1, 1, 1], [1, 1, 1, 3]]
    assert (balancedness(load, placement) > balancedness(load, default_placement(2, 4, 2))).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must divide"):
        plan(np.ones((1, 8)), num_ranks=3, num_redundant=0)
    with pytest.raises(ValueError, match=">= 0"):
        plan(-np.ones((1, 8)), num_ranks=2, num_redundant=0)
    with pytest.raises(ValueError, match="nodes must divide"):
        plan(np.ones((1, 8)), num_ranks=4, num_redundant=0, num_groups=2, num_nodes=3)


def test_kvmesh_eplb_plan_prints_balancedness_before_and_after(tmp_path, capsys):
    import json

    from kvmesh.cli import main

    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"layers": [[10, 1, 1, 1, 1, 1, 1, 1]]}))
    assert main(["eplb", "plan", "--ranks", "4", "--redundant", "4", "--json", str(stats)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["balancedness_before"] == pytest.approx([4.25 / 11]) and out["balancedness_after"] == [0.85]
    assert out["replicas"] == [[5, 1, 1, 1, 1, 1, 1, 1]]
    # a bad file or shape is a clear error, exit 2
    stats.write_text(json.dumps({"layers": [[1, 2], [3]]}))
    assert main(["eplb", "plan", "--ranks", "2", str(stats)]) == 2
    assert "one length per row" in capsys.readouterr().err


def test_skewed_tiny_routers_unbalance_real_text_and_eplb_rebalances_it(tmp_path):
    """`make-tiny-model --skew-routers`: random routers are too even for EPLB to matter; skewed
    ones make experts 0 and 1 hot, as trained ones are. Counted on a real prompt's tokens."""
    from kvmesh.bench.tiny_models import HOT_EXPERTS, make_tiny_model
    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.deepseek_v4.runner import DeepseekV4Runner
    from kvmesh.engine.forward import ForwardItem
    from kvmesh.engine.loader import resolve_model

    text = " ".join(
        ["Tell me a story about a lighthouse keeper.", "Explain how rainbows form.", "Describe a busy market."] * 12
    )
    files = resolve_model(str(make_tiny_model("deepseek_v4", tmp_path / "skewed", skew_routers=0.12)))
    ids = load_tokenizer(files).encode(text)[:256]
    runner = DeepseekV4Runner(files, num_pages=16, num_state_slots=1)
    runner.forward([ForwardItem(ids, 0, list(range(16)), 0)])
    load = runner.expert_token_counts()
    assert (load.sum(axis=1) == len(ids) * 2).all()  # top-2 (hash rows of 2) in every layer
    # the hot pair takes over half of every top-k layer's routings (2 of 8 experts: 1/4 if even)
    hot = list(HOT_EXPERTS)
    assert (load[1:, hot].sum(axis=1) > 0.5 * load[1:].sum(axis=1)).all(), load
    before = balancedness(load, default_placement(4, 8, 4)).mean()
    after = balancedness(load, plan(load, num_ranks=4, num_redundant=4)).mean()
    assert before <= 0.5 and after >= 0.9, (before, after)


def test_expert_load_metrics_are_read_at_scrape_time():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvmesh.runtime.moe_metrics import register_expert_load

    registry = CollectorRegistry()
    counts = {"now": np.array([[3, 1], [0, 0]])}
    register_expert_load(registry, lambda: counts["now"])
    text = generate_latest(registry).decode()
    assert 'kvmesh_moe_expert_tokens_total{expert="0",layer="0"} 3.0' in text
    assert 'kvmesh_moe_expert_balancedness{layer="0"} 0.6666' in text  # mean 2 over max 3
    assert 'kvmesh_moe_expert_balancedness{layer="1"} 1.0' in text  # no tokens yet
    counts["now"] = np.array([[5, 5], [1, 0]])
    assert 'kvmesh_moe_expert_balancedness{layer="0"} 1.0' in generate_latest(registry).decode()
    # a dense model exports nothing, and registering again replaces the source
    register_expert_load(registry, lambda: None)
    assert "kvmesh_moe" not in generate_latest(registry).decode()
