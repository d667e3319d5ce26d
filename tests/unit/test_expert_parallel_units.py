"""The parts of expert-parallel decode that need no second process: the data-parallel split, the
placement checks and file, `--ep` on a dense model, and the dispatch / combine arithmetic in a
world of one rank (gloo) with redundant replicas, against `kvmesh.kernels.moe.moe_experts`.
(tests/integration/test_expert_parallel.py runs real worlds of 2 and 4 processes.)"""

from __future__ import annotations

import datetime
import json
import types

import numpy as np
import pytest
import torch

from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.ep import check_ep_model, load_placement_file
from kvmesh.engine.ep.dispatch import ExpertParallelMoE, check_placement, split_by_requests
from kvmesh.engine.ep.eplb import Placement, default_placement, plan
from kvmesh.engine.loader import resolve_model
from kvmesh.kernels.backend import create_kernel_backend
from kvmesh.kernels.moe import moe_experts


def test_split_is_contiguous_and_balanced_by_request_count():
    assert [list(r) for r in split_by_requests(6, 4)] == [[0, 1], [2, 3], [4], [5]]
    assert [list(r) for r in split_by_requests(1, 3)] == [[0], [], []]  # idle ranks still step
    assert [len(r) for r in split_by_requests(0, 2)] == [0, 0]


def test_placement_checks_name_the_mismatch():
    good = default_placement(2, 8, 4)
    check_placement(good, 2, 8, 4)
    with pytest.raises(ValueError, match="for 4 ranks, the EP world has 2"):
        check_placement(good, 2, 8, 2)
    with pytest.raises(ValueError, match=r"phy2log must be \[3 layers"):
        check_placement(good, 3, 8, 4)
    bad = Placement(good.phy2log.copy(), good.replicas, 4)
    bad.phy2log[0, 0] = 1  # expert 0 lost its only slot
    with pytest.raises(ValueError, match="replicas must count"):
        check_placement(bad, 2, 8, 4)


def test_placement_file_is_what_eplb_plan_json_prints(tmp_path, capsys):
    from kvmesh.cli import main

    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"layers": [[90, 80, 5, 5, 5, 5, 5, 5], [1] * 8]}))
    assert main(["eplb", "plan", "--ranks", "2", "--redundant", "2", "--json", str(stats)]) == 0
    out = tmp_path / "placement.json"
    out.write_text(capsys.readouterr().out)
    placement = load_placement_file(str(out), 2)
    check_placement(placement, 2, 8, 2)
    assert placement.replicas[0, :2].tolist() == [2, 2]  # the two hot experts got the spare slots
    out.write_text("{}")
    with pytest.raises(ValueError, match="phy2log"):
        load_placement_file(str(out), 2)


def test_ep_on_the_dense_default_model_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a MoE model.*--ep 1"):
        check_ep_model(resolve_model(None), 2)
    check_ep_model(resolve_model(None), 1)  # single-process decode, as before
    with pytest.raises(ValueError, match="ep must be >= 1"):
        DecodeConfig(ep=0)
    with pytest.raises(ValueError, match="eplb_placement needs --ep"):
        DecodeConfig(eplb_placement="p.json")


def _fake_model(E: int, H: int, I: int, K: int, backend: str = "torch"):
    g = torch.Generator().manual_seed(0)
    w = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g) * 0.2,
        "model.layers.0.mlp.experts.down_proj": torch.randn(E, H, I, generator=g) * 0.2,
        "model.embed_tokens.weight": torch.zeros(1, H),
    }
    config = types.SimpleNamespace(
        num_hidden_layers=1, n_routed_experts=E, hidden_size=H, num_experts_per_tok=K, swiglu_limit=10.0
    )
    return types.SimpleNamespace(config=config, w=w, kernels=create_kernel_backend(backend))


