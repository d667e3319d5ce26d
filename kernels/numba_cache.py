"""Where numba keeps the compiled block kernels: one cache per machine, shared by every clone,
venv and path of kvmesh, keyed by the kernels' source, as the GGUF conversion's cache is.

numba's own `cache=True` writes beside the source (`kernels/__pycache__`), so every fresh clone
compiled the decode kernels again on its first `kvmesh up` (56-58 s of the 71 s a fresh clone
took to be ready on a 2-core machine, issue 29). `SharedSourceLocator` puts the cache of every
file in NUMBA_SOURCES in `$KVMESH_CACHE_DIR/numba/<sha256 of all their texts>` (default
`~/.cache/kvmesh`): the same sources find the same compiled code wherever they live, and an
edit to any of them starts a folder of its own. Keyed by all of them, not by each file: a
kernel in one file inlines kernels of the others, whose change numba would not see; the files
whose constants and LLVM intrinsics the kernels compile in (NUMBA_INLINED) count too. numba still
checks, per entry, its file's content hash and the CPU it was compiled for (its index), so a
foreign entry is recompiled, never used. Import this module before any `numba.njit(cache=True)`
of kvmesh runs (the files in NUMBA_SOURCES do); a folder that cannot be written falls back to
numba's locators. `NUMBA_CACHE_DIR`, when set, still wins (numba's own rule).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import caching

from kvmesh import cache_root  # importable from here too

_KVMESH_ROOT = Path(__file__).resolve().parent.parent
NUMBA_SOURCES = (
    "kernels/quant.py",
    "kernels/quant_tiles.py",
    "kernels/quant_a8.py",
    "engine/llama/step.py",
    "engine/llama/step_attention.py",
)
"""kvmesh's files with `numba.njit(cache=True)` kernels (tests/unit checks the list is whole)."""
NUMBA_INLINED = ("kernels/quant_format.py", "kernels/quant_llvm.py", "kernels/quant_a8_ir.py")
"""Files without cached kernels whose constants and intrinsics those kernels compile in: part of
the digest too, as numba's index would not see an edit to them."""


def sources_digest() -> str:
    """sha256 (16 hex digits) of NUMBA_SOURCES' and NUMBA_INLINED's texts, in order: the cache
    folder's name."""
    h = hashlib.sha256()
    for rel in (*NUMBA_SOURCES, *NUMBA_INLINED):
        h.update((_KVMESH_ROOT / rel).read_bytes())
    return h.hexdigest()[:16]


class SharedSourceLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """A numba cache locator for kvmesh's kernels: the cache folder is named by the sha256 of
    NUMBA_SOURCES' texts, under cache_root()/numba, not by where the files are."""

    def __init__(self, py_func, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(cache_root() / "numba" / f"kernels-{sources_digest()}")

    def get_cache_path(self) -> str:
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file: str):
        """A locator for a function of NUMBA_SOURCES (None for others, or when NUMBA_CACHE_DIR
        is set or the folder cannot be written: numba's next locator takes over)."""
        if os.environ.get("NUMBA_CACHE_DIR"):
            return None
        try:
            if str(Path(py_file).resolve().relative_to(_KVMESH_ROOT)) not in NUMBA_SOURCES:
                return None
        except (OSError, ValueError):
            return None
        return super().from_function(py_func, py_file)


_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # its name in numba 0.68; _CacheImpl earlier
if SharedSourceLocator not in _IMPL._locator_classes:
    _IMPL._locator_classes.insert(0, SharedSourceLocator)
