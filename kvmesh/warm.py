"""`kvmesh warm`: do the one-time work of a model before any service needs it, so that the first
`kvmesh up` starts in seconds: convert its GGUF file into the safetensors cache (kvmesh.engine.loader)
and compile its decode block kernels into numba's shared cache (kernels/numba_cache.py), both
under $KVMESH_CACHE_DIR (~/.cache/kvmesh), where every clone, venv and service finds them.

`make install` runs it for the default model; the tests run it before they start services.
"""

from __future__ import annotations

import time


def warm(model: str | None = None) -> float:
    """Convert `model` (None: the default SmolLM2) if it is not cached yet, build its CPU runner
    in fp32 and in what `--dtype auto` picks here (when that is another), and run one warm-up
    step of each (and of fp32 with `--quantization int8`), which compiles every block kernel a
    decode step uses (numba compiles them once a page dtype). Returns the seconds it took (a second or two when everything was cached
    already). Raises ValueError for an unknown model."""
    import torch

    from kvmesh.engine.loader import resolve_model
    from kvmesh.engine.runners import create_runner, runner_precision

    started = time.perf_counter()
    files = resolve_model(model)
    auto = runner_precision(files, torch.device("cpu"), "auto").name
    for dtype in dict.fromkeys(("float32", auto)):
        runner = create_runner(files, num_pages=2, page_size=16, num_state_slots=1, dtype=dtype)
        runner.warmup()
        if dtype == "float32" and hasattr(runner, "use_int8_activations"):
            try:  # and --quantization int8's kernels, where this model has the blocks for them
                runner.use_int8_activations()
            except ValueError:
                continue
            runner.warmup()
    return time.perf_counter() - started
