"""What both ends of the UCX KV push share: the wire constants, the process-wide ucxx
runtime and buffer helpers (errors and results are the transport-neutral ones of
kvstore/transport.py) (the protocol is described in
kvstore/ucx_transfer.py).

UCX runtime: ucxx keeps one process-wide context. kvstore initializes it on first use
in "thread" progress mode with Python futures (a notifier thread completes asyncio
futures). The default mode busy-polls the event loop while a receive is pending, which
costs about a core per idle process. The context is bound to the event loop that
first used it; it is reset when the last KVSender/KVReceiver closes, so close them (but
in a service, which leaves with os._exit: `keep_until_exit()`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ucxx
from ucxx._lib.arr import Array
from ucxx.exceptions import UCXCloseError, UCXError

# Shared memory transports (sysv, posix) serve endpoints with error handling only when this is
# set; every kvmesh endpoint has error handling (a dead peer must fail a push, not crash).
# Read by UCX when the context is created, so set before the first ucxx.init.
os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")
# a KV listener restarted on its fixed --kv-port (a rolling restart) binds while the last
# process's connections linger in TIME_WAIT (60 s); without SO_REUSEADDR it fails "Device is busy"
os.environ.setdefault("UCX_CM_REUSEADDR", "y")

logger = logging.getLogger(__name__)

MAGIC = 0x4B564D4553485055  # "KVMESHPU"
VERSION = 3
MAX_BUFFERS = 1 << 20  # pages per push: a page's index fits the low 20 bits of its data tag
_TAG_HEADER = 1 << 60
_TAG_SIZES = _TAG_HEADER + 1
_TAG_ACK = _TAG_HEADER + 2
_TAG_HELLO = _TAG_HEADER + 3
_TAG_GO = _TAG_HEADER + 4
_TAG_SOURCE = _TAG_HEADER + 5
_DATA_TAG_BIT = 1 << 63
"""Page data travels on a second endpoint made from the receiver's worker address, with raw
tags `_DATA_TAG_BIT | push number << 20 | page index`; the receiver numbers its pushes, so a
late page of an old push can never match a newer push's receives."""
ACK_OK, ACK_UNKNOWN, ACK_SIZE_MISMATCH, ACK_PROTOCOL = 0, 1, 2, 3
GO_PULLED = 4
"""GO's code when the receiver copied the pages from the sender's shared pool itself: send no data."""
_ACK_MEANING = {
    ACK_UNKNOWN: "unknown or cancelled transfer id",
    ACK_SIZE_MISMATCH: "page size mismatch, or a part pushed out of order",
    ACK_PROTOCOL: "protocol mismatch",
}


class _UcxRuntime:
    """Reference-counted ownership of ucxx's process-wide context (see the module docstring)."""

    def __init__(self) -> None:
        self._users = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owned = False
        self._atexit_registered = False
        self.keep_until_exit = False
        """True in a process that leaves with os._exit (every kvmesh service): the context is never
        reset (`keep_until_exit()`)."""

    def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        kept = self._users == 0 and self._owned  # released by all, kept for the exit
        if (self._users or kept) and loop is not self._loop:
            raise RuntimeError(
                "kvstore's UCX transport is already bound to another event loop; "
                "use one event loop per process (or close every KVSender/KVReceiver first)"
            )
        if self._users == 0 and not kept:
            try:
                ucxx.init(progress_mode="thread", enable_python_future=True)
                self._owned = True
            except RuntimeError:  # someone else initialized ucxx: use it as it is
                self._owned = False
            self._loop = loop
            if self._owned:
                _slow_down_progress_thread(loop)
            if not self._atexit_registered:
                # ucxx's notifier thread is not a daemon: stop it before interpreter exit
                # joins threads, or a process that never closed us hangs on exit.
                register = getattr(threading, "_register_atexit", None)
                if register is not None:
                    register(ucxx.stop_notifier_thread)
                self._atexit_registered = True
        self._users += 1

    def release(self) -> None:
        assert self._users > 0, "UCX runtime released more often than acquired"
        self._users -= 1
        if self._users or not self._owned or self.keep_until_exit:
            return
        self._owned, self._loop = False, None
        try:
            # wake ucxx's notifier thread now: it waits on the worker with a 1 s timeout, and
            # reset() joins it, so every close took ~1 s (0.01 s with this). The context is
            # module-private in ucxx: without it (another ucxx version) the close just waits
            _wake_notifier()
            ucxx.reset()  # stops the notifier and progress threads; raises when the context lives on
        except UCXError as exc:  # an object still references the context; it lingers
            logger.warning("UCX context not fully released: %s", exc)


class _HandshakeTimeouts(logging.Filter):
    """ucxx's listener logs a connection whose handshake (its peer-info exchange) timed out as an
    ERROR with a traceback ("Unexpected error in listener handler coroutine"): a sender that froze
    or died while connecting, which the sender's own bounds already handle. One WARNING line
    instead; every other error of ucxx's keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) != 2 or not str(args[0]).startswith("Unexpected error in listener handler"):
            return True
        raised = str(args[1]).rstrip().rsplit("\n", 1)[-1]  # the traceback's last line: the exception
        if raised.startswith("TimeoutError"):
            record.msg, record.args = "a KV connection's handshake timed out (its sender is slow, frozen or gone)", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("ucx").addFilter(_HandshakeTimeouts())


def _wake_notifier() -> None:
    """Wake ucxx's request notifier thread (see release()). A function of its own: reset() checks
    that nothing references the context any more, and a local of the caller's would (a running
    frame's locals are invisible to gc.get_referrers, so ucxx named no referrer: "UCX context not
    fully released" after every clean close)."""
    ctx = getattr(getattr(ucxx, "core", None), "_ctx", None)
    wake = getattr(getattr(ctx, "worker", None), "stop_request_notifier_thread", None)
    if wake is not None:
        wake()


