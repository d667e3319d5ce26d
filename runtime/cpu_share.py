"""Turns on shared cores, where a prefill and a decode instance run on one host's CPU cores.

Disaggregated serving puts prefill and decode on separate devices. When both run on the same
CPU cores (`kvmesh up` on one machine), each process's OpenMP team spins on every core, and two
teams on the same cores stall at each other's barriers: 15 prompts of 14 tokens prefilled in
195 ms alone took 757 ms while decode ran one stream beside them (2 cores, Intel Xeon), and a
decode step of a 10-row batch took 90 ms instead of ~20 beside prefill's forwards (2 cores, AMD
EPYC). Here they take turns instead, one prefill forward (a chunk of the prompts) or one decode
step at a time: a prefill that has a forward to run waits for the decode step under way, then
runs; a decode step waits for the forward under way. With both busy they alternate, step, chunk,
step, chunk: what an aggregated engine with chunked prefill does on one device (vLLM's and
SGLang's schedulers put a prefill chunk beside each decode step), with the chunk's size
(`--max-batch-tokens`, set by `kvmesh up`) bounding what it adds to a token's latency.

Every wait is bounded: a side waits only while a live peer runs or asks before it, and a mark
older than `max_wait_s` is not live: a peer that died or hangs (SIGSTOP) with its mark set, or
runs one very long forward, holds the others back by that bound at most. A side that waits
re-stamps its ask mark every HEARTBEAT_S (a waiting process is alive), so a prompt that waits
long behind others keeps its place; no wait lasts past MAX_TURN_WAIT_S in all.

A waiting side sleeps: the side whose turn ends wakes every side that asks
(kvmesh.runtime.turn_wakes), and a waiter that no wake reaches looks again at its heartbeat. Each
poll of a waiting side would take a core from the running side's OpenMP team: polls every 0.2 ms
cost it 30% of its speed.

The file holds int64s: when decode's last step ended and when a prefill forward last began
(CLOCK_MONOTONIC nanoseconds, one clock for every process of a host), then one record per
instance: an owner token, its pid, its role (prefill or decode), when it was last seen asking
for a turn (the heartbeat), when its turn under way began, its place (below) and when its last
turn began; 0 for none. Marks are plain stores to a shared page, not a lock: two instances that
ask at the same instant may both run; that costs speed, never a wrong answer.

While decode has steps to run, a prefill forward is all that a decode token waits for beyond
its step. With `--cpu-share-forward-tokens`, prefill sizes its forwards by `decode_busy()`:
small while decode steps (a token's latency), large while it is idle (the prompt's TTFT).

Several instances may share a file (two prefills and two decodes of one `kvmesh up`): each
holds a record of its own in it (MAX_PARTIES of them; a dead process's record is taken over), and
one forward or one step runs at a time across all of them, in one order (`_place`): the decode
instances that have not stepped since the last forward began, by when they asked; then the
prefill forwards, by when the oldest request of each forward's batch reached its instance
(`prefill_forward(since_ns)`); then the decode instances that have stepped since. So each busy
decode steps once between two forwards (a stream waits for one forward a token, however many
prefills are busy), and the prompts of all the prefill instances on these cores are computed
first come first served, as one engine's waiting queue is (vLLM's and SGLang's schedulers take
waiting prefills in arrival order), not a forward of each instance in turn: a prompt waits for
the work routed to these cores before it, never for what is routed after it, which is what the
gateway's TTFT prediction counts (kvmesh.gateway.prefill_queues). Each side has one place in one
order, so no two ever wait for each other. Two forwards of two prefill instances side by side
would stall at each other's barriers as prefill and decode do. An instance that finds no free
record runs without turns and says so in its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator

from kvmesh.runtime.turn_wakes import TurnWakes

log = logging.getLogger(__name__)

MAX_PARTIES = 16
"""Records in a file: the instances that can take turns through it."""
_OWNER, _PID, _ROLE, _ASK, _RUN, _ORDER, _BEGAN = range(7)
_FIELDS = 7
_PREFILL, _DECODE = 1, 2
_DECODE_DONE, _FORWARD_BEGAN = 0, 1
"""The header's slots: when a decode step last ended; when a prefill forward last began."""
_HEADER = 2
_RECORDS = f"{MAX_PARTIES * _FIELDS}q"  # int64s, native order: written and read on one host
_SIZE = 8 * (_HEADER + MAX_PARTIES * _FIELDS)
POLL_S = 0.0002
"""How often a new instance tries the file's lock again while another claims a record (seconds)."""
HEARTBEAT_S = 0.02
"""How often a waiting side re-stamps its ask mark and looks at the file without being woken, in
seconds (at most a quarter of max_wait_s, so its mark stays live)."""
MAX_TURN_WAIT_S = 300.0
"""The most seconds a turn waits in all, whatever live marks hold it back (a bound on the queue of
work ahead of it that no peer's heartbeat can stretch)."""
BUSY_WINDOW_S = 0.05
"""Decode counts as busy this long after its last step ended, in seconds: its loop spends ~1 ms
between steps (sampling's hand-off, admissions), and a step it is about to run shows as asking."""


