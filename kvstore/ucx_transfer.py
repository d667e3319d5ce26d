"""Pushing a request's KV pages from prefill to decode over UCX (ucxx's asyncio API).

Decode reserves pages and registers them with `KVReceiver.expect`; prefill computes
the KV and `KVSender.push`es every page straight into those pages: one tagged UCX
send per page, all posted at once, received zero-copy into the reserved buffers (a
scatter-gather push in the style of NIXL / Mooncake's transfer engine). ucxx's own
send_multi/recv_multi are not used: they make the receiver allocate the buffers.

Two endpoints per sender and receiver pair. The control endpoint comes from the
receiver's listener (host:port, TCP); the data endpoint is made from the receiver's UCX
worker address, which the receiver sends first, so UCX may choose every transport the two
share: shared memory and CMA (process_vm_readv, one copy) for a peer on the same host,
TCP or RDMA for a remote one. An endpoint made through a listener can use TCP only.

Wire protocol (control messages on the control endpoint, pushes on it serialized):

    receiver -> sender  tag HELLO    at connect: 1 x uint64 LE the worker address's length,
                                     then its bytes
    sender -> receiver  tag HEADER   5 x uint64 LE: MAGIC, VERSION, transfer_id, n, first
    sender -> receiver  tag SIZES    n x uint64 LE: the size of each page in bytes (n > 0)
    sender -> receiver  tag SOURCE   (5 + n) x uint64 LE (n > 0): where the pages lie in the
                                     sender's shared KV pool: pid, fd, nonce (2), pool bytes,
                                     then each page's offset; pid 0 when they are in none
    receiver -> sender  tag GO       2 x uint64 LE: code, tag base. 0: the receives are
                                     posted, send; 1 unknown or cancelled transfer id,
                                     2 size mismatch (or `first` is not the next page the
                                     transfer expects): no page is sent; 4 (GO_PULLED) the
                                     receiver copied the pages from the sender's pool itself
                                     (same host): no page is sent, the ACK follows
    sender -> receiver  (data endpoint) raw tag base | i: page i, all posted concurrently
    receiver -> sender  tag ACK      1 byte: 0 ok (every page landed), 3 protocol mismatch

Same host: when the pages lie in a shared KV pool (kvstore/shared_memory.py) that the
receiver can map, the receiver pulls them itself with one copy (UCX's own same-host paths
move rendezvous messages through a shared-memory bounce buffer, two copies, or with CMA,
which UCX uses only on endpoints without error handling); otherwise they come over the
data endpoint.

A push lands pages [first, first + n) of the transfer's registered buffers. A transfer may
come in several pushes, in page order (first = 0, then where the last one ended): prefill
pushes the pages each chunk of a long prompt completes while it computes the next chunk
(chunked prefill, as Mooncake and SGLang overlap the transfer with compute); the transfer
is done when its last buffer landed.

The receiver numbers its pushes in the tag base (ucx_common._DATA_TAG_BIT), so a page of an
old push cannot match a newer push's receives; it posts the receives on the control endpoint,
so aborting it (a cancelled transfer, a closed receiver) cancels them. ucxx hashes control
tags with a per-connection secret, so several senders to one receiver never match each
other's control messages; each incoming connection gets its own receive loop.

The receiver is in kvstore/ucx_receiver.py and the shared runtime, constants and helpers
in kvstore/ucx_common.py; this module holds the sender and re-exports the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ucxx
from ucxx._lib.arr import Array
from ucxx.exceptions import UCXError

import kvmesh.kvstore.shared_memory as shared_memory
import kvmesh.kvstore.ucx_common as common
from kvmesh.kvstore.transport import TransferError, TransferResult, pages_digest, parse_address
from kvmesh.kvstore.ucx_receiver import KVReceiver

__all__ = ["KVReceiver", "KVSender", "TransferError", "TransferResult", "pages_digest", "parse_address"]

logger = logging.getLogger(__name__)


class _Stalled(Exception):
    """A push saw no progress for its sender's stall_timeout_s."""


_SLOW_COPY_BYTES_PER_S = 200e6


