"""`kvmesh make-tiny-model`: writes a checkpoint transformers and kvmesh both load; rejects unknown archs."""

import json
import subprocess
import sys

from kvmesh.engine.loader import load_config, resolve_model


def test_make_tiny_model_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "make-tiny-model", "--arch", "deepseek_v4", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4"
    assert set(cfg["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(cfg["mlp_layer_types"]) == {"hash_moe", "moe"}
    mc = load_config(resolve_model(str(out)))
    assert mc.vocab_size == 49152 and mc.eos_token_ids == (2,)
    assert (out / "tokenizer.json").is_file()
    # the multi-token-prediction module rides along, named as DeepSeek's checkpoints name it
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        mtp = {k for k in f.keys() if k.startswith("mtp.")}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight"} <= mtp
    assert {"mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w1.weight"} <= mtp


def test_unknown_arch_is_refused(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "make-tiny-model", "--arch", "mixtral", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "invalid choice" in run.stderr
