"""The one place Triton kernels are jitted, for the compiler or for its interpreter.

`triton.jit` decides between the interpreter (TRITON_INTERPRET=1, `triton.knobs.runtime.interpret`)
and the compiler when it is applied, so a kernel is jitted at its first launch in each mode,
and a process (a test run, say) can hold both.
"""

from __future__ import annotations

import functools

import triton


@functools.cache
def jit(fn, interpret: bool):
    """`triton.jit(fn)` applied once per (kernel, mode); `interpret` only keys the cache.
    Launch the result as `jit(kernel, interpret)[grid](...)`."""
    return triton.jit(fn)
