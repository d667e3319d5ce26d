"""Fixtures the unit tests share."""

import os

import pytest
import triton

DEVICE = os.environ.get("KVMESH_TEST_DEVICE", "cpu")
"""Where the kernel tests run: "cpu" (Triton through its interpreter) or "cuda" (`python -m kvmesh.bench.kernels_gpu`)."""


@pytest.fixture
def triton_device():
    """Where the Triton kernels run: the interpreter on CPU unless KVMESH_TEST_DEVICE says cuda.

    The kernels are jitted at first launch, so switching the interpreter on here works even
    though triton was imported earlier, and it does not leak into other test modules.
    """
    if DEVICE == "cpu":
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            assert triton.knobs.runtime.interpret
            yield DEVICE
    else:
        yield DEVICE
