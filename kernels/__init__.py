"""Kernels: a PyTorch path that runs on CPU, with a plain reference for each in `kvmesh.kernels.ref`."""

from kvmesh.kernels.attention import (
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
)
from kvmesh.kernels.ops import apply_rotary, rms_norm, rope_table, silu_and_mul, to_device

__all__ = [
    "AttentionMetadata",
    "apply_rotary",
    "build_attention_metadata",
    "paged_attention",
    "rms_norm",
    "rope_table",
    "silu_and_mul",
    "to_device",
]
