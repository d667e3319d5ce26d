"""One push of KV pages on the sender's side of the UCX transfer, once connected (the sender is
kvstore/ucx_transfer.py, which describes the wire protocol): the messages it announces
(`PushMessage`), its exchange with the receiver (`PushExchange`: HEADER, SIZES, SOURCE, await
GO, the pages, await ACK), and the bounds it runs within (`bounded`: the transfer timeout, and
the stall timeout that `Progress` feeds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ucxx._lib.arr import Array

import kvmesh.kvstore.shared_memory as shared_memory
import kvmesh.kvstore.ucx_common as common


class Stalled(Exception):
    """A push saw no progress for its sender's stall_timeout_s."""


_SLOW_COPY_BYTES_PER_S = 200e6


class Progress:
    """When a push last moved: a control message exchanged or a page's send completed."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self, *_: object, allow_s: float = 0.0) -> None:
        """It moved now (a done callback's future is ignored); allow_s more seconds of silence
        are expected next."""
        self.last = time.monotonic() + allow_s


@dataclass(frozen=True)
class PushMessage:
    """What a push announces and sends: its control messages and its pages."""

    transfer_id: int
    arrays: list[Array]
    """The pages, zero-copy."""
    header: np.ndarray
    """HEADER, 5 x uint64 LE: MAGIC, VERSION, transfer_id, n, first."""
    sizes: np.ndarray
    """SIZES, n x uint64 LE: each page's size in bytes."""
    source: np.ndarray
    """SOURCE, (5 + n) x uint64 LE: where the pages lie in a shared KV pool (pid 0: in none)."""

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


def push_message(transfer_id: int, buffers: Sequence[np.ndarray], first: int) -> PushMessage:
    """The messages of a push of `buffers` into the receiver's buffers first, first + 1, ...

    Raises ValueError: a transfer id not in [0, 2**64), a non-contiguous buffer, more than
    MAX_BUFFERS pages, or `first` not an int in [0, MAX_BUFFERS).
    """
    tid = common._check_transfer_id(transfer_id)
    arrays = [common._as_buffer(b, i, writable=False) for i, b in enumerate(buffers)]
    if len(arrays) > common.MAX_BUFFERS:
        raise ValueError(f"at most {common.MAX_BUFFERS} pages per push, got {len(arrays)}")
    sizes = np.array([a.nbytes for a in arrays], dtype="<u8")
    if not isinstance(first, (int, np.integer)) or not 0 <= first < common.MAX_BUFFERS:
        raise ValueError(f"first must be an int in [0, {common.MAX_BUFFERS}), got {first!r}")
    header = np.array([common.MAGIC, common.VERSION, tid, len(arrays), first], dtype="<u8")
    source = np.zeros(5 + len(arrays), dtype="<u8")
    located = shared_memory.locate([a.ptr for a in arrays], [a.nbytes for a in arrays])
    if located is not None:
        desc, offsets = located
        source[:5] = [desc.pid, desc.fd, desc.nonce[0], desc.nonce[1], desc.nbytes]
        source[5:] = offsets
    return PushMessage(tid, arrays, header, sizes, source)


async def bounded(
    exchange: Awaitable[int], progress: Progress, transfer_timeout_s: float, stall_timeout_s: float
) -> int:
    """Run `exchange` within transfer_timeout_s seconds (TimeoutError), failing it with Stalled
    once `progress` saw nothing for stall_timeout_s seconds; either way it is cancelled and
    awaited first."""
    task = asyncio.ensure_future(exchange)
    deadline = time.monotonic() + transfer_timeout_s
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError
            if now - progress.last >= stall_timeout_s:
                raise Stalled
            wait = min(deadline, progress.last + stall_timeout_s) - now
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def _retrieve(f: asyncio.Future) -> Any:
    return f.cancelled() or f.exception()  # never "unretrieved"


class PushExchange:
    """One push on the wire over connected (control, data) endpoints, its steps in order:
    announce the pages, await GO, send the pages unless the receiver refused or pulled them,
    await ACK. `run()` returns the receiver's code: ACK_OK when every page landed."""

    def __init__(self, ctrl: Any, data: Any, message: PushMessage, progress: Progress) -> None:
        self.ctrl, self.data, self.message, self.progress = ctrl, data, message, progress
        self.ack = np.empty(1, dtype=np.uint8)
        self.go = np.empty(2, dtype="<u8")
        self.ack_recv: asyncio.Future | None = None
        self.go_recv: asyncio.Future | None = None
        self.sends: asyncio.Future | None = None

    async def run(self) -> int:
        common.check_open(self.ctrl)
        common.check_open(self.data)
        self.ack_recv = ack_recv = asyncio.ensure_future(self.ctrl.recv(self.ack, tag=common._TAG_ACK))
        self.go_recv = asyncio.ensure_future(self.ctrl.recv(self.go, tag=common._TAG_GO))
        for f in (ack_recv, self.go_recv):
            f.add_done_callback(_retrieve)
        try:
            await self._announce()
            if not await self._await_go():  # the receiver refused the header (protocol mismatch)
                await ack_recv
                return int(self.ack[0])
            code, tag_base = int(self.go[0]), int(self.go[1])
            if code == common.GO_PULLED:  # the receiver copied the pages from our pool itself
                await ack_recv
                return int(self.ack[0])
            if code != common.ACK_OK:
                return code
            await self._send_pages(tag_base)
            return int(self.ack[0])
        finally:
            self._cancel_pending()

    async def _announce(self) -> None:
        """HEADER, then SIZES and SOURCE when there are pages."""
        m = self.message
        for message, tag in [(m.header, common._TAG_HEADER)] + (
            [(m.sizes, common._TAG_SIZES), (m.source, common._TAG_SOURCE)] if m.arrays else []
        ):
            common.check_open(self.ctrl)
            await self.ctrl.send(message, tag=tag)

    async def _await_go(self) -> bool:
        """Wait for GO (True) or an early ACK, which refuses the header (False)."""
        assert self.go_recv is not None and self.ack_recv is not None
        # GO may follow the receiver's own copy of every page (a same-host pull): give it
        # the time that copy takes at a slow 200 MB/s on top of the bound
        self.progress.touch(allow_s=float(self.message.nbytes) / _SLOW_COPY_BYTES_PER_S)
        await asyncio.wait({self.go_recv, self.ack_recv}, return_when=asyncio.FIRST_COMPLETED)
        self.progress.touch()
        if not self.go_recv.done():
            return False
        await self.go_recv
        return True

    async def _send_pages(self, tag_base: int) -> None:
        """Post one send a page over the data endpoint, then await the sends and the ACK."""
        ack_recv = self.ack_recv
        assert ack_recv is not None
        common.check_open(self.data)
        posted = [
            asyncio.ensure_future(c) for c in common._post_all(self.data, self.data.send, self.message.arrays, tag_base)
        ]
        for f in posted:
            f.add_done_callback(self.progress.touch)
        self.sends = sends = asyncio.gather(*posted)
        # a receiver that hangs up mid-push fails the ACK at once, while the data sends
        # could wait for receives that will never match: whichever ends first decides
        await asyncio.wait({sends, ack_recv}, return_when=asyncio.FIRST_EXCEPTION)
        if ack_recv.done() and not ack_recv.cancelled() and ack_recv.exception() is not None:
            await ack_recv  # raises the control endpoint's error
        await sends
        await ack_recv

    def _cancel_pending(self) -> None:
        for f in (self.ack_recv, self.go_recv):
            if f is not None and not f.done():
                f.cancel()
        if self.sends is not None and not self.sends.done():
            self.sends.cancel()
            self.sends.add_done_callback(_retrieve)