class CpuShare:
    """This instance's record in the shared file at `path` (created, and sized, when missing).

    max_wait_s: the most seconds a side waits for its turn (>= 0); marks older than this are stale.
    One CpuShare takes one turn at a time (one forward loop or one step loop).

    Raises ValueError for a negative max_wait_s, OSError when the file cannot be opened or mapped.
    """

    shared = True
    """Whether turns are taken with another process (NoCpuShare's is False)."""

    def __init__(self, path: str, max_wait_s: float = 2.0) -> None:
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.path = path
        self.group = f"{socket.gethostname()}:{os.path.realpath(path)}"
        """Which cores this instance shares: every instance whose group is this one takes turns
        with it (InstanceStats.core_group, what the gateway's TTFT prediction shares out)."""
        self.max_wait_s = max_wait_s
        self._max_wait_ns = int(max_wait_s * 1e9)
        self._owner = secrets.randbits(62) + 1
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            stat = os.fstat(fd)
            if stat.st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
            self.record = self._claim(fd)
        finally:
            os.close(fd)
        self._wakes = TurnWakes(path, f"{stat.st_dev}-{stat.st_ino}", self.record, min(HEARTBEAT_S, max_wait_s / 4))
        if self.record is None:
            log.warning(
                "cpu share %s: all %d records held by live instances; this one runs without turns", path, MAX_PARTIES
            )

    def _claim(self, fd: int) -> int | None:
        """Take the first record that is free or whose process is gone, under the file's lock
        (waited for max_wait_s at most, then taken without it); its index, or None if none is."""
        deadline = time.monotonic() + self.max_wait_s
        locked = False
        while not locked:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
        try:
            for record, fields in enumerate(self._records()):
                if fields[_OWNER] == 0 or not _alive(fields[_PID]):
                    base = _HEADER + record * _FIELDS
                    for field, value in ((_OWNER, self._owner), (_PID, os.getpid()), (_ROLE, 0), (_ASK, 0), (_RUN, 0)):
                        self._write(base + field, value)
                    self._write(base + _ORDER, 0)
                    self._write(base + _BEGAN, 0)
                    return record
            return None
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def wake(self) -> None:
        """Wake this instance's own wait for its turn, so that it calls `while_waiting` now (the
        prefill engine's worker calls, queued from other threads)."""
        self._wakes.wake_self()

    def _wake_asking(self) -> None:
        """Wake every other side whose ask mark is live (after this one's turn ended)."""
        now = time.monotonic_ns()
        for record, _, ask, _ in self._others():
            if self._live(ask, now):
                self._wakes.send(record)

    def _read(self, slot: int) -> int:
        return struct.unpack_from("q", self._map, 8 * slot)[0]

    def _write(self, slot: int, value: int) -> None:
        struct.pack_into("q", self._map, 8 * slot, value)

    def _set(self, field: int, value: int) -> None:
        """One field of this instance's record."""
        if self.record is not None:
            self._write(_HEADER + self.record * _FIELDS + field, value)

    def _mark(self, field: int) -> int:
        """One field of this instance's record (0 without one): `asking()` and `running()`."""
        return self._read(_HEADER + self.record * _FIELDS + field) if self.record is not None else 0

    def asking(self) -> bool:
        """Whether this instance is waiting for its turn."""
        return self._mark(_ASK) != 0

    def running(self) -> bool:
        """Whether this instance's turn is under way."""
        return self._mark(_RUN) != 0

    def _records(self) -> list[tuple[int, ...]]:
        """Every record's fields (owner, pid, role, ask, run, order, began), read at once."""
        flat = struct.unpack_from(_RECORDS, self._map, 8 * _HEADER)
        return [flat[base : base + _FIELDS] for base in range(0, len(flat), _FIELDS)]

    def _others(self) -> Iterator[tuple[int, int, int, int]]:
        """(record, role, ask, run) of every other held record."""
        for record, fields in enumerate(self._records()):
            if record != self.record and fields[_OWNER] != 0:
                yield record, fields[_ROLE], fields[_ASK], fields[_RUN]

    def _live(self, mark: int, now_ns: int) -> bool:
        """A mark that is set and younger than the bound."""
        return mark != 0 and now_ns - mark < self._max_wait_ns

    def _take_turn(
        self, role: int, order_ns: int | None = None, while_waiting: Callable[[], object] | None = None
    ) -> float:
        """Ask, wait while a live peer runs or comes before us (`_place`; `order_ns`: our place
        among the prefill forwards, else when we asked), asleep until a peer's turn ends or a
        heartbeat passes, re-stamping our ask mark and calling `while_waiting` each time we wake,
        then mark our run; seconds waited."""
        if self.record is None:
            return 0.0
        asked = time.monotonic_ns()
        self._set(_ROLE, role)
        self._set(_ORDER, asked if order_ns is None else min(order_ns, asked))
        self._set(_ASK, asked)
        self._wakes.drop()  # a turn that ends from here on sees our mark and wakes us
        start = time.monotonic()
        bound_ns = int(MAX_TURN_WAIT_S * 1e9)
        now = asked
        while now - asked < bound_ns and self._held_back(now):
            if while_waiting is not None:
                while_waiting()
            self._wakes.sleep()
            now = time.monotonic_ns()
            self._set(_ASK, now)  # the heartbeat: still waiting, still alive
        began = time.monotonic_ns()
        self._set(_RUN, began)
        self._set(_BEGAN, began)
        if role == _PREFILL:
            self._write(_FORWARD_BEGAN, began)
        self._set(_ASK, 0)
        return time.monotonic() - start

    def _held_back(self, now_ns: int) -> bool:
        """Whether a live peer runs, or asks and comes before this instance (`_place`)."""
        forward_began = self._read(_FORWARD_BEGAN)
        records = self._records()
        assert self.record is not None
        mine = records[self.record]
        place = _place(mine[_ROLE], mine[_ORDER], mine[_BEGAN], forward_began, self.record)
        for record, fields in enumerate(records):
            if record == self.record or fields[_OWNER] == 0:
                continue
            if self._live(fields[_RUN], now_ns):
                return True
            if self._live(fields[_ASK], now_ns) and (
                _place(fields[_ROLE], fields[_ORDER], fields[_BEGAN], forward_began, record) < place
            ):
                return True
        return False

    @contextlib.contextmanager
    def _turn(
        self, role: int, order_ns: int | None = None, while_waiting: Callable[[], object] | None = None
    ) -> Iterator[float]:
        waited = self._take_turn(role, order_ns, while_waiting)
        try:
            yield waited
        finally:
            if role == _DECODE:
                self._write(_DECODE_DONE, time.monotonic_ns())
            self._set(_RUN, 0)
            self._wake_asking()  # after the mark is cleared: a woken side finds it so

    def prefill_forward(
        self, since_ns: int | None = None, while_waiting: Callable[[], object] | None = None
    ) -> contextlib.AbstractContextManager[float]:
        """Around each prefill forward: waits for the forward or step under way and those before
        it in the order, then marks the forward while the block runs; yields the seconds waited.
        since_ns: when the oldest request of the forward's batch reached this instance
        (time.monotonic_ns()), its place among the prefill instances' forwards; None: now.
        while_waiting: called each time it wakes while it waits (the engine's worker calls, which must
        not wait for the forwards of the prompts ahead; `wake` runs it at once)."""
        return self._turn(_PREFILL, since_ns, while_waiting)

    def decode_step(self) -> contextlib.AbstractContextManager[float]:
        """Around each decode step: waits for the forward or step under way and those before it
        in the order, then marks the step while the block runs, and when it ended; yields the
        seconds waited."""
        return self._turn(_DECODE)

    def decode_busy(self) -> bool:
        """Whether a decode instance on the file is stepping: a step under way or asked for
        (marks younger than the bound), or one that ended within BUSY_WINDOW_S."""
        now = time.monotonic_ns()
        for _, role, ask, run in self._others():
            if role == _DECODE and (self._live(run, now) or self._live(ask, now)):
                return True
        return now - self._read(_DECODE_DONE) < BUSY_WINDOW_S * 1e9

    def close(self) -> None:
        """Gives the record back (if it is still this instance's) and unmaps the file."""
        if self.record is not None and self._mark(_OWNER) == self._owner:
            self._set(_OWNER, 0)
        self._wakes.close()
        self._map.close()


