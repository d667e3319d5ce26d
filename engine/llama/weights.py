# H=hidden, I=intermediate, Q=query heads, K=kv heads, D=head_dim
"""A Llama checkpoint's tensors as kvmesh.engine.llama.model takes them: each checked by name
(transformers' naming) and shape, converted to the model's dtype and device, q/k/v and gate/up
fused, every matrix input-major ([in, out], `x @ w`), with the GGUF file's Q4_1 / Q8_0 blocks of
the same weights beside them (`kvmesh.kernels.quant`) and the copies prefill's GEMMs run on
(`kvmesh.kernels.dense.prefill_copy`: oneDNN's for fp32, fp32 ones for bf16 where the CPU only
emulates it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.gguf_blocks import GGUFBlocks
from kvmesh.engine.precision import native_bf16
from kvmesh.kernels.dense import prefill_copy
from kvmesh.kernels.quant import Q4_1Weight, Q8_0Weight, pack_q4_1, pack_q8_0


@dataclass(frozen=True)
class LlamaLayer:
    """One decoder layer's weights as the model computes with them (fused, input-major)."""

    input_norm: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [H, (Q + 2K) * D], input-major
    w_o: torch.Tensor  # [Q * D, H]
    post_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [H, 2I]
    w_down: torch.Tensor  # [I, H]
    # the same weights as GGUF blocks, output-major like the file ([N, K]); None: fp32 only
    q_qkv: Q4_1Weight | Q8_0Weight | None = None
    q_o: Q4_1Weight | Q8_0Weight | None = None
    q_gate_up: Q4_1Weight | Q8_0Weight | None = None
    q_down: Q4_1Weight | Q8_0Weight | None = None
    # the copies of w_qkv, w_o, w_gate_up, w_down prefill's GEMMs run on (`kvmesh.kernels.dense.prefill_copy`)
    dnn: tuple[torch.Tensor | None, ...] = (None, None, None, None)


def pack_blocks(blocks: dict[str, GGUFBlocks], names: list[str]) -> Q4_1Weight | Q8_0Weight | None:
    """The named weights' blocks stacked along the output rows and packed; None unless all
    of them have blocks of one kind."""
    parts = [blocks[n] for n in names if n in blocks]
    if len(parts) != len(names) or len({p.kind for p in parts}) != 1:
        return None
    arrays = [np.concatenate(a) for a in zip(*(p.arrays for p in parts))]
    return pack_q4_1(*arrays) if parts[0].kind == "q4_1" else pack_q8_0(*arrays)


class TensorTaker:
    """Takes a checkpoint's tensors one by one, checking each one's shape, converted to `dtype`
    on `device`; `check_all_taken` then refuses the tensors no one took."""

    def __init__(self, name: str, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.name, self.dtype, self.device = name, dtype, device
        self.left = dict(weights)

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `name` of `shape`; ValueError when it is missing or has another shape."""
        if name not in self.left:
            raise ValueError(f"checkpoint of {self.name!r} lacks tensor {name!r}")
        t = self.left.pop(name)
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=self.dtype)

    def drop(self, name: str) -> None:
        """Leave tensor `name` out, if there (a copy the model does not need)."""
        self.left.pop(name, None)

    def check_all_taken(self) -> None:
        """ValueError when tensors are left (rotary_emb.inv_freq aside: RoPE is computed)."""
        unused = [n for n in self.left if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(
                f"checkpoint of {self.name!r} has tensors this Llama does not use, e.g. {sorted(unused)[:3]}"
            )


def take_layer(take: TensorTaker, c: ModelConfig, p: str, blocks: dict[str, GGUFBlocks] | None) -> LlamaLayer:
    """Layer p (`model.layers.3.`): q/k/v and gate/up fused, every matrix input-major, with
    its GGUF blocks (output-major, as the file) and oneDNN's copies for prefill."""
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
    input_norm = take(p + "input_layernorm.weight", (H,))
    # each matrix output-major ([out, in], as the file), then input-major: oneDNN's copy is made
    # from the first, so that no matrix is transposed twice
    out_major = [
        torch.cat([take(p + f"self_attn.{x}_proj.weight", (q_out if x == "q" else kv_out, H)) for x in "qkv"]),
        take(p + "self_attn.o_proj.weight", (H, q_out)),
        torch.cat([take(p + "mlp.gate_proj.weight", (I, H)), take(p + "mlp.up_proj.weight", (I, H))]),
        take(p + "mlp.down_proj.weight", (H, I)),
    ]
    w_qkv, w_o, w_gate_up, w_down = (w.t().contiguous() for w in out_major)
    post_norm = take(p + "post_attention_layernorm.weight", (H,))
    native = _bf16_native(w_qkv)  # the CPU's flags, read once a layer and only for bf16
    return LlamaLayer(
        input_norm=input_norm,
        w_qkv=w_qkv,
        w_o=w_o,
        post_norm=post_norm,
        w_gate_up=w_gate_up,
        w_down=w_down,
        q_qkv=pack_blocks(blocks, [p + f"self_attn.{x}_proj.weight" for x in "qkv"]) if blocks else None,
        q_o=pack_blocks(blocks, [p + "self_attn.o_proj.weight"]) if blocks else None,
        q_gate_up=pack_blocks(blocks, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]) if blocks else None,
        q_down=pack_blocks(blocks, [p + "mlp.down_proj.weight"]) if blocks else None,
        dnn=tuple(prefill_copy(x.t(), native) for x in out_major),
    )


def _bf16_native(w: torch.Tensor) -> bool:
    """False only for a bf16 CPU tensor on a CPU that emulates bf16 (`native_bf16`: its flags);
    other devices are not asked (a fake CUDA tensor has no device to ask)."""
    return w.dtype != torch.bfloat16 or w.device.type != "cpu" or bool(native_bf16(w.device))
