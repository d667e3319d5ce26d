"""Prefill first, where a prefill and a decode instance share one host's cores.

Disaggregated serving puts prefill and decode on separate devices. When both run on the same
CPU cores (`kvmesh up` on one machine), each process's OpenMP team spins on every core, and two
teams on the same cores stall at each other's barriers: 15 prompts of 14 tokens prefilled in
195 ms alone took 757 ms while decode ran one stream beside them (2 cores, Intel Xeon). Here a
prefill instance marks each forward it runs in a small shared file, and a decode instance waits
between its steps until that forward ends, so the two take turns instead of fighting: a prefill
batch runs at full speed, as SGLang's and vLLM's schedulers run a prefill batch before the next
decode step on one GPU.

The wait is bounded twice: decode waits through at most one forward (the one it found running;
when the next chunk of a chunked prefill starts, decode takes a step), and never longer than
`max_wait_s`, so a prefill that died, hangs (SIGSTOP) or runs one very long forward slows decode
only by that bound. The file holds one int64: the CLOCK_MONOTONIC nanoseconds at which the
current forward began, 0 when none runs (CLOCK_MONOTONIC is one clock for every process of a
host). Several prefill instances may share one file: the last to start a forward marks it and
the first to end one clears it, so decode may step beside the other's forward, as it would with
no sharing at all; it never waits longer than the bounds above.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Iterator

_FORMAT = "q"  # int64, native order: written and read on one host
_SIZE = struct.calcsize(_FORMAT)
POLL_S = 0.0005
"""How often a waiting decode looks at the file, in seconds: its step starts at most this late."""


class CpuShare:
    """The shared file at `path` (created, and sized to 8 bytes, when missing).

    Raises OSError when the file cannot be opened or mapped.
    """

    def __init__(self, path: str, max_wait_s: float = 2.0) -> None:
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.path = path
        self.max_wait_s = max_wait_s
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def _read(self) -> int:
        return struct.unpack_from(_FORMAT, self._map)[0]

    def _write(self, value: int) -> None:
        struct.pack_into(_FORMAT, self._map, 0, value)

    @contextlib.contextmanager
    def prefill_forward(self) -> Iterator[None]:
        """Mark the file while the block runs (prefill: around each forward)."""
        self._write(time.monotonic_ns())
        try:
            yield
        finally:
            self._write(0)

    def wait_for_prefill(self) -> float:
        """Block while the forward marked now runs (decode: before each step); returns the seconds
        waited. Returns at once when none is marked; never waits past the end of the marked
        forward, nor `max_wait_s` after it began."""
        began = self._read()
        if not began:
            return 0.0
        start = time.monotonic()
        deadline_ns = began + int(self.max_wait_s * 1e9)
        while self._read() == began and time.monotonic_ns() < deadline_ns:
            time.sleep(POLL_S)
        return time.monotonic() - start

    def close(self) -> None:
        self._map.close()


def open_cpu_share(path: str, max_wait_s: float) -> CpuShare | None:
    """The CpuShare at `path`, or None for "" (no sharing: the instance has cores of its own)."""
    return CpuShare(path, max_wait_s) if path else None