def _place(role: int, order: int, began: int, forward_began: int, record: int) -> tuple[int, int, int]:
    """Where a side that asks stands in the order of turns (lowest first): decode instances that
    have not stepped since the last forward began (by when they asked), then prefill forwards (by
    their oldest request), then decode instances that have (by when they asked). One key a side,
    read from one snapshot, so no two sides ever wait for each other: between two forwards each
    decode that asks steps once."""
    if role == _PREFILL:
        return (1, order, record)
    return (0 if began < forward_began else 2, order, record)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (0: a record never held)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NoCpuShare:
    """An instance with cores of its own: every turn starts at once (0.0 s waited), and no decode
    beside it is ever busy. Has CpuShare's interface, so callers need no `is None` branch."""

    path = ""
    group = ""
    shared = False

    def prefill_forward(
        self, since_ns: int | None = None, while_waiting: Callable[[], object] | None = None
    ) -> contextlib.AbstractContextManager[float]:
        return contextlib.nullcontext(0.0)

    def decode_step(self) -> contextlib.AbstractContextManager[float]:
        return contextlib.nullcontext(0.0)

    def decode_busy(self) -> bool:
        return False

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_cpu_share(path: str, max_wait_s: float) -> CpuShare | NoCpuShare:
    """The CpuShare at `path`, or a NoCpuShare for "" (the instance has cores of its own)."""
    return CpuShare(path, max_wait_s) if path else NoCpuShare()
