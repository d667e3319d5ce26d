# L=MoE layers, E=routed experts of a layer, I=expert intermediate size, H=hidden, n=experts asked for
"""A DeepSeek-V4 checkpoint's routed experts, read from disk one expert at a time.

An expert-parallel rank holds only the experts its EPLB placement gives it (its slots, with
their redundant replicas): with DeepSeek-V4-class models the routed experts are almost all of
the weights, so holding every one on every rank would defeat expert parallelism. The rank's
model is built without the main layers' routed experts (`rank_keeps`), and this store reads the
ones a placement names straight from the safetensors files (memory-mapped: only the bytes of
those experts are touched), at start and again for each new placement.

Both namings `kvmesh.engine.deepseek_v4.weights` accepts work: transformers' fused
`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] (one row of
E is read), or DeepSeek's per-expert `layers.{i}.ffn.experts.{e}.w1/w2/w3.weight` (gate_up is
w1 then w3, as `normalize_names` stacks them). The MTP block's experts are not routed over
ranks and stay in the model. Weights come back fp32, as the model keeps its tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.engine.checkpoint import checkpoint_tensor_names
from kvmesh.engine.deepseek_v4.weights import normalize_key, routed_expert_key


def rank_keeps(key: str) -> bool:
    """Whether an expert-parallel rank loads checkpoint tensor `key` with its model: every
    tensor but the main layers' routed experts (and deeper MTP modules, which are dropped)."""
    name = normalize_key(key)
    return name is not None and routed_expert_key(name) is None


class CheckpointExperts:
    """Where each routed expert of each main layer lies in a checkpoint folder's safetensors
    files, and `take` to read some of them. Raises ValueError at construction when a layer's
    experts are missing or incomplete."""

    def __init__(self, checkpoint_dir: Path, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._where: dict[tuple[int, int | None, str], tuple[Path, str]] = {}
        """(layer, expert or None when fused, part) -> (file, key in it)"""
        for path, key in checkpoint_tensor_names(Path(checkpoint_dir)):
            name = normalize_key(key)
            found = routed_expert_key(name) if name is not None else None
            if found is not None:
                self._where[found] = (path, key)
        for i in range(num_layers):
            fused = all((i, None, part) in self._where for part in ("gate_up_proj", "down_proj"))
            split = all((i, e, w) in self._where for e in range(num_experts) for w in ("w1", "w2", "w3"))
            if not (fused or split):
                raise ValueError(
                    f"checkpoint {checkpoint_dir} lacks layer {i}'s routed experts (gate_up_proj and down_proj, "
                    f"or w1/w2/w3 of each of {num_experts} experts)"
                )

    def take(self, layer: int, experts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [n, 2I, H], down [n, H, I]) fp32 of `layer`'s `experts`, in the order given
        (an expert may repeat). Raises ValueError for a layer or expert out of range."""
        if not 0 <= layer < self.num_layers or any(not 0 <= e < self.num_experts for e in experts):
            raise ValueError(
                f"need a layer in [0, {self.num_layers}) and experts in [0, {self.num_experts}), got {layer}, {experts}"
            )
        rows: dict[str, list[torch.Tensor]] = {"gate_up": [], "down": []}
        for e in experts:
            if (layer, None, "gate_up_proj") in self._where:
                parts = {p: self._read(layer, None, p, e) for p in ("gate_up_proj", "down_proj")}
                gate_up, down = parts["gate_up_proj"], parts["down_proj"]
            else:
                gate_up = torch.cat([self._read(layer, e, "w1"), self._read(layer, e, "w3")])
                down = self._read(layer, e, "w2")
            rows["gate_up"].append(gate_up.float())
            rows["down"].append(down.float())
        return torch.stack(rows["gate_up"]), torch.stack(rows["down"])

    def _read(self, layer: int, expert: int | None, part: str, row: int | None = None) -> torch.Tensor:
        import safetensors

        path, key = self._where[(layer, expert, part)]
        with safetensors.safe_open(str(path), framework="pt") as f:
            return f.get_slice(key)[row] if row is not None else f.get_tensor(key)
