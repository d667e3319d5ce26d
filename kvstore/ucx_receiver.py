"""Decode side of the UCX KV push: `KVReceiver` lands pushed pages in reserved buffers
(protocol in kvstore/ucx_transfer.py).

Each push is one state machine: hello, header, sizes, the posted receives or the same-host
pull, the ack, the cut-off on release or expiry. This module holds the listener and each
connection's receive loop, which walks a push through those steps; the transfer table
(kvstore/ucx_table.py) owns each transfer's pages, its landing and its future, and is the one
place that keeps the invariant every step guards, that no byte lands in a page after the page
was handed back; the ways pages land, posted receives or a pull from the sender's shared pool,
are in kvstore/ucx_landing.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import ucxx
from ucxx.exceptions import UCXError

import kvmesh.kvstore.shared_memory as shared_memory
from kvmesh.kvstore.transport import TransferError
from kvmesh.kvstore.ucx_common import (
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
    _runtime,
    abort_endpoint,
    check_open,
)
from kvmesh.kvstore.ucx_landing import (
    data_tag_base,
    pull_pages,
    receive_pages,
    send_ack,
    send_go,
    sender_pool,
)
from kvmesh.kvstore.ucx_table import ExpectedTransfer, TransferTable

logger = logging.getLogger(__name__)


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

    REFUSED_KEPT = TransferTable.REFUSED_KEPT
    """Refused transfer ids remembered, so a push that comes after its refusal is NACKed at once."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, reservation_wait_s: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.reservation_wait_s = reservation_wait_s
        self._table = TransferTable()  # the transfers expected, refused and awaited
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Any = None
        self._closed = False
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

    @property
    def _expected(self) -> dict[int, ExpectedTransfer]:
        """The transfers registered and not done, by id (the table's; tests read it)."""
        return self._table.expected

    @property
    def _awaited(self) -> dict[int, asyncio.Future]:
        """Pushes waiting for their transfer's expect(), by id (the table's; tests read it)."""
        return self._table.awaited

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
        return self._table.expect(transfer_id, buffers, self._loop)

    def refuse(self, transfer_id: int) -> None:
        """No `expect` will come for `transfer_id` (its Reserve was refused): a push for it,
        waiting or yet to come, is NACKed (ACK_UNKNOWN) at once. The last `REFUSED_KEPT` ids
        are remembered; an unknown id is fine."""
        self._table.refuse(transfer_id)

    def cancel(self, transfer_id: int) -> None:
        """The pages of `transfer_id` are no longer wanted (request aborted or expired).

        No push landing (none yet, or between parts): forgotten now, the future is
        cancelled, a later push gets NACK 1. A push landing: the sender's endpoint is aborted
        (its posted receives are cancelled, so a stopped sender cannot hold the pages), and
        the future is cancelled once UCX has let go of the buffers; the sender's push fails.
        Unknown or finished ids are ignored. Free the pages when the future is done.
        """
        self._table.cancel(transfer_id)

    async def close(self) -> None:
        """Stop listening, drop every connection, fail or cancel every open transfer.

        Transfers with no push landing are cancelled; those landing fail with TransferError
        once UCX has let go of their buffers. Releases the UCX context when last.
        """
        if self._closed:
            return
        self._closed = True  # from now on new connections are aborted on arrival
        self._table.close()  # pushes waiting for a reservation: refused now; no push landing: cancelled
        tasks = list(self._conns)
        for ep in list(self._conns.values()):
            abort_endpoint(ep)  # cancels posted receives: the loops end with errors
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
            abort_endpoint(ep)
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
            abort_endpoint(ep)

    async def _serve_loop(self, ep, peer: str) -> None:
        """Serve the connection's pushes one after another, until a header breaks the protocol."""
        header = np.empty(5, dtype="<u8")
        while True:
            check_open(ep)
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
                await send_ack(ep, ACK_PROTOCOL)
                return
            await self._serve_push(ep, peer, tid, n, first)

    async def _serve_push(self, ep, peer: str, tid: int, n: int, first: int) -> None:
        """One push of pages [first, first + n) of transfer `tid`, after its header: its sizes
        and source, its reservation, then its pages landed and acked, or the push refused."""
        sizes = np.empty(n, dtype="<u8")
        source = np.zeros(5 + n, dtype="<u8")
        if n:
            check_open(ep)
            await ep.recv(sizes, tag=_TAG_SIZES)
            check_open(ep)
            await ep.recv(source, tag=_TAG_SOURCE)
        assert self._loop is not None, "connections are served after start()"
        entry = await self._table.await_reservation(tid, self._loop, self.reservation_wait_s)
        if entry is None or entry.future.done() or entry.landing:
            logger.warning("[transfer %d] push from %s for an unknown or cancelled transfer: refused", tid, peer)
            await send_go(ep, ACK_UNKNOWN)
            return
        if not await self._sizes_match(ep, peer, entry, first, sizes):
            return
        pool = sender_pool(self._peer_pools, source, sizes) if n and entry.views else None
        if pool is not None:
            await self._pull(ep, peer, entry, first, pool, source[5:].tolist())
        else:
            await self._land(ep, peer, entry, first, n)
        await send_ack(ep, ACK_OK)

    async def _sizes_match(self, ep, peer: str, entry: ExpectedTransfer, first: int, sizes: np.ndarray) -> bool:
        """Whether the push holds the transfer's next pages with the sizes registered; when
        not, the transfer fails with TransferError and the push is refused."""
        expected = entry.sizes[first : first + len(sizes)]
        if first == entry.num_landed and sizes.tolist() == expected:
            return True
        msg = (
            f"[transfer {entry.transfer_id}] size mismatch: pushed pages [{first}, {first + len(sizes)}) of "
            f"{sizes.tolist()[:4]}... bytes, expected pages [{entry.num_landed}, ...) of "
            f"{len(entry.sizes)} pages of {entry.sizes[:4]}... bytes"
        )
        logger.warning("%s (from %s)", msg, peer)
        self._table.finish(entry, error=TransferError(f"{msg} at {self.address}"))
        await send_go(ep, ACK_SIZE_MISMATCH)
        return False

    async def _land(self, ep, peer: str, entry: ExpectedTransfer, first: int, n: int) -> None:
        """Receive the push's pages over UCX (`receive_pages`), each push with tags of its own."""
        self._num_pushes += 1
        where = f"from {peer} to {self.address}"
        await receive_pages(ep, where, self._table, entry, first, n, data_tag_base(self._num_pushes))
        self.num_sent += 1
        self._table.landed(entry, n)

    async def _pull(
        self, ep, peer: str, entry: ExpectedTransfer, first: int, pool: np.ndarray, offsets: list[int]
    ) -> None:
        """Copy the push's pages from the sender's pool (`pull_pages`), then tell the sender no
        data is to be sent (GO_PULLED)."""
        await pull_pages(peer, self._table, entry, first, pool, offsets)
        self.num_pulled += 1
        await send_go(ep, GO_PULLED)
        self._table.landed(entry, len(offsets))
