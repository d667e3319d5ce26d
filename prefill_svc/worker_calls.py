"""The short calls other threads make on a prefill engine's worker thread (a pull's page
allocation, a peer's hold on blocks it pushes, a release, the stats), run between two forwards
rather than after every batch already queued.

The worker thread owns the KV cache, so every call that reads or changes it runs there. Queued
behind the batches, a call waits for all of them: under load, a pull's allocation waited 5-24 s
on two shared cores (the batches queued ahead and their forwards), the peer's hold on the
blocks waited as long on its own worker, and the pull timed out and computed its prefix anyway,
at the back of the queue. Here a call waits at most for the forward computing now: the engine
runs the calls queued so far before each forward of a batch and before it takes a batch, as
vLLM's engine core handles its input queue between two steps. A call must not compute a batch
itself (the one computing holds the worker).
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable
from typing import Any

Call = tuple[concurrent.futures.Future, Callable[..., Any], tuple]


class WorkerCalls:
    """Calls queued for the worker thread, run in the order they came by `run` (on that thread)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Call] = queue.SimpleQueue()

    def put(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue fn(*args); the future resolves to its result (or raises what it raised)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def run(self) -> int:
        """On the worker thread: run every call queued now and those queued meanwhile. Returns
        how many ran."""
        ran = 0
        while True:
            try:
                future, fn, args = self._queue.get_nowait()
            except queue.Empty:
                return ran
            if not future.set_running_or_notify_cancel():
                continue
            ran += 1
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever awaits the future
                future.set_exception(exc)