_runtime = _UcxRuntime()


def keep_until_exit() -> None:
    """Never reset ucxx's context in this process, even when its last KVSender / KVReceiver
    closes: for a process that leaves with os._exit, where the teardown buys nothing.

    Closing still aborts every endpoint and the listener. ucxx.reset() drops the context and
    collects garbage while UCX's own threads run: decodes died in it with SIGSEGV at shutdown in
    multihost rolling restarts (2026-12-03/04; faulthandler caught the event-loop thread in
    ucxx/core.py reset's gc.collect() and a thread with no Python frame crashing)."""
    _runtime.keep_until_exit = True


# ucxx's progress thread waits on the worker's epoll fd with a 1 ms timeout, so it wakes
# ~1000 times a second even when idle. Each wake-up preempts a model thread: on a small
# machine the decode step's OpenMP regions then stall at their barriers (measured on 2
# cores, default model: single-stream decode ITL 30.7 ms with 1 ms, 28.1 ms with 100 ms).
# UCX events (and ucxx's delayed submissions, which signal the worker) wake the epoll
# wait at once, so the timeout only bounds how long a missed event can go unnoticed.
EPOLL_TIMEOUT_MS = int(os.environ.get("KVMESH_UCX_EPOLL_TIMEOUT_MS", "100"))


def _slow_down_progress_thread(loop: asyncio.AbstractEventLoop) -> None:
    """Start ucxx's progress for `loop`, then restart its thread with EPOLL_TIMEOUT_MS."""
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress(loop)
    ctx.worker.stop_progress_thread()
    ctx.worker.start_progress_thread(polling_mode=False, epoll_timeout=EPOLL_TIMEOUT_MS)


ABORT_PERIOD_NS = 20 * 10**9
"""How long one attempt of an endpoint's abort waits for ucxx's progress thread (ns)."""
ABORT_ATTEMPTS = 3
ABORT_SLOW_S = 1.0


def abort_endpoint(ep: Any) -> None:
    """Abort ucxx endpoint `ep` now: its posted requests are cancelled and its UCP endpoint is
    closed, on the progress thread, while this thread waits (idempotent).

    ucxx waits for each step with a timeout, 10 s and one attempt by default; a step that times
    out is dropped, and a close dropped so leaves the UCP endpoint open (its TCP connections
    live on; its error handler holds only a weak reference to the ucxx endpoint, ucxx
    cpp/src/endpoint.cpp, so that is a leak, not a dangling pointer). A process frozen (SIGSTOP)
    in that wait for most of 10 s meets that timeout on waking. So: 3 attempts of 20 s (ucxx
    submits the close again only when the last one was dropped).

    It blocks the calling thread (the event loop's) until the progress thread has done it: one
    that took over ABORT_SLOW_S is logged, with how long."""
    started = time.monotonic()
    ep.abort(period=ABORT_PERIOD_NS, max_attempts=ABORT_ATTEMPTS)
    took = time.monotonic() - started
    if took > ABORT_SLOW_S:
        logger.warning("aborting a UCX endpoint held this thread %.1f s (its peer is frozen or gone?)", took)


def check_open(ep: Any) -> None:
    """Raise UCXCloseError when `ep` is closed: aborted (a cancel cuts a landing push off by
    aborting its endpoint, ucx_table.TransferFuture.cancel, even when its last page has just
    landed) or failed (its peer died, reset or closed it). Call it before each send or receive:
    ucxx's on an aborted endpoint raise AttributeError, not a UCX error, and its receive on a
    failed one probes the worker for the message from this thread (`Worker::tagProbe`), beside
    the progress thread's own progress; kvmesh's protocol never needs a message from a closed
    endpoint."""
    if ep.closed:
        raise UCXCloseError("the endpoint is closed (aborted, or its peer went away)")


def _as_buffer(buf: Any, index: int, writable: bool) -> Array:
    """ucxx Array over a page buffer, zero-copy; numpy arrays or any C-contiguous buffer
    (buffer protocol or __cuda_array_interface__)."""
    arr = buf if isinstance(buf, Array) else Array(buf)
    if not arr.c_contiguous:
        raise ValueError(f"buffer {index} must be C-contiguous: pages move zero-copy, got strides {arr.strides}")
    if writable and getattr(arr, "readonly", False):
        raise ValueError(f"buffer {index} is read-only; decode must register writable page views")
    return arr


def _check_transfer_id(transfer_id: int) -> int:
    if not isinstance(transfer_id, (int, np.integer)) or not 0 <= int(transfer_id) < 1 << 64:
        raise ValueError(f"transfer_id must be an int in [0, 2**64), got {transfer_id!r}")
    return int(transfer_id)


_REFILL_EVERY = 32  # ucxx keeps 100 request futures ready and refills below 50


def _post_all(ep, op, buffers: Sequence[Array], tag_base: int) -> list:
    """Coroutines posting one send/recv per page with the raw tag `tag_base | page index`.

    gather() starts them all in one loop iteration, so every request is posted before
    any completes. Each request takes a future from ucxx's pool, which the notifier
    thread refills only now and then; topping it up here keeps a push of thousands of
    pages from draining it (ucxx then warns once per request and refills inline).
    """
    worker = ep._ctx.worker
    refill = worker.enable_python_future

    async def post(i: int, buf: Array):
        if refill and i % _REFILL_EVERY == 0:
            worker.populate_python_futures_pool()  # releases the GIL; thread-safe
        return await op(buf, tag=tag_base | i, force_tag=True)

    return [post(i, buf) for i, buf in enumerate(buffers)]
