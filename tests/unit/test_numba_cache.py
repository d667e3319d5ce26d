"""kvmesh's numba kernels are cached once a machine, keyed by their sources (kernels/numba_cache.py)."""

from __future__ import annotations

import re
from pathlib import Path

from numba.core.registry import CPUDispatcher

from kvmesh.kernels import numba_cache, quant
from kvmesh.kernels.numba_cache import NUMBA_SOURCES, SharedSourceLocator, cache_root, sources_digest

ROOT = Path(numba_cache.__file__).resolve().parent.parent


def test_every_cached_kernel_file_is_in_the_digest():
    """A file whose kernels are cached but left out of NUMBA_SOURCES would be cached by path,
    and its edits would not start a new folder for the kernels that inline it."""
    cached = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "tests", "build") or rel.parts[0].startswith("."):
            continue
        if re.search(r"^@numba\.njit\([^)]*cache=True", path.read_text(errors="replace"), re.M):
            cached.add(str(rel))
    assert cached == set(NUMBA_SOURCES)


def test_kernels_go_to_the_shared_folder_named_by_their_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    fn = next(v.py_func for v in vars(quant).values() if isinstance(v, CPUDispatcher))  # a cached kernel
    locator = SharedSourceLocator.from_function(fn, quant.__file__)
    assert locator is not None
    assert Path(locator.get_cache_path()) == cache_root() / "numba" / f"kernels-{sources_digest()}"
    assert Path(locator.get_cache_path()).is_dir()  # made and writable
    # not kvmesh's kernels: numba's own locators decide
    assert SharedSourceLocator.from_function(test_every_cached_kernel_file_is_in_the_digest, __file__) is None
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba-own"))  # numba's own setting wins
    assert SharedSourceLocator.from_function(fn, quant.__file__) is None
