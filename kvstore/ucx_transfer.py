"""Pushing a request's KV pages from prefill to decode over UCX (ucxx's asyncio API).

Decode reserves pages and registers them with `KVReceiver.expect`; prefill computes
the KV and `KVSender.push`es every page straight into those pages: one tagged UCX
send per page, all posted at once, received zero-copy into the reserved buffers (a
scatter-gather push in the style of NIXL / Mooncake's transfer engine). ucxx's own
send_multi/recv_multi are not used: they make the receiver allocate the buffers.

Two endpoints per sender and receiver pair on one host, one across hosts. The control
endpoint comes from the receiver's listener (host:port, TCP). For a receiver on the same host
the data endpoint is made from the receiver's UCX worker address, which the receiver sends
first, so UCX may use shared memory (an endpoint made through a listener can use TCP only);
for a remote receiver the pages go over the control endpoint too, which spares UCX's TCP
transport a use-after-free of worker-address endpoints (kvstore/ucx_connections.py).

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
                                     (the receives are posted per worker: either endpoint)
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

The receiver is in kvstore/ucx_receiver.py (its transfer table in kvstore/ucx_table.py, the
ways its pages land in kvstore/ucx_landing.py), and the shared runtime, constants and helpers in
kvstore/ucx_common.py. This module holds the sender, whose connections are in
kvstore/ucx_connections.py and whose push exchange is in kvstore/ucx_push.py, and re-exports the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from ucxx.exceptions import UCXError

import kvmesh.kvstore.ucx_common as common
from kvmesh.kvstore.transport import TransferError, TransferResult, pages_digest, parse_address
from kvmesh.kvstore.ucx_connections import SenderEndpoints
from kvmesh.kvstore.ucx_push import Progress, PushExchange, PushMessage, Stalled, bounded, push_message
from kvmesh.kvstore.ucx_receiver import KVReceiver

__all__ = ["KVReceiver", "KVSender", "TransferError", "TransferResult", "pages_digest", "parse_address"]


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
        self._connections = SenderEndpoints()
        self._locks: dict[str, asyncio.Lock] = {}
        self._acquired = False
        self._closed = False

    @property
    def _endpoints(self) -> dict[str, tuple[Any, Any]]:
        """address -> its cached (control, data) endpoints (the connections'; tests read it)."""
        return self._connections.pairs

    async def connect(self, address: str) -> None:
        """Connect to the receiver at `address` ahead of the first push (a no-op when connected).

        Prefill calls it as a request arrives, so connecting overlaps the prompt's compute.
        Raises ValueError for a malformed address, TransferError when it cannot connect
        within connect_timeout_s.
        """
        if self._closed:
            raise RuntimeError("KVSender is closed")
        host, port = parse_address(address)
        self._acquire_runtime()
        async with self._locks.setdefault(address, asyncio.Lock()):
            await self._connections.get(address, host, port, self.connect_timeout_s)

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
        message = push_message(transfer_id, buffers, first)
        self._acquire_runtime()
        async with self._locks.setdefault(address, asyncio.Lock()):
            started = time.perf_counter()
            ctrl, data = await self._connections.get(address, host, port, self.connect_timeout_s)
            code = await self._exchange(address, ctrl, data, message)
            seconds = time.perf_counter() - started
        tid = message.transfer_id
        if code != common.ACK_OK:
            if code not in (common.ACK_UNKNOWN, common.ACK_SIZE_MISMATCH):
                self._connections.drop(address)
            raise TransferError(
                f"[transfer {tid}] receiver at {address} refused the push: {common._ACK_MEANING.get(code, f'ack code {code}')}"
            )
        return TransferResult(tid, len(message.arrays), message.nbytes, seconds)

    async def _exchange(self, address: str, ctrl: Any, data: Any, message: PushMessage) -> int:
        """Run the push's exchange within the sender's bounds; return the receiver's code. On any
        error the endpoints are dropped first (aborting cancels every send still reading the
        pages); a stall, a timeout or a UCX / OS error is raised as TransferError."""
        tid = message.transfer_id
        progress = Progress()
        try:
            exchange = PushExchange(ctrl, data, message, progress).run()
            return await bounded(exchange, progress, self.transfer_timeout_s, self.stall_timeout_s)
        except BaseException as exc:
            self._connections.drop(address)  # aborting cancels every send still reading the pages
            if isinstance(exc, Stalled):
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

    def _acquire_runtime(self) -> None:
        """Hold the process's UCX runtime from the first connect or push until close()."""
        if not self._acquired:
            common._runtime.acquire()
            self._acquired = True

    async def close(self) -> None:
        """Abort every cached endpoint (in-flight pushes fail) and release the UCX context when last."""
        if self._closed:
            return
        self._closed = True
        self._connections.drop_all()
        if self._acquired:
            self._acquired = False
            common._runtime.release()
