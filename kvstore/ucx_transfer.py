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

UCX runtime: ucxx keeps one process-wide context. kvstore initializes it on first use
in "thread" progress mode with Python futures (a notifier thread completes asyncio
futures). The default mode busy-polls the event loop while a receive is pending, which
costs about a core per idle process. The context is bound to the event loop that
first used it; it is reset when the last KVSender/KVReceiver closes, so close them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ucxx
from ucxx._lib.arr import Array
from ucxx.exceptions import UCXError

logger = logging.getLogger(__name__)

MAGIC = 0x4B564D4553485055  # "KVMESHPU"
VERSION = 1
MAX_BUFFERS = 1 << 20  # pages per push; also keeps control tags clear of page tags
_TAG_HEADER = 1 << 60
_TAG_SIZES = _TAG_HEADER + 1
_TAG_ACK = _TAG_HEADER + 2
ACK_OK, ACK_UNKNOWN, ACK_SIZE_MISMATCH, ACK_PROTOCOL = 0, 1, 2, 3
_ACK_MEANING = {ACK_UNKNOWN: "unknown or cancelled transfer id", ACK_SIZE_MISMATCH: "page size mismatch",
                ACK_PROTOCOL: "protocol mismatch"}


class TransferError(Exception):
    """A push failed: peer down, refused, timed out, or a protocol / size mismatch.

    The message names the address and the cause; servicers map it to gRPC UNAVAILABLE.
    """


@dataclass(frozen=True)
class TransferResult:
    """A completed push.

    Attributes:
        transfer_id: the id decode registered the pages under.
        num_buffers: pages moved.
        nbytes: bytes moved (sum of the page sizes).
        seconds: sender: connect (if needed) to ack; receiver: receives posted to last byte landed.
    """

    transfer_id: int
    num_buffers: int
    nbytes: int
    seconds: float


class _UcxRuntime:
    """Reference-counted ownership of ucxx's process-wide context (see the module docstring)."""

    def __init__(self) -> None:
        self._users = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owned = False
        self._atexit_registered = False

    def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        if self._users and loop is not self._loop:
            raise RuntimeError("kvstore's UCX transport is already bound to another event loop; "
                               "use one event loop per process (or close every KVSender/KVReceiver first)")
        if self._users == 0:
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
        if self._users or not self._owned:
            return
        self._owned, self._loop = False, None
        try:
            ucxx.reset()  # stops the notifier and progress threads
        except UCXError as exc:  # an object still references the context; it lingers
            logger.warning("UCX context not fully released: %s", exc)


_runtime = _UcxRuntime()


def pages_digest(buffers) -> str:
    """SHA-256 (hex) over page buffers in order: proves pages arrived bitwise equal."""
    h = hashlib.sha256()
    for buf in buffers:
        h.update(memoryview(buf))
    return h.hexdigest()

# ucxx's progress thread waits on the worker's epoll fd with a 1 ms timeout, so it wakes
# ~1000 times a second even when idle. Each wake-up preempts a model thread: on a small
# machine the decode step's OpenMP regions then stall at their barriers (measured on 2
# cores, default model: single-stream decode ITL 30.7 ms with 1 ms, 28.1 ms with 100 ms). UCX events (and ucxx's
# delayed submissions, which signal the worker) wake the epoll wait at once, so the
# timeout only bounds how long a missed event can go unnoticed.
EPOLL_TIMEOUT_MS = int(os.environ.get("KVMESH_UCX_EPOLL_TIMEOUT_MS", "100"))


def _slow_down_progress_thread(loop: asyncio.AbstractEventLoop) -> None:
    """Start ucxx's progress for `loop`, then restart its thread with EPOLL_TIMEOUT_MS."""
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress(loop)
    ctx.worker.stop_progress_thread()
    ctx.worker.start_progress_thread(polling_mode=False, epoll_timeout=EPOLL_TIMEOUT_MS)


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


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV receiver address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


