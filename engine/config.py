"""The model shape the engine needs, read from a Hugging Face `config.json` dict (torch-free)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: the gateway reads configs without loading torch
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a Llama-style decoder (`LlamaConfig` names in brackets)."""

    name: str
    """Served model name, e.g. "SmolLM2-135M-Instruct"."""
    vocab_size: int
    """Number of token ids [vocab_size]."""
    hidden_size: int
    """Width of the residual stream [hidden_size]."""
    intermediate_size: int
    """Width of the MLP's gate/up projections [intermediate_size]."""
    num_layers: int
    """Decoder layers [num_hidden_layers]."""
    num_heads: int
    """Query heads [num_attention_heads]."""
    num_kv_heads: int
    """Key/value heads, a divisor of num_heads (GQA) [num_key_value_heads]."""
    head_dim: int
    """Width of one head [head_dim, default hidden_size // num_attention_heads]."""
    rms_norm_eps: float
    """Epsilon inside RMSNorm's square root [rms_norm_eps]."""
    rope_theta: float
    """RoPE base frequency [rope_parameters.rope_theta or rope_theta]."""
    max_position_embeddings: int
    """Longest sequence in tokens the RoPE table covers [max_position_embeddings]."""
    tie_word_embeddings: bool
    """The LM head reuses the token embedding matrix [tie_word_embeddings]."""
    bos_token_id: int | None
    """Beginning-of-sequence token id, if the model has one [bos_token_id]."""
    eos_token_ids: tuple[int, ...]
    """Token ids that end generation [eos_token_id, an int or a list]."""

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict, name: str) -> ModelConfig:
        """Build from a transformers `config.json` dict of a Llama-style model.

        Raises ValueError naming the field when a required one is missing or invalid, or when
        the RoPE scaling type is not plain RoPE (the only one `kvmesh.kernels.ops` implements).
        """

        def need(key: str):
            if d.get(key) is None:
                raise ValueError(f"config.json of {name!r} lacks required field {key!r}")
            return d[key]

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json of {name!r}: rope_type {rope_type!r} is not supported, only 'default' RoPE")
        rope_theta = rope.get("rope_theta", d.get("rope_theta"))
        if rope_theta is None:
            raise ValueError(
                f"config.json of {name!r} lacks required field 'rope_theta' (top level or in rope_parameters)"
            )
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        if not all(isinstance(e, int) for e in eos_ids):
            raise ValueError(f"config.json of {name!r}: eos_token_id must be an int or a list of ints, got {eos!r}")
        try:
            return cls(
                name=name,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=d.get("num_key_value_heads") or num_heads,
                head_dim=d.get("head_dim") or hidden // num_heads,
                rms_norm_eps=float(need("rms_norm_eps")),
                rope_theta=float(rope_theta),
                max_position_embeddings=need("max_position_embeddings"),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json of {name!r}: {e}") from e

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers at `dtype`."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype.itemsize
