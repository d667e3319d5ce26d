"""Decode side of the UCX KV push: `KVReceiver` lands pushed pages in reserved buffers
(protocol in kvstore/ucx_transfer.py).

It is one file over 300 lines on purpose: it is one state machine per push (hello, header,
sizes, the posted receives or the same-host pull, the ack, the cut-off on release or expiry),
and every step of it guards the same invariant, that no byte lands in a page after the page
was handed back; split, that invariant would have no single place to be read and checked.
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
import ucxx
from ucxx._lib.arr import Array
from ucxx.exceptions import UCXError

import kvmesh.kvstore.shared_memory as shared_memory
from kvmesh.kvstore.transport import TransferError, TransferResult
from kvmesh.kvstore.ucx_common import (
    _DATA_TAG_BIT,
    _TAG_ACK,
    _TAG_GO,
    _TAG_HEADER,
    _TAG_HELLO,
    _TAG_SIZES,
    _TAG_SOURCE,
    ACK_OK,
    ACK_PROTOCOL,
    ACK_SIZE_MISMATCH,
    ACK_UNKNOWN,
    GO_PULLED,
    MAGIC,
    MAX_BUFFERS,
    VERSION,
    _as_buffer,
    _check_transfer_id,
    _post_all,
    _runtime,
)

logger = logging.getLogger(__name__)


class _TransferFuture(asyncio.Future):
    """The future `KVReceiver.expect` returns; cancel() never lets pages be freed early.

    While no push lands (before the first part, or between parts), cancel() cancels at
    once. While pages are landing it returns False and the future is cancelled once UCX
    has let go of the pages (every receive completed or cut off), so code that awaits it
    (asyncio.wait_for, task.cancel) never resumes while UCX still writes.
    """

    def __init__(self, entry: _Expected, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._entry = entry

    def cancel(self, msg: Any = None) -> bool:
        entry = self._entry
        if entry.landing and not self.done():
            entry.cancel_requested = True
            if entry.ep is not None:
                # cut the push off: a stopped or wedged sender would hold the pages forever;
                # aborting cancels the posted receives, and _land then cancels this future
                entry.ep.abort()
            return False
        return super().cancel(msg)

    def _cancel_now(self) -> None:
        super().cancel()


@dataclass(eq=False)
class _Expected:
    transfer_id: int
    buffers: list[Array]
    views: list[np.ndarray]
    """The same buffers as writable uint8 arrays, for pulls from a sender's shared pool."""
    future: _TransferFuture = field(init=False)
    """Set by `expect` right after the entry is made (the future refers to its entry)."""
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


