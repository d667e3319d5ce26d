"""Model resolution, GGUF conversion into the cache, and ModelConfig parsing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmesh.engine.checkpoint import ModelFiles
from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader import DEFAULT_MODEL, cache_root, default_gguf_path, load_config, resolve_model

REPO = Path(__file__).resolve().parents[2]

SMOL = {  # the fields of SmolLM2-135M-Instruct's config.json that matter
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_config_from_hf_dict_and_kv_bytes():
    c = ModelConfig.from_hf_dict(SMOL, "smol")
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.rope_theta == 1e5 and c.eos_token_ids == (2,) and c.tie_word_embeddings
    assert c.num_queries_per_kv == 3
    # 30 layers x (K and V) x 3 heads x 64 dims x 4 bytes
    assert c.kv_bytes_per_token(torch.float32) == 30 * 2 * 3 * 64 * 4 == 46080
    assert c.kv_bytes_per_token(torch.bfloat16) == 23040


def test_config_defaults_and_older_layouts():
    d = {k: v for k, v in SMOL.items() if k not in ("head_dim", "num_key_value_heads", "rope_parameters")}
    c = ModelConfig.from_hf_dict({**d, "rope_theta": 10000.0, "eos_token_id": [2, 7]}, "old")
    assert c.head_dim == 576 // 9 and c.num_kv_heads == 9  # derived defaults
    assert c.rope_theta == 1e4 and c.eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(num_hidden_layers=None), "lacks required field 'num_hidden_layers'"),
        (dict(rope_parameters={"rope_type": "default"}), "lacks required field 'rope_theta'"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope_type 'llama3'"),
        (dict(num_key_value_heads=4), r"num_heads \(9\) must be a multiple of num_kv_heads \(4\)"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(eos_token_id="2"), "eos_token_id must be an int or a list"),
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**SMOL, **change}, "broken")


def test_unknown_model_says_what_to_pass(tmp_path):
    expected = (
        f"unknown model 'no-such-model': pass a path to a .gguf file or a Hugging Face "
        f"checkpoint folder, or '{DEFAULT_MODEL}'"
    )
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-model")
    assert str(err.value) == expected
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path))  # a folder without config.json


def test_hf_folder_is_used_as_is(tmp_path):
    ckpt = tmp_path / "tiny-llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(SMOL))
    (ckpt / "model.safetensors").write_bytes(b"")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    files = resolve_model(str(ckpt))
    assert files == ModelFiles(name="tiny-llama", checkpoint_dir=ckpt.resolve())
    assert load_config(files).eos_token_ids == (2, 5)  # generation_config adds its eos ids


def test_default_model_resolves_to_a_converted_checkpoint():
    files = resolve_model()
    assert files.name == DEFAULT_MODEL
    assert resolve_model(DEFAULT_MODEL.lower()) == files  # the name is case-insensitive
    assert files.checkpoint_dir.parent == cache_root()
    assert files.checkpoint_dir.name.startswith(f"{DEFAULT_MODEL}-")
    assert len(files.checkpoint_dir.name) == len(DEFAULT_MODEL) + 1 + 12
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (files.checkpoint_dir / name).is_file()
    c = load_config(files)
    assert (c.hidden_size, c.num_layers, c.vocab_size, c.bos_token_id) == (576, 30, 49152, 1)


# Run in each process: count every GGUF conversion and block extraction in a shared file
# (one appended line each), then resolve the model twice.
_COUNTING_RESOLVE = """
import sys
import kvmesh.engine.gguf_blocks
import kvmesh.engine.loader
from pathlib import Path

log = Path(sys.argv[2])

def counted(module, name):
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        with log.open("a") as f:  # one short append: whole lines even from two processes
            f.write(name + "\\n")
        return real(*args, **kwargs)

    setattr(module, name, wrapper)

counted(kvmesh.engine.loader, "_convert_gguf")
counted(kvmesh.engine.gguf_blocks, "write_blocks")
first = kvmesh.engine.loader.resolve_model(sys.argv[1]).checkpoint_dir
assert kvmesh.engine.loader.resolve_model(sys.argv[1]).checkpoint_dir == first  # second call: cached
print(first)
"""


def test_concurrent_first_use_converts_once(tmp_path):
    # two processes start at once on an empty cache, one by name, one by the GGUF path: both
    # get the same folder, built once under the lock, with no temporary folder left behind
    cache, log = tmp_path / "cache", tmp_path / "calls.log"
    cache.mkdir()
    log.touch()
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache)}
    # stderr to files, not pipes: a full pipe would stall the process holding the lock
    errs = [tmp_path / f"stderr-{i}.log" for i in range(2)]
    procs = []
    for arg, err in zip((DEFAULT_MODEL, str(default_gguf_path())), errs):
        with err.open("w") as stderr:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _COUNTING_RESOLVE, arg, str(log)],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
            )
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.read_text()[-2000:] for err in errs]
    assert outs[0] == outs[1]
    # the converted model's folder (beside `numba`, where the block kernels are cached)
    folders = sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name != "numba")
    assert folders == [Path(outs[0]).name]
    assert (Path(outs[0]) / "model.safetensors").is_file()
    # four resolve_model calls in two processes: one conversion and one block extraction in all
    assert sorted(log.read_text().split()) == ["_convert_gguf", "write_blocks"]
