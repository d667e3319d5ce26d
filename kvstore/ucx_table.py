"""Decode's table of expected KV transfers (the UCX receiver's, kvstore/ucx_receiver.py): one
entry per transfer owns its pages, whether a push is landing into them now, and its future.

Every step of a push guards one invariant, and it is read and kept here: no byte lands in a
page after the page was handed back. A transfer's future is done only when no receive is posted
into its pages and no copy writes them (`TransferFuture.cancel` cuts a landing push off and waits
for UCX to let go; `finish` resolves the future once landing stopped), and a push for a transfer
that is done, refused or unknown is NACKed without touching a page.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ucxx._lib.arr import Array

from kvmesh.kvstore.transport import TransferResult
from kvmesh.kvstore.ucx_common import _as_buffer, _check_transfer_id, abort_endpoint

logger = logging.getLogger(__name__)


class TransferFuture(asyncio.Future):
    """The future `KVReceiver.expect` returns; cancel() never lets pages be freed early.

    While no push lands (before the first part, or between parts), cancel() cancels at
    once. While pages are landing it returns False and the future is cancelled once UCX
    has let go of the pages (every receive completed or cut off), so code that awaits it
    (asyncio.wait_for, task.cancel) never resumes while UCX still writes.
    """

    def __init__(self, entry: ExpectedTransfer, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._entry = entry

    def cancel(self, msg: Any = None) -> bool:
        entry = self._entry
        if entry.landing and not self.done():
            entry.cancel_requested = True
            if entry.ep is not None:
                # cut the push off: a stopped or wedged sender would hold the pages forever;
                # aborting cancels the posted receives, and the landing then cancels this future
                abort_endpoint(entry.ep)
            return False
        return super().cancel(msg)

    def _cancel_now(self) -> None:
        super().cancel()


@dataclass(eq=False)
class ExpectedTransfer:
    """One transfer decode registered: its pages and where its pushes stand."""

    transfer_id: int
    buffers: list[Array]
    views: list[np.ndarray]
    """The same buffers as writable uint8 arrays, for pulls from a sender's shared pool."""
    future: TransferFuture = field(init=False)
    """Set by `TransferTable.expect` right after the entry is made (the future refers to its entry)."""
    landing: bool = False
    """A push is writing into the buffers now."""
    cancel_requested: bool = False
    sizes: list[int] = field(default_factory=list)
    num_landed: int = 0
    """Buffers landed so far, in order: the next part must start here."""
    started_at: float = 0.0
    """perf_counter when the first part's receives were posted."""
    ep: Any = None
    """The sender's endpoint while the push lands (aborted to cut a cancelled push off)."""


def _byte_view(buf) -> np.ndarray:
    """A writable 1-D uint8 numpy view of a C-contiguous host buffer."""
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


