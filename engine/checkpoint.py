"""A checkpoint folder in Hugging Face layout and what is read straight from it: its
architecture, its tensors, its tokenizer and its fingerprint.

The lowest module of `engine/`: the loader (which makes such folders from GGUF files), the GGUF
block extractor and every runner read checkpoints through it, and it imports none of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the gateway imports this module and never loads weights
    import torch


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's checkpoint lives, in Hugging Face layout."""

    name: str
    """Served model name, e.g. "SmolLM2-135M-Instruct"."""
    checkpoint_dir: Path
    """Holds config.json, model.safetensors (or shards) and the tokenizer files."""


BLOCKS_FILE = Path("gguf") / "blocks.safetensors"
"""Where a GGUF file's weight blocks live (kvmesh.engine.gguf_blocks), relative to the converted
checkpoint folder."""


def architecture(files: ModelFiles) -> str:
    """The checkpoint's architecture, config.json's `architectures[0]` (e.g. "LlamaForCausalLM").

    Raises ValueError when config.json names none.
    """
    names = json.loads((files.checkpoint_dir / "config.json").read_text()).get("architectures") or []
    if not names or not isinstance(names[0], str):
        raise ValueError(f"config.json of {files.name!r} names no architecture (field 'architectures')")
    return names[0]


def model_fingerprint(files: ModelFiles) -> str:
    """A short digest naming the served model: BLAKE2b of its name and config.json bytes (16 hex
    characters). Every service and the gateway report it, so instances serving different
    models are never mixed in one mesh."""
    digest = hashlib.blake2b(files.name.encode(), digest_size=8)
    digest.update((files.checkpoint_dir / "config.json").read_bytes())
    return digest.hexdigest()


def checkpoint_tensor_names(checkpoint_dir: Path) -> list[tuple[Path, str]]:
    """(file, name) of every tensor in the folder's *.safetensors files, in file order, read
    from their headers only (no tensor data)."""
    import safetensors

    names = []
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="pt") as f:
            names += [(path, k) for k in f.keys()]
    return names


def load_checkpoint_tensors(checkpoint_dir: Path, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files (shards merged), by name; with `keep`,
    only those whose name it accepts (the others are never read from disk)."""
    import safetensors
    import safetensors.torch

    tensors = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        if keep is None:
            tensors.update(safetensors.torch.load_file(path))
            continue
        with safetensors.safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if keep(k)})
    return tensors


GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_config.json's `tokenizer_class` values that name transformers' generic tokenizer over
a tokenizer.json (`TokenizersBackend`; `PreTrainedTokenizerFast` is its older name)."""


def load_tokenizer(files: ModelFiles):
    """The tokenizer saved in `files.checkpoint_dir`: the class AutoTokenizer would pick.

    Where tokenizer_config.json names the generic tokenizer over a tokenizer.json (every model
    kvmesh converts from GGUF), that class is loaded directly. AutoTokenizer would first read
    the model's config through AutoConfig, whose import pulls in torch: ~3 s of a gateway's
    start on a 2-core machine, and a gateway never loads weights. Any other tokenizer_class
    goes through AutoTokenizer. Raises what transformers raises for a folder it cannot read."""
    config_file = files.checkpoint_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    generic = config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
    if generic and (files.checkpoint_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(files.checkpoint_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.checkpoint_dir)


def long_prompt_ids(tokenizer, num_tokens: int) -> list[int]:
    """A prompt of exactly `num_tokens` token ids (a numbered list, no special tokens): the long
    prompt every prefill benchmark feeds its contenders (`kvmesh.bench.peers`, `kvmesh.bench.prefill`).
    Raises ValueError if the text tokenizes short."""
    text = " ".join(f"item {i}: the lighthouse keeper logs the weather." for i in range(num_tokens))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"the long prompt has {len(ids)} tokens, fewer than {num_tokens}")
    return list(ids[:num_tokens])
