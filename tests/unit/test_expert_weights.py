"""kvmesh.engine.ep.expert_weights: an expert-parallel rank reads the routed experts it holds straight from
the checkpoint, in either tensor naming, and builds its model without the others."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.engine.checkpoint import load_checkpoint_tensors
from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
from kvmesh.engine.deepseek_v4.state import V4StateLayout
from kvmesh.engine.deepseek_v4.weights import check_and_take, normalize_names, routed_expert_key
from kvmesh.engine.ep.expert_weights import CheckpointExperts, rank_keeps
from kvmesh.engine.loader import load_deepseek_v4_config as load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """A tiny V4 as transformers' save_pretrained writes it: DeepSeek's per-expert w1/w2/w3."""
    return make_tiny_model(
        "deepseek_v4",
        tmp_path_factory.mktemp("v4experts"),
        num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
    )


@pytest.fixture(scope="module")
def reference(upstream):
    """Every tensor as the single-process model holds it (fused experts, fp32)."""
    return check_and_take(load_checkpoint_tensors(upstream), load_config(upstream, "tiny"), "tiny")


def _check_takes(store: CheckpointExperts, reference) -> None:
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = store.take(layer, [3, 0, 3])  # order kept, an expert may repeat
        assert torch.equal(gate_up, reference[p + "gate_up_proj"][[3, 0, 3]])
        assert torch.equal(down, reference[p + "down_proj"][[3, 0, 3]])


def test_per_expert_and_fused_checkpoints_give_the_models_expert_weights(upstream, reference, tmp_path):
    raw = load_checkpoint_tensors(upstream)
    assert any(k.endswith(".experts.3.w1.weight") for k in raw), "the tiny model is per-expert"
    config = load_config(upstream, "tiny")
    _check_takes(CheckpointExperts(upstream, 2, config.n_routed_experts), reference)
    # the same weights under transformers' names, gate_up_proj [E, 2I, H] fused
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in upstream.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    save_file(
        {k: v.contiguous() for k, v in normalize_names(raw, config.n_routed_experts).items()}, fused / "m.safetensors"
    )
    _check_takes(CheckpointExperts(fused, 2, config.n_routed_experts), reference)
    with pytest.raises(ValueError, match=r"experts in \[0, 8\)"):
        CheckpointExperts(fused, 2, config.n_routed_experts).take(0, [8])


def test_a_rank_builds_its_model_without_routed_experts(upstream, reference):
    config = load_config(upstream, "tiny")
    tensors = load_checkpoint_tensors(upstream, keep=rank_keeps)
    assert tensors and not any(".mlp.experts." in k and not k.startswith("mtp.") for k in tensors)
    assert any(k.startswith("mtp.0.") and ".experts." in k for k in tensors), "the MTP block keeps its experts"
    layout = V4StateLayout.from_config(config, 16, mtp=True)
    model = DeepseekV4Model(config, tensors, layout, "tiny", routed_experts_here=False)
    assert not [k for k in model.w if routed_expert_key(k)]
    held = sum(t.nbytes for k, t in reference.items() if routed_expert_key(k))
    assert sum(t.nbytes for t in model.w.values()) < sum(t.nbytes for t in reference.values()) - held + 1
    with pytest.raises(RuntimeError, match="live on the expert-parallel ranks"):
        model.local_experts(
            0, torch.zeros(1, config.hidden_size), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)
        )
    # without the flag the same tensors are a checkpoint missing a tensor
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.0.mlp.experts"):
        DeepseekV4Model(config, load_checkpoint_tensors(upstream, keep=rank_keeps), layout, "tiny")


def test_a_checkpoint_missing_an_expert_is_named(upstream, tmp_path):
    raw = load_checkpoint_tensors(upstream)
    del raw[next(k for k in raw if k.endswith("layers.1.ffn.experts.5.w3.weight"))]
    (tmp_path / "config.json").write_bytes((upstream / "config.json").read_bytes())
    save_file(raw, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks layer 1's routed experts"):
        CheckpointExperts(tmp_path, 2, 8)
