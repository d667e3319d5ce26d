"""The tiny random Llama the runner tests share: made by transformers, saved in Hugging Face
layout, so each test compares the runner with the model that wrote it."""

from __future__ import annotations

from pathlib import Path

import torch

from kvmesh.engine.checkpoint import ModelFiles
from kvmesh.engine.loader import resolve_model


def tiny_llama(out_dir: Path, max_positions: int = 64):
    """A 2-layer Llama (vocab 97, hidden 32, GQA 4 query heads over 2 kv heads, untied head,
    seed 0) saved under out_dir / "tiny-llama"; (its ModelFiles, the transformers model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    path = out_dir / "tiny-llama"
    model.save_pretrained(path)
    files: ModelFiles = resolve_model(str(path))
    return files, model
