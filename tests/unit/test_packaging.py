"""kvmesh installs like a library: one top-level name, and no collision with Hugging Face's `kernels`.

Every folder installs as a sub-package of `kvmesh` (pyproject's package-dir: `gateway/` is
`kvmesh.gateway`, `protos/kvmesh` is `kvmesh.protos`), so the wheel puts `kvmesh` alone into a
user's site-packages. Before, it added nine generic names, and one collided: transformers 5.25
requires Hugging Face's `kernels` distribution, whose top-level name was this repo's `kernels/`.
`make install-check` goes further: it installs the built wheel into a fresh venv outside the
checkout and serves a chat request from there (scripts/install_check.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def packages_on_disk() -> set[str]:
    """Every package the mapped folders hold (a folder with an __init__.py), by import name."""
    found = set()
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    return found


def test_pyproject_lists_every_package_and_only_those():
    # a sub-package added to a folder but not to [tool.setuptools] packages would be left out of
    # the wheel (and an editable install would still import it: only the wheel would break)
    assert set(SETUPTOOLS["packages"]) == packages_on_disk()
    assert all(name == "kvmesh" or name.startswith("kvmesh.") for name in SETUPTOOLS["packages"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # from a copy of the files git would track: setuptools builds in the source's build/, whose leftovers
    # (a module since deleted) would land in the wheel, and the checkout stays as it was
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for rel in filter(None, listed.decode().split("\0")):
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    # no build isolation: the test venv has setuptools (the test extra), and nothing is fetched
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path,) = out.glob("kvmesh-*.whl")
    return path


def test_the_wheel_adds_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"kvmesh"}, f"the wheel adds other top-level names: {sorted(tops - {'kvmesh'})}"
    # every package is in it, and the data the services read: the protos and their stubs
    packages = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == set(SETUPTOOLS["packages"])
    for stem in ("common", "decode", "gateway", "prefill"):
        for suffix in (".proto", "_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"kvmesh/protos/v1/{stem}{suffix}" in names
    assert "kvmesh/engine/llama/step.py" in names and "kvmesh/kernels/quant.py" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvmesh = kvmesh.cli:main" in entry_points
    assert "make-tiny-model = kvmesh.bench.cli:MAKE_TINY_MODEL" in entry_points


def test_the_generated_stubs_import_each_other_inside_the_namespace():
    for path in (ROOT / "protos" / "kvmesh" / "v1").glob("*_pb2*.py*"):
        for line in path.read_text().splitlines():
            if line.startswith(("from ", "import ")) and "_pb2" in line:
                assert line.startswith("from kvmesh.protos.v1 import "), f"{path.name}: {line}"


def test_hugging_face_kernels_and_ours_load_in_one_process_and_a_model_runs(tmp_path):
    # transformers (>= 5.25) imports Hugging Face's `kernels` whenever it is installed (the test
    # extra installs it); kvmesh's kernels are `kvmesh.kernels`. Run from outside the checkout,
    # in a fresh process: HF's first, then transformers' use of it, then a model forward through
    # kvmesh's runner (its kernels), checked against transformers on the same tiny Llama
    code = textwrap.dedent(
        """
        import importlib.metadata, sys
        import kernels as hf_kernels
        import torch
        import transformers
        from transformers.integrations import hub_kernels
        from transformers.utils import is_kernels_available

        import kvmesh.kernels
        import kvmesh.kernels.ops
        from kvmesh.engine.forward import ForwardItem
        from kvmesh.engine.loader import resolve_model
        from kvmesh.engine.runners import create_runner

        assert is_kernels_available(), "transformers does not see Hugging Face's kernels"
        assert hasattr(hf_kernels, "get_kernel"), hf_kernels.__file__
        assert "site-packages" in hf_kernels.__file__, hf_kernels.__file__
        assert sys.modules["kernels"] is hf_kernels and kvmesh.kernels is not hf_kernels
        assert hub_kernels is sys.modules["transformers.integrations.hub_kernels"]

        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        )
        hf = transformers.LlamaForCausalLM(cfg).eval()
        hf.save_pretrained(sys.argv[1])
        runner = create_runner(resolve_model(sys.argv[1]), num_pages=4, page_size=16)
        ids = [1, 5, 9, 13, 17, 21]
        logits = runner.forward([ForwardItem(ids, 0, [1])])
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits[0], ref, atol=1e-5, rtol=1e-5)
        print(importlib.metadata.version("kernels"), transformers.__version__, kvmesh.kernels.__file__)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "tiny-llama")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    hf_version, transformers_version, ours = out.stdout.split()
    assert Path(ours).resolve() == ROOT / "kernels" / "__init__.py"
    assert tuple(int(x) for x in transformers_version.split(".")[:2]) >= (5, 25), transformers_version