class _Experts:
    """The fake model's experts as `CheckpointExperts` hands them out, counting what is read."""

    def __init__(self, model) -> None:
        self.w, self.reads = model.w, []

    def take(self, layer: int, experts):
        p = f"model.layers.{layer}.mlp.experts."
        self.reads.append((layer, list(experts)))
        return self.w[p + "gate_up_proj"][list(experts)], self.w[p + "down_proj"][list(experts)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_and_combine_in_a_world_of_one_equal_moe_experts_and_count_every_replica(backend, request):
    # --kernel-backend triton on the EP ranks: a rank's experts run as the Triton MoE kernel
    # (here under Triton's interpreter on the CPU; `kvmesh.bench.kernels_gpu` on a GPU)
    if backend == "triton":
        request.getfixturevalue("triton_device")
    E, H, I, K, T = 8, 16, 8, 2, 40
    model = _fake_model(E, H, I, K, backend)
    assert model.kernels.name == backend
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    try:
        load = np.array([[50, 30, 1, 1, 1, 1, 1, 1]])
        placement = plan(load, 1, 3)  # 11 slots: expert 0 gets two spare replicas, expert 1 one
        assert placement.replicas[0].tolist() == [3, 2, 1, 1, 1, 1, 1, 1]
        experts = _Experts(model)
        moe = ExpertParallelMoE(model, 0, 1, placement, experts)
        assert experts.reads == [(0, list(range(E)))]  # each expert read once, replicas share it
        assert [t.shape[0] for t in (*moe.gate_up, *moe.down)] == [11, 11]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        ids[:, 0] = 0  # every token uses expert 0: its 3 replicas split them by token index
        weights = torch.rand(T, K, generator=g)
        p = "model.layers.0.mlp.experts."
        want = moe_experts(x, model.w[p + "gate_up_proj"], model.w[p + "down_proj"], weights, ids, 10.0)
        moe.token_offset = 7
        tol = 1e-6 if backend == "torch" else 1e-5  # the kernel's own summation order
        torch.testing.assert_close(moe(0, x, weights, ids), want, rtol=tol, atol=tol)
        assert moe.loads.rank_tokens.tolist() == [[T * K]]
        assert moe.loads.expert_tokens[0].tolist() == torch.bincount(ids.reshape(-1), minlength=E).tolist()
        moe.idle_forward()  # no tokens: still one exchange a layer, nothing counted
        assert moe.loads.rank_tokens.tolist() == [[T * K]]
    finally:
        torch.distributed.destroy_process_group()


def test_a_new_placement_reads_only_the_experts_a_rank_did_not_hold():
    # two ranks' view from rank 0: 8 experts over 2 ranks, 4 slots each, no replicas
    E, H, I, K = 8, 16, 8, 2
    model = _fake_model(E, H, I, K)
    experts = _Experts(model)
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        first = default_placement(1, E, 2)  # rank 0 holds experts 0..3
        moe = ExpertParallelMoE(model, 0, 2, first, experts)
        assert experts.reads == [(0, [0, 1, 2, 3])]
        assert moe.expert_nbytes() == 4 * (2 * I * H + H * I) * 4  # its 4 slots, fp32, no others
        # experts 2 and 5 change ranks: rank 0 reads expert 5 only, keeps 0, 1, 3
        moved = Placement(np.array([[0, 1, 5, 3, 4, 2, 6, 7]]), np.ones((1, E), np.int64), 2)
        moe.load_placement(moved)
        assert experts.reads[1:] == [(0, [5])]
        p = "model.layers.0.mlp.experts."
        assert torch.equal(moe.gate_up[0], model.w[p + "gate_up_proj"][[0, 1, 5, 3]])
        assert torch.equal(moe.down[0], model.w[p + "down_proj"][[0, 1, 5, 3]])
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_on_other_hosts_keep_their_sequences_while_the_split_stays_balanced():
    """With ranks on other hosts (no shared pages) a sequence stays on the rank that ran it last
    step as long as that rank is within its balanced count; the others fill the ranks under
    theirs in order; a sequence's verification rows (state_from) go with it."""
    from kvmesh.engine.ep.runner import ExpertParallelRunner
    from kvmesh.engine.forward import ForwardItem

    world = types.SimpleNamespace(remote=True, num_ranks=3, _owner={})

    def assign(slots: list[int], rows: dict[int, int] | None = None) -> list[list[int]]:
        items = []
        for s in slots:
            items.append(ForwardItem([1], 4, [s], s))
            for k in range((rows or {}).get(s, 1) - 1):  # verification rows chaining scratch slots
                items.append(ForwardItem([1], 5 + k, [s], 100 + k, state_from=items[-1].state_slot))
        starts = [0] + [b for b in range(1, len(items)) if items[b].state_from is None] + [len(items)]
        shares = ExpertParallelRunner._assign(world, items, starts)
        return [[items[b].state_slot for b in share] for share in shares]

    assert assign([0, 1, 2, 3, 4]) == [[0, 1], [2, 3], [4]]
    assert assign([1, 3, 4]) == [[1], [3], [4]]  # 0 and 2 left: nobody moves
    assert assign([1, 3, 4, 5, 6]) == [[1, 5], [3, 6], [4]]
    assert assign([4, 5, 6]) == [[5], [6], [4]]  # 1 and 3 left: 5 and 6 stay, 4 stays
    assert assign([4, 6], rows={4: 3}) == [[4, 100, 101], [6], []]  # 4's rows move whole, to rank 0
    assert world._owner == {4: 0, 6: 1}


def test_an_ep_init_address_and_secret_are_checked_before_anything_starts(monkeypatch):
    from kvmesh.engine.ep.link import ep_secret, parse_init_addr

    assert parse_init_addr("10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert parse_init_addr("[fd00::1]:29500") == ("fd00::1", 29500)
    for bad in ("10.0.0.5", ":29500", "host:0", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_init_addr(bad)
    with pytest.raises(ValueError, match="ep_init_addr needs --ep >= 2"):
        DecodeConfig(ep_init_addr="10.0.0.5:29500")
    with pytest.raises(ValueError, match="HOST:PORT"):
        DecodeConfig(ep=2, ep_init_addr="10.0.0.5")
    monkeypatch.delenv("KVMESH_EP_SECRET", raising=False)
    with pytest.raises(ValueError, match="KVMESH_EP_SECRET"):
        ep_secret()
    monkeypatch.setenv("KVMESH_EP_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16"):
        ep_secret()
    monkeypatch.setenv("KVMESH_EP_SECRET", "a-long-enough-secret")
    assert ep_secret() == b"a-long-enough-secret"
