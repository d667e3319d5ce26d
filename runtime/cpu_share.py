"""Turns on shared cores, where a prefill and a decode instance run on one host's CPU cores.

Disaggregated serving puts prefill and decode on separate devices. When both run on the same
CPU cores (`kvmesh up` on one machine), each process's OpenMP team spins on every core, and two
teams on the same cores stall at each other's barriers: 15 prompts of 14 tokens prefilled in
195 ms alone took 757 ms while decode ran one stream beside them (2 cores, Intel Xeon), and a
decode step of a 10-row batch took 90 ms instead of ~20 beside prefill's forwards (2 cores, AMD
EPYC). Here the two take turns instead, one prefill forward (a chunk of the prompts) and one
decode step at a time, in the order they asked: a prefill that has a forward to run waits for
the decode step under way, then runs; a decode step waits for the forward under way and for a
forward that asked before it. With both busy they alternate, step, chunk, step, chunk: what an
aggregated engine with chunked prefill does on one device (vLLM's and SGLang's schedulers put a
prefill chunk beside each decode step), with the chunk's size (`--max-batch-tokens`, set by
`kvmesh up`) bounding what it adds to a token's latency.

Every wait is bounded: a side waits at most `max_wait_s` for its turn, so a peer that died,
hangs (SIGSTOP) or runs one very long forward slows the other only by that bound, and a mark
older than the bound is ignored (a peer killed with its mark set). The file holds five int64s,
the CLOCK_MONOTONIC nanoseconds (one clock for every process of a host) at which: prefill's
forward began, prefill began asking for one, decode's step began, decode began asking for one;
0 for none; and when decode's last step ended.

While decode has steps to run, a prefill forward is all that a decode token waits for beyond
its step. With `--cpu-share-forward-tokens`, prefill sizes its forwards by `decode_busy()`:
small while decode steps (a token's latency), large while it is idle (the prompt's TTFT).

Several instances of one side may share a file: the last to mark and the first to clear win,
so two of them may run beside each other, as with no sharing at all, and no wait grows past the
bounds above. Marks are plain stores to a shared page, not a lock: two sides that ask at the
same instant may both run; that costs speed, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Iterator

_FORMAT = "5q"  # int64s, native order: written and read on one host
_SIZE = struct.calcsize(_FORMAT)
_PREFILL_RUN, _PREFILL_ASK, _DECODE_RUN, _DECODE_ASK, _DECODE_DONE = range(5)
POLL_S = 0.0002
"""How often a waiting side looks at the file, in seconds: its turn starts at most this late."""
BUSY_WINDOW_S = 0.05
"""Decode counts as busy this long after its last step ended, in seconds: its loop spends ~1 ms
between steps (sampling's hand-off, admissions), and a step it is about to run shows as asking."""


class CpuShare:
    """The shared file at `path` (created, and sized to 40 bytes, when missing).

    max_wait_s: the most seconds a side waits for its turn (>= 0); marks older than this are stale.

    Raises ValueError for a negative max_wait_s, OSError when the file cannot be opened or mapped.
    """

    shared = True
    """Whether turns are taken with another process (NoCpuShare's is False)."""

    def __init__(self, path: str, max_wait_s: float = 2.0) -> None:
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.path = path
        self.max_wait_s = max_wait_s
        self._max_wait_ns = int(max_wait_s * 1e9)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def _read(self, slot: int) -> int:
        return struct.unpack_from("q", self._map, 8 * slot)[0]

    def _write(self, slot: int, value: int) -> None:
        struct.pack_into("q", self._map, 8 * slot, value)

    def _live(self, mark: int, now_ns: int) -> bool:
        """A mark that is set and younger than the bound."""
        return mark != 0 and now_ns - mark < self._max_wait_ns

    def _take_turn(self, ask: int, run: int, other_run: int, other_ask: int, other_first_on_tie: bool) -> float:
        """Ask, wait while the other side runs or asked first (bounded), then mark our run;
        seconds waited."""
        asked = time.monotonic_ns()
        self._write(ask, asked)
        start = time.monotonic()

        def held_back(now_ns: int) -> bool:
            other_asked = self._read(other_ask)
            ahead = other_asked < asked or (other_asked == asked and other_first_on_tie)
            return self._live(self._read(other_run), now_ns) or (self._live(other_asked, now_ns) and ahead)

        now = time.monotonic_ns()
        # never past max_wait_s in all, whatever marks come and go meanwhile
        while held_back(now) and now - asked < self._max_wait_ns:
            time.sleep(POLL_S)
            now = time.monotonic_ns()
        self._write(run, time.monotonic_ns())
        self._write(ask, 0)
        return time.monotonic() - start

    @contextlib.contextmanager
    def _turn(
        self, ask: int, run: int, other_run: int, other_ask: int, other_first_on_tie: bool, done: int | None = None
    ) -> Iterator[float]:
        waited = self._take_turn(ask, run, other_run, other_ask, other_first_on_tie)
        try:
            yield waited
        finally:
            if done is not None:
                self._write(done, time.monotonic_ns())
            self._write(run, 0)

    def prefill_forward(self) -> contextlib.AbstractContextManager[float]:
        """Around each prefill forward: waits for the decode step under way (or asked first),
        then marks the forward while the block runs; yields the seconds waited."""
        return self._turn(_PREFILL_ASK, _PREFILL_RUN, _DECODE_RUN, _DECODE_ASK, other_first_on_tie=True)

    def decode_step(self) -> contextlib.AbstractContextManager[float]:
        """Around each decode step: waits for the prefill forward under way (or asked first),
        then marks the step while the block runs, and when it ended; yields the seconds waited."""
        return self._turn(_DECODE_ASK, _DECODE_RUN, _PREFILL_RUN, _PREFILL_ASK, False, done=_DECODE_DONE)

    def decode_busy(self) -> bool:
        """Whether decode is stepping: a step under way or asked for (marks younger than the
        bound), or one that ended within BUSY_WINDOW_S."""
        now = time.monotonic_ns()
        if self._live(self._read(_DECODE_RUN), now) or self._live(self._read(_DECODE_ASK), now):
            return True
        return now - self._read(_DECODE_DONE) < BUSY_WINDOW_S * 1e9

    def close(self) -> None:
        self._map.close()


class NoCpuShare:
    """An instance with cores of its own: every turn starts at once (0.0 s waited), and no decode
    beside it is ever busy. Has CpuShare's interface, so callers need no `is None` branch."""

    path = ""
    shared = False

    def prefill_forward(self) -> contextlib.AbstractContextManager[float]:
        return contextlib.nullcontext(0.0)

    def decode_step(self) -> contextlib.AbstractContextManager[float]:
        return contextlib.nullcontext(0.0)

    def decode_busy(self) -> bool:
        return False

    def close(self) -> None:
        pass


def open_cpu_share(path: str, max_wait_s: float) -> CpuShare | NoCpuShare:
    """The CpuShare at `path`, or a NoCpuShare for "" (the instance has cores of its own)."""
    return CpuShare(path, max_wait_s) if path else NoCpuShare()
