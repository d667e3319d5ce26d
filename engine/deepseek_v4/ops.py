# T=tokens, X=heads (or 1), Dh=channels of a head, rd=rope dims
"""The numeric pieces every DeepSeek-V4 stage shares: RMSNorm in fp32 and interleaved partial
RoPE, number for number transformers' modeling_deepseek_v4.py (`DeepseekV4RMSNorm`,
`DeepseekV4UnweightedRMSNorm`, `DeepseekV4RotaryEmbedding`).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 as `DeepseekV4RMSNorm` (weight) / `DeepseekV4UnweightedRMSNorm` (None)."""
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else weight * x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing rd channels: x [T, X, Dh], cos/sin [T, rd/2] -> [T, X, Dh]."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)  # [T, 1, rd]
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)  # rotate_half
    return torch.cat([nope, rope * cos + rotated * sin], dim=-1)


class RopeTable:
    """cos/sin rows of one rope type at given positions (`DeepseekV4RotaryEmbedding`)."""

    def __init__(self, config, rope_type: str, device: torch.device) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = config.rope_parameters[rope_type]
        rd = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        kind = params.get("rope_type", "default")
        if kind == "default":
            self.inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
            self.scaling = 1.0
        else:  # the table (e.g. YaRN's) is config arithmetic; transformers' is the reference
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](config, None, layer_type=rope_type)

        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rd/2]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling
