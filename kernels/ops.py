# T=tokens, H=hidden, I=intermediate, N=positions, X=heads (query and key heads together),
# D=head_dim
"""Pointwise model ops on the CPU PyTorch path: RMSNorm, rotary embedding, SiLU-and-mul; and
`to_device`, how a step's host-built indices reach a GPU.

Each matches transformers' Llama code (`LlamaRMSNorm`, `apply_rotary_pos_emb`, `LlamaMLP`);
`kernels/ref.py` holds that code verbatim and tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as `LlamaRMSNorm`: weight * x / sqrt(mean(x^2) + eps).

    x [T, H] and weight [H], same float dtype; returns [T, H]. Reference: `ref.rms_norm_ref`.
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_table(
    max_positions: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed RoPE (Su et al. 2021, transformers' default rope) for positions [0, N).

    Returns (cos [N, D], sin_rot [N, D]) in `dtype`. The angles are computed in fp32 exactly as
    `LlamaRotaryEmbedding` does (inv_freq = 1 / theta^(2i/D), emb = cat(freqs, freqs)), so rows
    are bit-identical to transformers'. sin_rot is sin with its first half negated: it folds the
    sign of `rotate_half` into the table so `apply_rotary` needs no negation per call.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    cos, sin = emb.cos(), emb.sin()
    half = head_dim // 2
    sin_rot = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [N, D]
    return cos.to(dtype), sin_rot.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """Rotate query/key heads by their positions: x * cos + rotate_half(x) * sin.

    x [T, X, D] (may be a strided view, e.g. a slice of the fused qkv output); cos, sin_rot
    [T, 1, D] rows of `rope_table` at each token's position. Returns a new [T, X, D] tensor.
    rotate_half(x) * sin == swap_halves(x) * sin_rot. Reference: `ref.apply_rotary_ref`.
    """
    t, nx, d = x.shape
    swapped = x.reshape(t, nx, 2, d // 2).flip(2).view(t, nx, d)  # [x2, x1], a copy
    # two rounded products then a sum, as transformers does; addcmul's fused multiply-add
    # differs in the last bit, which 30 layers amplify past a 1e-4 logits tolerance
    return (x * cos).add_(swapped.mul_(sin_rot))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer 2020) of a fused gate/up output: silu(gate) * up.

    x [T, 2I] with gate in the first half, up in the second; returns [T, I].
    Reference: `ref.silu_and_mul_ref` (transformers' `LlamaMLP`).
    """
    i = x.shape[-1] // 2
    gate = F.silu(x[..., :i])  # [T, I]
    return gate.mul_(x[..., i:])


def to_device(t: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host tensor a step built (indices, positions) on `device`: itself on the CPU; a
    host-to-device copy elsewhere, queued without waiting (from pinned memory), never a sync.
    With `out` (a tensor of t's shape, on `device` or not) the copy lands there (a CUDA graph's
    input) and `out` is returned."""
    if out is None and device.type == "cpu":
        return t
    src = t.pin_memory() if torch.cuda.is_available() else t  # pageable memory would make the copy wait
    # empty + copy_, not .to(): under inference mode FakeTensorMode runs a one-element .to() for real
    dst = torch.empty(t.shape, dtype=t.dtype, device=device) if out is None else out
    return dst.copy_(src, non_blocking=True)
