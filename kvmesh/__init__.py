"""kvmesh: a gRPC mesh serving LLMs with disaggregated prefill and decode.

The namespace root: every layer imports it (it is the parent of every `kvmesh.<package>`), so
it imports no other kvmesh module and nothing heavier than the standard library
(tests/unit/test_import_layers.py checks both). It holds what every layer shares: the version
and the machine's cache folder.
"""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_root() -> Path:
    """kvmesh's cache folder on this machine, shared by every clone and venv:
    $KVMESH_CACHE_DIR or ~/.cache/kvmesh. It holds converted GGUF checkpoints
    (kvmesh.engine.loader) and compiled numba kernels (kvmesh.kernels.numba_cache)."""
    return Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")
