# N=output features (rows), K=input features, G=K/32 blocks of a row
"""A GGUF file's Q4_1 / Q8_0 weight blocks, kept beside the fp32 conversion for the decode kernels.

transformers dequantizes a GGUF file to fp32 (engine/loader.py caches that checkpoint); the
decode path (`kvmesh.kernels.quant`) computes from the file's blocks instead. This module
extracts them once into `<checkpoint_dir>/gguf/blocks.safetensors`, under transformers' names
and in transformers' row order: llama.cpp's converter permutes the rows of q_proj and k_proj
for its RoPE layout, and transformers' GGUF loader (`LlamaTensorProcessor`) permutes them
back, so the same row permutation is applied to the blocks here.

Every tensor is checked before it is kept: its blocks, dequantized as gguf-py does, must equal
the fp32 checkpoint's tensor bit for bit. A tensor that differs, or has another quantization
type, is left out and served from fp32.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch
from tqdm import tqdm

from kvmesh.engine.checkpoint import BLOCKS_FILE, load_checkpoint_tensors
from kvmesh.kernels.quant import QK
from kvmesh.kernels.ref import dequantize_q4_1_ref, dequantize_q8_0_ref

logger = logging.getLogger(__name__)


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_Q4_1_BYTES = 2 + 2 + QK // 2  # d (fp16), m (fp16), 32 nibbles
_Q8_0_BYTES = 2 + QK  # d (fp16), 32 int8


@dataclass(frozen=True)
class GGUFBlocks:
    """One weight's blocks, row n being output feature n.

    kind "q4_1": arrays (qs [N, K/2] uint8, q[n, 2j] in the low nibble of qs[n, j]; d, m [N, G]
    fp16). kind "q8_0": arrays (q [N, K] int8, d [N, G] fp16).
    """

    kind: str
    arrays: tuple[np.ndarray, ...]

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32, computed as gguf-py's `dequantize_blocks` does (d * q + m in fp32)."""
        ref = dequantize_q4_1_ref if self.kind == "q4_1" else dequantize_q8_0_ref
        return ref(*(torch.from_numpy(a) for a in self.arrays))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def _unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' `_reverse_permute_weights` on rows: [N, ...] -> [N, ...]."""
    w = a.reshape(n_head, a.shape[0] // n_head // 2, 2, *a.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(a.shape))


def _from_raw(kind: str, raw: np.ndarray) -> GGUFBlocks:
    """raw [N, G * block bytes] uint8 as ggml stores a row -> GGUFBlocks."""
    n = raw.shape[0]
    if kind == "q4_1":
        b = raw.reshape(n, -1, _Q4_1_BYTES)
        d, m = b[..., 0:2].copy().view(np.float16)[..., 0], b[..., 2:4].copy().view(np.float16)[..., 0]
        nib = b[..., 4:]  # byte i holds input i (low nibble) and input i + 16 (high)
        q = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(n, -1)  # [N, K] in 0..15
        return GGUFBlocks(kind, (q[:, 0::2] | (q[:, 1::2] << 4), d, m))
    b = raw.reshape(n, -1, _Q8_0_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    return GGUFBlocks(kind, (b[..., 2:].copy().view(np.int8).reshape(n, -1), d))


def extract_blocks(gguf_path: Path, config: dict, fp32: dict[str, torch.Tensor]) -> dict[str, GGUFBlocks]:
    """The Q4_1 / Q8_0 weights of a Llama GGUF file whose dequantized blocks equal `fp32`.

    config is the converted checkpoint's config.json (num_attention_heads,
    num_key_value_heads); fp32 maps transformers names to their [N, K] fp32 tensors.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"],
    }
    out: dict[str, GGUFBlocks] = {}
    skipped: list[str] = []
    tensors = GGUFReader(gguf_path).tensors
    # a bar on a terminal only (the launcher converts in the foreground; services log to files)
    for tensor in tqdm(tensors, desc="keeping GGUF blocks", unit="tensor", leave=False, disable=None):
        name = _hf_name(tensor.name)
        if name is None:
            continue
        if tensor.tensor_type not in kinds or name not in fp32:
            skipped.append(name)
            continue
        blocks = _from_raw(kinds[tensor.tensor_type], np.asarray(tensor.data))
        proj = name.split(".")[-2]
        if proj in heads:
            blocks = GGUFBlocks(blocks.kind, tuple(_unpermute_rows(a, heads[proj]) for a in blocks.arrays))
        if not torch.equal(blocks.dequantize(), fp32[name]):
            logger.warning("GGUF blocks of %s differ from the fp32 checkpoint; serving it from fp32", name)
            skipped.append(name)
            continue
        out[name] = blocks
    if skipped:
        logger.info("%d weights stay fp32 only, e.g. %s", len(skipped), skipped[:3])
    return out


def write_blocks(checkpoint_dir: Path, gguf_path: Path) -> None:
    """Extract `gguf_path`'s blocks into checkpoint_dir/BLOCKS_FILE (atomically).

    Callers hold the checkpoint's conversion lock.
    """
    config = json.loads((checkpoint_dir / "config.json").read_text())
    blocks = extract_blocks(gguf_path, config, load_checkpoint_tensors(checkpoint_dir))
    tensors = {f"{name}.{b.kind}.{i}": a for name, b in blocks.items() for i, a in enumerate(b.arrays)}
    target = checkpoint_dir / BLOCKS_FILE
    target.parent.mkdir(mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".blocks.", dir=target.parent)
    os.close(fd)
    try:
        safetensors.numpy.save_file(tensors, tmp)
        os.chmod(tmp, 0o644)
        os.rename(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    logger.info("kept the GGUF blocks of %d weights in %s", len(blocks), target)


def load_blocks(checkpoint_dir: Path) -> dict[str, GGUFBlocks]:
    """The blocks `write_blocks` kept for this checkpoint, by transformers name; {} if none."""
    path = checkpoint_dir / BLOCKS_FILE
    if not path.is_file():
        return {}
    grouped: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, array in safetensors.numpy.load_file(path).items():
        name, kind, index = key.rsplit(".", 2)
        grouped.setdefault((name, kind), {})[int(index)] = array
    return {name: GGUFBlocks(kind, tuple(parts[i] for i in sorted(parts))) for (name, kind), parts in grouped.items()}