_REFILL_EVERY = 32  # ucxx keeps 100 request futures ready and refills below 50


def _post_all(ep, op, buffers: Sequence[Array]) -> list:
    """Coroutines posting one tagged send/recv per page (tag = page index).

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
        return await op(buf, tag=i)

    return [post(i, buf) for i, buf in enumerate(buffers)]


class _TransferFuture(asyncio.Future):
    """The future `KVReceiver.expect` returns; cancel() never lets pages be freed early.

    Before the push starts, cancel() cancels at once. While pages are landing it
    returns False and the future is cancelled once the last byte landed, so code that
    awaits it (asyncio.wait_for, task.cancel) never resumes while UCX still writes.
    """

    def __init__(self, entry: _Expected, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._entry = entry

    def cancel(self, msg: Any = None) -> bool:
        if self._entry.started and not self.done():
            self._entry.cancel_requested = True
            return False
        return super().cancel(msg)

    def _cancel_now(self) -> None:
        super().cancel()


@dataclass(eq=False)
class _Expected:
    transfer_id: int
    buffers: list[Array]
    future: _TransferFuture | None = None
    started: bool = False
    cancel_requested: bool = False
    sizes: list[int] = field(default_factory=list)


class KVReceiver:
    """Decode side: one UCX listener per decode process, receiving pushes into reserved pages.

    Args:
        host: address advertised to senders in `address` (UCX listens on all interfaces).
        port: port to listen on; 0 picks a free one.

    Call `expect`, `cancel` and `close` from the event loop thread that ran `start`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener = None
        self._closed = False
        self._pending: dict[int, _Expected] = {}  # registered, push not started
        self._active: dict[int, _Expected] = {}  # pages landing now
        self._conns: dict[asyncio.Task, Any] = {}  # receive loop -> its ucxx Endpoint
        self._num_conns = 0

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
        """"host:port" senders push to."""
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
        an unstarted push is then refused (NACK), a push in progress finishes into the
        buffers first. A late push never writes into pages given to another request.

        Raises:
            RuntimeError: not started, or closed.
            ValueError: transfer_id already registered, or a buffer not writable / contiguous.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("KVReceiver must be started (and not closed) before expect()")
        tid = _check_transfer_id(transfer_id)
        if tid in self._pending or tid in self._active:
            raise ValueError(f"transfer {tid} is already expected")
        entry = _Expected(tid, [_as_buffer(b, i, writable=True) for i, b in enumerate(buffers)])
        entry.sizes = [b.nbytes for b in entry.buffers]
        entry.future = _TransferFuture(entry, self._loop)
        entry.future.add_done_callback(lambda _f: self._forget(entry))
        self._pending[tid] = entry
        return entry.future

    def cancel(self, transfer_id: int) -> None:
        """The pages of `transfer_id` are no longer wanted (request aborted or expired).

        Not started: forgotten now, the future is cancelled, a later push gets NACK 1.
        In progress: the push finishes into the buffers, then the future is cancelled.
        Unknown or finished ids are ignored. Free the pages when the future is done.
        """
        entry = self._pending.get(transfer_id) or self._active.get(transfer_id)
        if entry is not None:
            entry.future.cancel()

    async def close(self) -> None:
        """Stop listening, drop every connection, fail or cancel every open transfer.

        Unstarted transfers are cancelled; transfers in progress fail with TransferError
        once UCX has let go of their buffers. Releases the UCX context when last.
        """
        if self._closed:
            return
        self._closed = True  # from now on new connections are aborted on arrival
        for entry in list(self._pending.values()):
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
        self._conns[task] = ep
        logger.debug("KV receiver %s: %s connected", self.address, peer)
        try:
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
        header = np.empty(4, dtype="<u8")
        while True:
            await ep.recv(header, tag=_TAG_HEADER)  # idle here between pushes
            magic, version, tid, n = (int(x) for x in header)
            if magic != MAGIC or version != VERSION or n > MAX_BUFFERS:
                logger.warning("KV receiver %s: %s sent a bad header (magic %#x, version %d, n %d); dropping it",
                               self.address, peer, magic, version, n)
                await self._ack(ep, ACK_PROTOCOL)
                return
            sizes = np.empty(n, dtype="<u8")
            if n:
                await ep.recv(sizes, tag=_TAG_SIZES)
            entry = self._pending.pop(tid, None)
            if entry is None or entry.future.done():
                logger.warning("[transfer %d] push from %s for an unknown or cancelled transfer: draining %d pages",
                               tid, peer, n)
                await self._drain(ep, sizes)
                await self._ack(ep, ACK_UNKNOWN)
                continue
            if sizes.tolist() != entry.sizes:
                msg = (f"[transfer {tid}] size mismatch: pushed {n} pages of {sizes.tolist()[:4]}... bytes, "
                       f"expected {len(entry.sizes)} pages of {entry.sizes[:4]}... bytes")
                logger.warning("%s (from %s)", msg, peer)
                self._finish(entry, error=TransferError(f"{msg} at {self.address}"))
                await self._drain(ep, sizes)
                await self._ack(ep, ACK_SIZE_MISMATCH)
                continue
            await self._land(ep, peer, entry, n)
            await self._ack(ep, ACK_OK)

    async def _land(self, ep, peer: str, entry: _Expected, n: int) -> None:
        """Receive every page of `entry` into its buffers, all receives posted at once."""
        entry.started = True
        self._active[entry.transfer_id] = entry
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            results = await asyncio.gather(*_post_all(ep, ep.recv, entry.buffers), return_exceptions=True)
            error = next((r for r in results if isinstance(r, BaseException)), None)
        except BaseException as exc:  # cancelled by close()
            error = exc
        if error is not None:
            ep.abort()  # no receive may stay posted into pages once the future is done
            self._finish(entry, error=TransferError(
                f"[transfer {entry.transfer_id}] push from {peer} to {self.address} broke off: {error!r}"))
            raise error
        seconds = time.perf_counter() - started
        self._finish(entry, result=TransferResult(entry.transfer_id, n, sum(entry.sizes), seconds))
        logger.debug("[transfer %d] %d pages, %d bytes landed in %.6f s", entry.transfer_id, n,
                     sum(entry.sizes), seconds)

    async def _drain(self, ep, sizes: np.ndarray) -> None:
        """Receive and discard a push nobody wants, so the endpoint stays in step."""
        if not sizes.size:
            return
        scratch = np.empty(int(sizes.max()), dtype=np.uint8)
        for i, size in enumerate(sizes.tolist()):
            await ep.recv(scratch[:size], tag=i)

    async def _ack(self, ep, code: int) -> None:
        await ep.send(np.array([code], dtype=np.uint8), tag=_TAG_ACK)

    def _finish(self, entry: _Expected, result: TransferResult | None = None,
                error: BaseException | None = None) -> None:
        self._active.pop(entry.transfer_id, None)
        entry.started = False
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
        if self._pending.get(entry.transfer_id) is entry:
            del self._pending[entry.transfer_id]


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
        host, port = _parse_address(address)
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
                    raise TransferError(f"[transfer {tid}] push to {address} timed out after "
                                        f"{self.transfer_timeout_s} s (peer stalled)") from exc
                if isinstance(exc, (UCXError, OSError)):
                    raise TransferError(f"[transfer {tid}] push to {address} failed: {exc!r}") from exc
                raise
            seconds = time.perf_counter() - started
        if code != ACK_OK:
            if code not in (ACK_UNKNOWN, ACK_SIZE_MISMATCH):
                self._drop(address)
            raise TransferError(f"[transfer {tid}] receiver at {address} refused the push: "
                                f"{_ACK_MEANING.get(code, f'ack code {code}')}")
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
                ucxx.create_endpoint(host, port, connect_timeout=self.connect_timeout_s), self.connect_timeout_s)
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