class KVReceiver:
    """Decode side: one UCX listener per decode process, receiving pushes into reserved pages.

    Args:
        host: address advertised to senders in `address` (UCX listens on all interfaces).
        port: port to listen on; 0 picks a free one.
        reservation_wait_s: how long a push for a transfer not expected yet waits for its
            `expect` (or `refuse`) before it is refused, seconds. The gateway sends Prefill
            while Reserve is in flight, so a push (a cached prefix's pages go out at once)
            can beat the reservation here by a little; one that waits holds the pushes
            behind it on its connection, hence the short bound.

    Call `expect`, `cancel`, `refuse` and `close` from the event loop thread that ran `start`.
    """

    REFUSED_KEPT = 4096
    """Refused transfer ids remembered, so a push that comes after its refusal is NACKed at once."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, reservation_wait_s: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.reservation_wait_s = reservation_wait_s
        self._awaited: dict[int, asyncio.Future] = {}  # pushes waiting for their expect()
        self._refused: OrderedDict[int, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Any = None
        self._closed = False
        self._expected: dict[int, _Expected] = {}  # registered, not done
        self._conns: dict[asyncio.Task, Any] = {}  # receive loop -> its ucxx Endpoint
        self._num_conns = 0
        self._num_pushes = 0  # numbers each push's data tags (see ucx_common._DATA_TAG_BIT)
        self._peer_pools = shared_memory.PeerRegions()  # senders' KV pools this process can map
        self.num_pulled = 0
        """Pushes this receiver copied from a sender's shared pool itself (same host)."""
        self.num_sent = 0
        """Pushes that landed over UCX's data endpoint (another host, or a pool it cannot map)."""

    async def start(self) -> None:
        """Start listening.

        Raises:
            RuntimeError: already started or closed.
            ucxx.exceptions.UCXError: the port is taken (UCXBusyError) or UCX failed to listen.
        """
        if self._loop is not None or self._closed:
            raise RuntimeError("KVReceiver.start() may be called once")
        _runtime.acquire()
        try:
            self._listener = ucxx.create_listener(self._serve, port=self.port)
        except BaseException:
            _runtime.release()
            raise
        self._loop = asyncio.get_running_loop()
        self.port = self._listener.port
        logger.info("KV receiver listening on %s", self.address)

    @property
    def address(self) -> str:
        """ "host:port" senders push to."""
        return f"{self.host}:{self.port}"

    def expect(self, transfer_id: int, buffers: Sequence[np.ndarray]) -> asyncio.Future:
        """Register the destination pages of one transfer.

        Args:
            transfer_id: id the sender will push under, unique among open transfers.
            buffers: the reserved pages in push order: writable, C-contiguous views
                (uint8 1-D views of the KV pool; any dtype/shape is taken as raw bytes).

        Returns:
            a future resolving to TransferResult once every byte landed, or raising
            TransferError (size mismatch, sender died mid-way, receiver closed).

        Freeing pages: only once the future is done. Use `cancel(transfer_id)` (or
        `future.cancel()`, which behaves the same) when the pages are no longer wanted:
        an unstarted push is then refused (NACK), a push in progress is cut off. A late
        push never writes into pages given to another request.

        Raises:
            RuntimeError: not started, or closed.
            ValueError: transfer_id already registered, or a buffer not writable / contiguous.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("KVReceiver must be started (and not closed) before expect()")
        tid = _check_transfer_id(transfer_id)
        if tid in self._expected:
            raise ValueError(f"transfer {tid} is already expected")
        arrays = [_as_buffer(b, i, writable=True) for i, b in enumerate(buffers)]
        views = [] if any(a.cuda for a in arrays) else [_byte_view(b) for b in buffers]
        entry = _Expected(tid, arrays, views)
        entry.sizes = [b.nbytes for b in entry.buffers]
        entry.future = _TransferFuture(entry, self._loop)
        entry.future.add_done_callback(lambda _f: self._forget(entry))
        self._expected[tid] = entry
        self._refused.pop(tid, None)
        self._wake(tid)
        return entry.future

    def refuse(self, transfer_id: int) -> None:
        """No `expect` will come for `transfer_id` (its Reserve was refused): a push for it,
        waiting or yet to come, is NACKed (ACK_UNKNOWN) at once. The last `REFUSED_KEPT` ids
        are remembered; an unknown id is fine."""
        self._refused[transfer_id] = None
        while len(self._refused) > self.REFUSED_KEPT:
            self._refused.popitem(last=False)
        self._wake(transfer_id)

    def _wake(self, transfer_id: int) -> None:
        waiter = self._awaited.pop(transfer_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _await_reservation(self, tid: int) -> _Expected | None:
        """The entry of `tid`, waiting up to reservation_wait_s for its expect(); None when it
        was refused or did not come in time."""
        entry = self._expected.get(tid)
        if entry is not None or tid in self._refused or self.reservation_wait_s <= 0:
            return entry
        assert self._loop is not None
        waiter = self._awaited.setdefault(tid, self._loop.create_future())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.reservation_wait_s)
        except TimeoutError:
            self._awaited.pop(tid, None)
        return self._expected.get(tid)

    def cancel(self, transfer_id: int) -> None:
        """The pages of `transfer_id` are no longer wanted (request aborted or expired).

        No push landing (none yet, or between parts): forgotten now, the future is
        cancelled, a later push gets NACK 1. A push landing: the sender's endpoint is aborted (its posted receives are cancelled,
        so a stopped sender cannot hold the pages), and the future is cancelled once UCX
        has let go of the buffers; the sender's push fails. Unknown or finished ids are
        ignored. Free the pages when the future is done.
        """
        entry = self._expected.get(transfer_id)
        if entry is not None:
            entry.future.cancel()

    async def close(self) -> None:
        """Stop listening, drop every connection, fail or cancel every open transfer.

        Transfers with no push landing are cancelled; those landing fail with TransferError
        once UCX has let go of their buffers. Releases the UCX context when last.
        """
        if self._closed:
            return
        self._closed = True  # from now on new connections are aborted on arrival
        for tid in list(self._awaited):
            self._wake(tid)  # pushes waiting for a reservation: refused now
        for entry in list(self._expected.values()):
            if not entry.landing:
                entry.future._cancel_now()
        tasks = list(self._conns)
        for ep in list(self._conns.values()):
            ep.abort()  # cancels posted receives: the loops end with errors
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=5.0)
        if self._listener is not None:
            # ucxx keeps the port open until the UCX context goes (the last KVSender /
            # KVReceiver of the process closes): until then a connect hangs, then times out
            self._listener.close()
            self._listener = None
        self._peer_pools.close()
        if self._loop is not None:
            self._loop = None
            _runtime.release()

    # --- per-connection receive loop -----------------------------------------------

    async def _serve(self, ep) -> None:
        """Listener callback: serve one sender's endpoint until it goes away."""
        if self._closed:
            ep.abort()
            return
        self._num_conns += 1
        peer = f"conn#{self._num_conns}"
        task = asyncio.current_task()
        assert task is not None, "ucxx calls the listener callback in a task"
        self._conns[task] = ep
        logger.debug("KV receiver %s: %s connected", self.address, peer)
        try:
            # this worker's address: the sender pushes pages over an endpoint made from it,
            # which lets UCX use shared memory or CMA for a peer on this host
            address = np.frombuffer(bytes(ucxx.get_worker_address()), dtype=np.uint8)
            await ep.send(np.array([address.size], dtype="<u8"), tag=_TAG_HELLO)
            await ep.send(address, tag=_TAG_HELLO)
            await self._serve_loop(ep, peer)
        except UCXError as exc:
            logger.debug("KV receiver %s: %s ended: %r", self.address, peer, exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("KV receiver %s: %s failed", self.address, peer)
        finally:
            self._conns.pop(task, None)
            # even when the peer closed it (ep.closed is then True): abort() also drops the
            # endpoint's reference to the UCX context, which must go before ucxx.reset()
            ep.abort()

    async def _serve_loop(self, ep, peer: str) -> None:
        header = np.empty(5, dtype="<u8")
        while True:
            await ep.recv(header, tag=_TAG_HEADER)  # idle here between pushes
            magic, version, tid, n, first = (int(x) for x in header)
            if magic != MAGIC or version != VERSION or n > MAX_BUFFERS:
                logger.warning(
                    "KV receiver %s: %s sent a bad header (magic %#x, version %d, n %d); dropping it",
                    self.address,
                    peer,
                    magic,
                    version,
                    n,
                )
                await self._ack(ep, ACK_PROTOCOL)
                return
            sizes = np.empty(n, dtype="<u8")
            source = np.zeros(5 + n, dtype="<u8")
            if n:
                await ep.recv(sizes, tag=_TAG_SIZES)
                await ep.recv(source, tag=_TAG_SOURCE)
            entry = await self._await_reservation(tid)
            if entry is None or entry.future.done() or entry.landing:
                logger.warning("[transfer %d] push from %s for an unknown or cancelled transfer: refused", tid, peer)
                await self._go(ep, ACK_UNKNOWN)
                continue
            expected = entry.sizes[first : first + n]
            if first != entry.num_landed or sizes.tolist() != expected:
                msg = (
                    f"[transfer {tid}] size mismatch: pushed pages [{first}, {first + n}) of "
                    f"{sizes.tolist()[:4]}... bytes, expected pages [{entry.num_landed}, ...) of "
                    f"{len(entry.sizes)} pages of {entry.sizes[:4]}... bytes"
                )
                logger.warning("%s (from %s)", msg, peer)
                self._finish(entry, error=TransferError(f"{msg} at {self.address}"))
                await self._go(ep, ACK_SIZE_MISMATCH)
                continue
            pool = self._sender_pool(source, sizes) if n and entry.views else None
            if pool is not None:
                await self._pull(ep, peer, entry, first, pool, source[5:].tolist())
            else:
                await self._land(ep, peer, entry, first, n)
            await self._ack(ep, ACK_OK)

    async def _land(self, ep, peer: str, entry: _Expected, first: int, n: int) -> None:
        """Receive buffers [first, first + n) of `entry`, all receives posted at once, after
        telling the sender to go; resolve the transfer when its last buffer landed. The
        receives are posted on the connection's endpoint (UCX matches tags per worker, so
        the pages the sender sends over its data endpoint land in them), so aborting that
        endpoint cancels them."""
        entry.landing = True
        entry.ep = ep
        if first == 0:
            entry.started_at = time.perf_counter()
        error: BaseException | None = None
        self._num_pushes += 1
        tag_base = _DATA_TAG_BIT | (self._num_pushes % (1 << 43)) << 20
        receives: list[asyncio.Future] = []
        try:
            buffers = entry.buffers[first : first + n]
            receives = [asyncio.ensure_future(c) for c in _post_all(ep, ep.recv, buffers, tag_base)]
            await asyncio.sleep(0)  # each task posts its receive at its first step
            await self._go(ep, ACK_OK, tag_base)
            results = await asyncio.gather(*receives, return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
        except BaseException as exc:  # cancelled by close()
            error = exc
            for receive in receives:
                receive.cancel()
        if error is not None:
            ep.abort()  # no receive may stay posted into pages once the future is done
            self._finish(
                entry,
                error=TransferError(
                    f"[transfer {entry.transfer_id}] push from {peer} to {self.address} broke off: {error!r}"
                ),
            )
            raise error
        self.num_sent += 1
        self._landed(entry, n)

    def _sender_pool(self, source: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
        """The sender's pool, mapped here, when the pages lie in one this process can map and
        every page is inside it; None otherwise (the pages then come over UCX)."""
        pid, fd, nonce0, nonce1, nbytes = (int(x) for x in source[:5])
        if pid == 0:
            return None
        pool = self._peer_pools.open(shared_memory.RegionDescriptor(pid, fd, (nonce0, nonce1), nbytes))
        if pool is None or any(int(o) + int(s) > nbytes for o, s in zip(source[5:], sizes)):
            return None
        return pool

    async def _pull(self, ep, peer: str, entry: _Expected, first: int, pool: np.ndarray, offsets: list[int]) -> None:
        """Copy buffers [first, first + len(offsets)) of `entry` from the sender's pool (mapped
        here) on a worker thread, then tell the sender no data is to be sent (GO_PULLED).
        A cancel meanwhile waits for the copy (it cannot hang: both sides are this process's
        memory) and then cancels the future."""
        entry.landing = True
        entry.ep = None  # nothing to cut off: the copy is ours and ends by itself
        if first == 0:
            entry.started_at = time.perf_counter()
        views = entry.views[first : first + len(offsets)]

        def copy() -> None:
            for view, offset in zip(views, offsets):
                np.copyto(view, pool[offset : offset + view.nbytes])

        copying = asyncio.ensure_future(asyncio.to_thread(copy))
        try:
            await asyncio.shield(copying)
        except BaseException as exc:
            if not copying.done():  # cancelled (close): the thread still writes the pages
                await asyncio.wait({copying})
            self._finish(
                entry, error=TransferError(f"[transfer {entry.transfer_id}] pull from {peer}'s pool failed: {exc!r}")
            )
            raise
        self.num_pulled += 1
        await self._go(ep, GO_PULLED)
        self._landed(entry, len(offsets))

    def _landed(self, entry: _Expected, n: int) -> None:
        """`n` more buffers of `entry` landed: resolve it when they were its last ones."""
        entry.num_landed += n
        entry.landing = False
        entry.ep = None
        if entry.cancel_requested:
            self._finish(entry)
        elif entry.num_landed == len(entry.buffers):
            seconds = time.perf_counter() - entry.started_at
            nbytes = sum(entry.sizes)
            self._finish(entry, result=TransferResult(entry.transfer_id, len(entry.buffers), nbytes, seconds))
            logger.debug("[transfer %d] %d pages, %d bytes landed in %.6f s", entry.transfer_id, n, nbytes, seconds)

    async def _go(self, ep, code: int, tag_base: int = 0) -> None:
        """Answer a header: ACK_OK and the push's data tag base, or why the pages are refused
        (then none are sent)."""
        await ep.send(np.array([code, tag_base], dtype="<u8"), tag=_TAG_GO)

    async def _ack(self, ep, code: int) -> None:
        await ep.send(np.array([code], dtype=np.uint8), tag=_TAG_ACK)

    def _finish(
        self, entry: _Expected, result: TransferResult | None = None, error: BaseException | None = None
    ) -> None:
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

    def _forget(self, entry: _Expected) -> None:
        if self._expected.get(entry.transfer_id) is entry:
            del self._expected[entry.transfer_id]
            self.refuse(entry.transfer_id)  # done: a late push for it is NACKed without waiting
