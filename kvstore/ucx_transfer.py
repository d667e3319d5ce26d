"""Pushing a request's KV pages from prefill to decode over UCX (ucxx's asyncio API).

Decode reserves pages and registers them with `KVReceiver.expect`; prefill computes
the KV and `KVSender.push`es every page straight into those pages: one tagged UCX
send per page, all posted at once, received zero-copy into the reserved buffers (a
scatter-gather push in the style of NIXL / Mooncake's transfer engine). ucxx's own
send_multi/recv_multi are not used: they make the receiver allocate the buffers.

Wire protocol, per push, on one endpoint (pushes on an endpoint are serialized):

    sender -> receiver  tag HEADER   4 x uint64 LE: MAGIC, VERSION, transfer_id, n
    sender -> receiver  tag SIZES    n x uint64 LE: the size of each page in bytes (n > 0)
    sender -> receiver  tag i        page i, i = 0 .. n-1 (all posted concurrently)
    receiver -> sender  tag ACK      1 byte: 0 ok, 1 unknown or cancelled transfer id,
                                     2 size mismatch, 3 protocol mismatch

On 1 and 2 the receiver first drains the pages into scratch memory, so the endpoint
stays in step and serves the next push. ucxx hashes each tag with a per-connection
secret, so pushes from several senders to one receiver never match each other's
messages; each incoming connection gets its own receive loop.

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

from kvstore.ucx_common import (
    _ACK_MEANING,
    _TAG_ACK,
    _TAG_HEADER,
    _TAG_SIZES,
    ACK_OK,
    ACK_SIZE_MISMATCH,
    ACK_UNKNOWN,
    MAGIC,
    MAX_BUFFERS,
    VERSION,
    TransferError,
    TransferResult,
    _as_buffer,
    _check_transfer_id,
    _post_all,
    _runtime,
    pages_digest,
    parse_address,
)
from kvstore.ucx_receiver import KVReceiver

__all__ = ["KVReceiver", "KVSender", "TransferError", "TransferResult", "pages_digest", "parse_address"]

logger = logging.getLogger(__name__)


class KVSender:
    """Prefill side: pushes pages to decode receivers, one cached UCX endpoint per address.

    Args:
        connect_timeout_s: bound on connecting to a receiver (seconds).
        transfer_timeout_s: bound on one push after connecting, from header to ack
            (seconds). UCX reports a peer that dies at once; one that hangs (stopped,
            wedged) would otherwise hold the push, and its pages, forever.

    Pushes to one address are serialized; pushes to different addresses run in parallel.
    """

    def __init__(self, connect_timeout_s: float = 5.0, transfer_timeout_s: float = 60.0) -> None:
        if connect_timeout_s <= 0 or transfer_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0 s, got connect {connect_timeout_s}, transfer {transfer_timeout_s}")
        self.connect_timeout_s = connect_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._endpoints: dict[str, Any] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._acquired = False
        self._closed = False

    async def push(self, address: str, transfer_id: int, buffers: Sequence[np.ndarray]) -> TransferResult:
        """Push `buffers` (page i -> the receiver's buffer i) for `transfer_id`; return after decode acked.

        Args:
            address: the receiver's "host:port".
            transfer_id: the id decode registered with `KVReceiver.expect`.
            buffers: C-contiguous pages, read zero-copy. Keep them unchanged until push
                returns or raises: by then UCX holds no reference to them (on any error,
                cancellation included, the endpoint is aborted first).

        Raises:
            ValueError: malformed address or transfer id, non-contiguous buffer.
            TransferError: cannot connect within connect_timeout_s, the peer died or
                stalled past transfer_timeout_s, or it NACKed (unknown/cancelled transfer
                id, size mismatch, protocol mismatch).
        """
        if self._closed:
            raise RuntimeError("KVSender is closed")
        host, port = parse_address(address)
        tid = _check_transfer_id(transfer_id)
        arrays = [_as_buffer(b, i, writable=False) for i, b in enumerate(buffers)]
        if len(arrays) > MAX_BUFFERS:
            raise ValueError(f"at most {MAX_BUFFERS} pages per push, got {len(arrays)}")
        sizes = np.array([a.nbytes for a in arrays], dtype="<u8")
        header = np.array([MAGIC, VERSION, tid, len(arrays)], dtype="<u8")
        if not self._acquired:
            _runtime.acquire()
            self._acquired = True
        async with self._locks.setdefault(address, asyncio.Lock()):
            started = time.perf_counter()
            ep = await self._connect(address, host, port)
            try:
                code = await asyncio.wait_for(self._exchange(ep, header, sizes, arrays), self.transfer_timeout_s)
            except BaseException as exc:
                self._drop(address)  # aborting cancels every send still reading the pages
                if isinstance(exc, TimeoutError):
                    raise TransferError(
                        f"[transfer {tid}] push to {address} timed out after {self.transfer_timeout_s} s (peer stalled)"
                    ) from exc
                if isinstance(exc, (UCXError, OSError)):
                    raise TransferError(f"[transfer {tid}] push to {address} failed: {exc!r}") from exc
                raise
            seconds = time.perf_counter() - started
        if code != ACK_OK:
            if code not in (ACK_UNKNOWN, ACK_SIZE_MISMATCH):
                self._drop(address)
            raise TransferError(
                f"[transfer {tid}] receiver at {address} refused the push: {_ACK_MEANING.get(code, f'ack code {code}')}"
            )
        return TransferResult(tid, len(arrays), int(sizes.sum()), seconds)

    async def close(self) -> None:
        """Abort every cached endpoint (in-flight pushes fail) and release the UCX context when last."""
        if self._closed:
            return
        self._closed = True
        for address in list(self._endpoints):
            self._drop(address)
        if self._acquired:
            self._acquired = False
            _runtime.release()

    async def _connect(self, address: str, host: str, port: int):
        ep = self._endpoints.get(address)
        if ep is not None and not ep.closed:
            return ep
        self._drop(address)
        try:
            ep = await asyncio.wait_for(
                ucxx.create_endpoint(host, port, connect_timeout=self.connect_timeout_s), self.connect_timeout_s
            )
        except (UCXError, TimeoutError, OSError, RuntimeError) as exc:
            # a bad host: UCXError at once. Nobody listening, or a listener that is closed
            # but whose process lives: TimeoutError after connect_timeout_s (with Python
            # futures on, ucxx does not surface the refused connect before its timeout).
            raise TransferError(f"cannot connect to KV receiver at {address}: {exc!r}") from exc
        self._endpoints[address] = ep
        return ep

    async def _exchange(self, ep, header: np.ndarray, sizes: np.ndarray, arrays: list[Array]) -> int:
        ack = np.empty(1, dtype=np.uint8)
        ack_recv = asyncio.ensure_future(ep.recv(ack, tag=_TAG_ACK))
        ack_recv.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        try:
            sends = [ep.send(header, tag=_TAG_HEADER)]
            if arrays:
                sends.append(ep.send(sizes, tag=_TAG_SIZES))
            sends += _post_all(ep, ep.send, arrays)
            results = await asyncio.gather(*sends, return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                if ack_recv.done() and not ack_recv.cancelled() and ack_recv.exception() is None:
                    return int(ack[0])  # the receiver answered (a NACK) before it hung up
                raise failed
            await ack_recv
            return int(ack[0])
        finally:
            if not ack_recv.done():
                ack_recv.cancel()

    def _drop(self, address: str) -> None:
        ep = self._endpoints.pop(address, None)
        if ep is not None:
            ep.abort()  # idempotent; cancels the endpoint's outstanding requests