class TransferTable:
    """The transfers expected (registered, not done), the ids refused, and the pushes that came
    before their transfer's `expect` and wait for it. Use from the receiver's event loop thread."""

    REFUSED_KEPT = 4096
    """Refused transfer ids remembered, so a push that comes after its refusal is NACKed at once."""

    def __init__(self) -> None:
        self.expected: dict[int, ExpectedTransfer] = {}  # registered, not done
        self.awaited: dict[int, asyncio.Future] = {}  # pushes waiting for their expect()
        self.refused: OrderedDict[int, None] = OrderedDict()

    def expect(
        self, transfer_id: int, buffers: Sequence[np.ndarray], loop: asyncio.AbstractEventLoop
    ) -> TransferFuture:
        """Register the destination pages of one transfer (`KVReceiver.expect` says how).

        Raises ValueError: transfer_id already registered or not in [0, 2**64), or a buffer not
        writable / contiguous.
        """
        tid = _check_transfer_id(transfer_id)
        if tid in self.expected:
            raise ValueError(f"transfer {tid} is already expected")
        arrays = [_as_buffer(b, i, writable=True) for i, b in enumerate(buffers)]
        views = [] if any(a.cuda for a in arrays) else [_byte_view(b) for b in buffers]
        entry = ExpectedTransfer(tid, arrays, views)
        entry.sizes = [b.nbytes for b in entry.buffers]
        entry.future = TransferFuture(entry, loop)
        entry.future.add_done_callback(lambda _f: self._forget(entry))
        self.expected[tid] = entry
        self.refused.pop(tid, None)
        self.wake(tid)
        return entry.future

    def refuse(self, transfer_id: int) -> None:
        """No `expect` will come for `transfer_id`: a push for it, waiting or yet to come, is
        NACKed at once. The last `REFUSED_KEPT` ids are remembered; an unknown id is fine."""
        self.refused[transfer_id] = None
        while len(self.refused) > self.REFUSED_KEPT:
            self.refused.popitem(last=False)
        self.wake(transfer_id)

    def wake(self, transfer_id: int) -> None:
        """A push waiting for `transfer_id`'s reservation looks again (it came, or never will)."""
        waiter = self.awaited.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def await_reservation(
        self, tid: int, loop: asyncio.AbstractEventLoop, wait_s: float
    ) -> ExpectedTransfer | None:
        """The entry of `tid`, waiting up to wait_s seconds for its expect(); None when it was
        refused or did not come in time."""
        entry = self.expected.get(tid)
        if entry is not None or tid in self.refused or wait_s <= 0:
            return entry
        waiter = self.awaited.setdefault(tid, loop.create_future())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except TimeoutError:
            self.awaited.pop(tid, None)
        return self.expected.get(tid)

    def cancel(self, transfer_id: int) -> None:
        """The pages of `transfer_id` are no longer wanted (`TransferFuture.cancel`); unknown
        or finished ids are ignored."""
        entry = self.expected.get(transfer_id)
        if entry is not None:
            entry.future.cancel()

    def close(self) -> None:
        """The receiver closes: every push waiting for a reservation is refused, and every
        transfer with no push landing is cancelled (those landing fail when it stops)."""
        for tid in list(self.awaited):
            self.wake(tid)
        for entry in list(self.expected.values()):
            if not entry.landing:
                entry.future._cancel_now()

    @staticmethod
    def start_landing(entry: ExpectedTransfer, first: int, ep: Any) -> None:
        """A push of `entry`'s buffers from `first` on begins to write them: over `ep` (cut it
        off to stop the push), or with None for a copy of our own."""
        entry.landing = True
        entry.ep = ep
        if first == 0:
            entry.started_at = time.perf_counter()

    def landed(self, entry: ExpectedTransfer, n: int) -> None:
        """`n` more buffers of `entry` landed: resolve it when they were its last ones, or
        cancel it when that was asked meanwhile."""
        entry.num_landed += n
        entry.landing = False
        entry.ep = None
        if entry.cancel_requested:
            self.finish(entry)
        elif entry.num_landed == len(entry.buffers):
            seconds = time.perf_counter() - entry.started_at
            nbytes = sum(entry.sizes)
            self.finish(entry, result=TransferResult(entry.transfer_id, len(entry.buffers), nbytes, seconds))
            logger.debug("[transfer %d] %d pages, %d bytes landed in %.6f s", entry.transfer_id, n, nbytes, seconds)

    @staticmethod
    def finish(
        entry: ExpectedTransfer, result: TransferResult | None = None, error: BaseException | None = None
    ) -> None:
        """No push writes into `entry` any more: resolve its future with `result` or `error`
        (cancelled instead, when that was asked), unless it is done already."""
        entry.landing = False
        entry.ep = None
        future = entry.future
        if future.done():
            return
        if entry.cancel_requested:
            future._cancel_now()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _forget(self, entry: ExpectedTransfer) -> None:
        if self.expected.get(entry.transfer_id) is entry:
            del self.expected[entry.transfer_id]
            self.refuse(entry.transfer_id)  # done: a late push for it is NACKed without waiting