class _Progress:
    """When a push last moved: a control message exchanged or a page's send completed."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self, *_: object, allow_s: float = 0.0) -> None:
        """It moved now (a done callback's future is ignored); allow_s more seconds of silence
        are expected next."""
        self.last = time.monotonic() + allow_s


class KVSender:
    """Prefill side: pushes pages to decode receivers, one cached pair of UCX endpoints (control,
    data) per address.

    Args:
        connect_timeout_s: bound on connecting to a receiver, both endpoints (seconds).
        transfer_timeout_s: bound on one push after connecting, from header to ack
            (seconds). UCX reports a peer that dies at once; one that hangs (stopped,
            wedged) would otherwise hold the push, and its pages, forever.
        stall_timeout_s: bound on a push's silence (seconds): it fails when no control
            message and no page completed for this long. A cut link (packets dropped, no
            reset) leaves TCP retransmitting for minutes and UCX waiting with it; a push of
            many pages over a slow link still has transfer_timeout_s as long as pages move.

    Pushes to one address are serialized; pushes to different addresses run in parallel.
    """

    def __init__(
        self, connect_timeout_s: float = 5.0, transfer_timeout_s: float = 60.0, stall_timeout_s: float = 5.0
    ) -> None:
        if connect_timeout_s <= 0 or transfer_timeout_s <= 0 or stall_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0 s, got connect {connect_timeout_s}, transfer {transfer_timeout_s}, "
                f"stall {stall_timeout_s}"
            )
        self.connect_timeout_s = connect_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._endpoints: dict[str, tuple[Any, Any]] = {}  # address -> (control, data) endpoints
        self._locks: dict[str, asyncio.Lock] = {}
        self._acquired = False
        self._closed = False

    async def connect(self, address: str) -> None:
        """Connect to the receiver at `address` ahead of the first push (a no-op when connected).

        Prefill calls it as a request arrives, so connecting overlaps the prompt's compute.
        Raises ValueError for a malformed address, TransferError when it cannot connect
        within connect_timeout_s.
        """
        if self._closed:
            raise RuntimeError("KVSender is closed")
        host, port = parse_address(address)
        if not self._acquired:
            common._runtime.acquire()
            self._acquired = True
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._connect(address, host, port)

    async def push(
        self, address: str, transfer_id: int, buffers: Sequence[np.ndarray], first: int = 0
    ) -> TransferResult:
        """Push `buffers` (buffer i -> the receiver's buffer first + i) for `transfer_id`; return
        after decode acked.

        Args:
            address: the receiver's "host:port".
            transfer_id: the id decode registered with `KVReceiver.expect`.
            buffers: C-contiguous pages, read zero-copy. Keep them unchanged until push
                returns or raises: by then UCX holds no reference to them (on any error,
                cancellation included, the endpoint is aborted first).
            first: the index of the receiver's buffer that buffers[0] lands in. A transfer
                may be pushed in parts, in order: each part starts where the last ended.

        Raises:
            ValueError: malformed address or transfer id, non-contiguous buffer.
            TransferError: cannot connect within connect_timeout_s, the peer died or
                stalled past transfer_timeout_s, or it NACKed (unknown/cancelled transfer
                id, size mismatch or a part out of order, protocol mismatch).
        """
        if self._closed:
            raise RuntimeError("KVSender is closed")
        host, port = parse_address(address)
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
        if not self._acquired:
            common._runtime.acquire()
            self._acquired = True
        async with self._locks.setdefault(address, asyncio.Lock()):
            started = time.perf_counter()
            ctrl, data = await self._connect(address, host, port)
            progress = _Progress()
            try:
                code = await self._bounded(
                    self._exchange(ctrl, data, header, sizes, source, arrays, progress), progress
                )
            except BaseException as exc:
                self._drop(address)  # aborting cancels every send still reading the pages
                if isinstance(exc, _Stalled):
                    raise TransferError(
                        f"[transfer {tid}] push to {address} stalled: nothing moved for {self.stall_timeout_s} s"
                    ) from exc
                if isinstance(exc, TimeoutError):
                    raise TransferError(
                        f"[transfer {tid}] push to {address} timed out after {self.transfer_timeout_s} s (peer stalled)"
                    ) from exc
                if isinstance(exc, (UCXError, OSError)):
                    raise TransferError(f"[transfer {tid}] push to {address} failed: {exc!r}") from exc
                raise
            seconds = time.perf_counter() - started
        if code != common.ACK_OK:
            if code not in (common.ACK_UNKNOWN, common.ACK_SIZE_MISMATCH):
                self._drop(address)
            raise TransferError(
                f"[transfer {tid}] receiver at {address} refused the push: {common._ACK_MEANING.get(code, f'ack code {code}')}"
            )
        return TransferResult(tid, len(arrays), int(sizes.sum()), seconds)

    async def _bounded(self, exchange, progress: _Progress) -> int:
        """Run `exchange` within transfer_timeout_s (TimeoutError), failing it with _Stalled
        once `progress` saw nothing for stall_timeout_s."""
        task = asyncio.ensure_future(exchange)
        deadline = time.monotonic() + self.transfer_timeout_s
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError
                if now - progress.last >= self.stall_timeout_s:
                    raise _Stalled
                wait = min(deadline, progress.last + self.stall_timeout_s) - now
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    async def close(self) -> None:
        """Abort every cached endpoint (in-flight pushes fail) and release the UCX context when last."""
        if self._closed:
            return
        self._closed = True
        for address in list(self._endpoints):
            self._drop(address)
        if self._acquired:
            self._acquired = False
            common._runtime.release()

    async def _connect(self, address: str, host: str, port: int) -> tuple[Any, Any]:
        """The (control, data) endpoints to `address`, connected now unless cached and open."""
        cached = self._endpoints.get(address)
        if cached is not None and not cached[0].closed and not cached[1].closed:
            return cached
        self._drop(address)
        ctrl = None
        deadline = time.monotonic() + self.connect_timeout_s  # both endpoints within the bound
        try:
            ctrl = await asyncio.wait_for(
                ucxx.create_endpoint(host, port, connect_timeout=self.connect_timeout_s), self.connect_timeout_s
            )
            data = await asyncio.wait_for(self._data_endpoint(ctrl), max(0.0, deadline - time.monotonic()))
        except (UCXError, TimeoutError, OSError, RuntimeError) as exc:
            # a bad host: UCXError at once. Nobody listening, or a listener that is closed
            # but whose process lives: TimeoutError after connect_timeout_s (with Python
            # futures on, ucxx does not surface the refused connect before its timeout).
            if ctrl is not None:
                ctrl.abort()
            raise TransferError(f"cannot connect to KV receiver at {address}: {exc!r}") from exc
        self._endpoints[address] = (ctrl, data)
        return ctrl, data

    @staticmethod
    async def _data_endpoint(ctrl) -> Any:
        """An endpoint made from the worker address the receiver sends first (HELLO)."""
        length = np.empty(1, dtype="<u8")
        await ctrl.recv(length, tag=common._TAG_HELLO)
        if not 0 < int(length[0]) <= 1 << 16:
            raise RuntimeError(f"receiver sent a worker address of {int(length[0])} bytes")
        raw = np.empty(int(length[0]), dtype=np.uint8)
        await ctrl.recv(raw, tag=common._TAG_HELLO)
        return await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(raw.tobytes()))

    async def _exchange(
        self,
        ctrl,
        data,
        header: np.ndarray,
        sizes: np.ndarray,
        source: np.ndarray,
        arrays: list[Array],
        progress: _Progress,
    ) -> int:
        ack = np.empty(1, dtype=np.uint8)
        go = np.empty(2, dtype="<u8")
        ack_recv = asyncio.ensure_future(ctrl.recv(ack, tag=common._TAG_ACK))
        go_recv = asyncio.ensure_future(ctrl.recv(go, tag=common._TAG_GO))
        for f in (ack_recv, go_recv):
            f.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        sends: asyncio.Future | None = None
        try:
            await ctrl.send(header, tag=common._TAG_HEADER)
            if arrays:
                await ctrl.send(sizes, tag=common._TAG_SIZES)
                await ctrl.send(source, tag=common._TAG_SOURCE)
            # GO may follow the receiver's own copy of every page (a same-host pull): give it
            # the time that copy takes at a slow 200 MB/s on top of the bound
            progress.touch(allow_s=float(sizes.sum()) / _SLOW_COPY_BYTES_PER_S)
            await asyncio.wait({go_recv, ack_recv}, return_when=asyncio.FIRST_COMPLETED)
            progress.touch()
            if not go_recv.done():  # the receiver refused the header (protocol mismatch)
                await ack_recv
                return int(ack[0])
            await go_recv
            code, tag_base = int(go[0]), int(go[1])
            if code == common.GO_PULLED:  # the receiver copied the pages from our pool itself
                await ack_recv
                return int(ack[0])
            if code != common.ACK_OK:
                return code
            posted = [asyncio.ensure_future(c) for c in common._post_all(data, data.send, arrays, tag_base)]
            for f in posted:
                f.add_done_callback(progress.touch)
            sends = asyncio.gather(*posted)
            # a receiver that hangs up mid-push fails the ACK at once, while the data sends
            # could wait for receives that will never match: whichever ends first decides
            await asyncio.wait({sends, ack_recv}, return_when=asyncio.FIRST_EXCEPTION)
            if ack_recv.done() and not ack_recv.cancelled() and ack_recv.exception() is not None:
                await ack_recv  # raises the control endpoint's error
            await sends
            await ack_recv
            return int(ack[0])
        finally:
            for f in (ack_recv, go_recv):
                if not f.done():
                    f.cancel()
            if sends is not None and not sends.done():
                sends.cancel()
                sends.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _drop(self, address: str) -> None:
        pair = self._endpoints.pop(address, None)
        if pair is not None:
            for ep in pair:
                ep.abort()  # idempotent; cancels the endpoint's outstanding requests
