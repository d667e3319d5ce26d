"""One request's KV push to decode, in parts as chunked prefill completes its pages.

The engine's worker thread reports, after each chunk, how many of the request's pages are
final (`pages_ready`); this object pushes them from the event loop while the next chunk
computes, one part at a time and in page order (the transport's `push(..., first=)`), and
`finish` pushes what is left (the last chunk's pages, then the state buffers of models that
have them) once the compute is done. Only that last part is left in TTFT: the rest of the
push overlaps the compute, as Mooncake's layer-wise and SGLang's chunk-wise transfers do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvmesh.engine.kv_cache import KVCacheManager
from kvmesh.kvstore.transport import KVPushSender, TransferError, pages_digest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushReport:
    """A finished push.

    Attributes:
        nbytes: bytes moved (pages and state buffers).
        seconds: the whole push, the parts' durations added up (connect to ack each).
        exposed_s: from the end of the prompt's compute to decode's last ack: the part of
            the push that TTFT pays.
        num_parts: pushes the transfer took.
        digest: SHA-256 of every buffer in order ('' unless asked for).
    """

    nbytes: int
    seconds: float
    exposed_s: float
    num_parts: int
    digest: str


class KVPush:
    """Pushes one request's pages to one decode's reserved pages (`transfer_id`) in parts.

    Args:
        sender: the process's KV push sender.
        address: decode's KV receiver "host:port".
        transfer_id: the id decode reserved the pages under.
        kv_cache: the KV cache owning the pages (its push_buffers).
        timeout_s: bound on each part (seconds); a part past it fails the push.
        skip_pages: leading pages decode holds already (decode-side prefix reuse): never pushed;
            the receiver's buffer 0 is page skip_pages.

    Create it on the event loop; `pages_ready` may be called from any thread.
    """

    def __init__(
        self,
        sender: KVPushSender,
        address: str,
        transfer_id: int,
        kv_cache: KVCacheManager,
        timeout_s: float,
        skip_pages: int = 0,
    ) -> None:
        self.skip_pages = skip_pages
        self.sender = sender
        self.address = address
        self.transfer_id = transfer_id
        self.kv_cache = kv_cache
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._block_ids: tuple[int, ...] = ()
        self._num_ready = 0  # leading pages final on the prefill side
        self._num_sent = skip_pages  # leading pages decode acked (or held already)
        self._pump: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._state_slot: int | None = None
        self.failed: asyncio.Future[BaseException] = self._loop.create_future()
        """Resolves to the error of the first part that fails: the servicer answers the request
        then, not after the prompt's last chunk computed."""
        self.nbytes = 0
        self.seconds = 0.0
        self.num_parts = 0

    def pages_ready(self, block_ids: tuple[int, ...], n: int) -> None:
        """The first `n` pages of `block_ids` are final: push them soon (thread-safe, never blocks).
        After the service's event loop closed (it is shutting down) there is nothing to push to."""
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._offer, block_ids, n)
        except RuntimeError:  # closed between the check and the call
            pass

    def _offer(self, block_ids: tuple[int, ...], n: int) -> None:
        self._block_ids, self._num_ready = block_ids, max(self._num_ready, n)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._push_ready())
            self._pump.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _push_ready(self) -> None:
        """Push the pages that are ready and not sent, until none is left (parts coalesce)."""
        while self._num_sent < self._num_ready and self._error is None and not self._stopped:
            await self._push_part(self._num_ready, with_state=False)

    async def _push_part(self, upto: int, with_state: bool) -> None:
        first = self._num_sent
        buffers = self.kv_cache.outbound(self._block_ids[first:upto], self._state_slot, with_state)
        try:
            sent = await asyncio.wait_for(
                self.sender.push(self.address, self.transfer_id, buffers, first=first - self.skip_pages),
                self.timeout_s,
            )
        except Exception as exc:
            self._error = exc
            if not self.failed.done():
                self.failed.set_result(exc)
            raise
        self._num_sent = upto
        self.nbytes += sent.nbytes
        self.seconds += sent.seconds
        self.num_parts += 1

    def stop(self) -> None:
        """Push no further part (the request is gone); a part on the wire finishes on its own."""
        self._stopped = True

    async def wait_idle(self) -> None:
        """Return once no part is on the wire (the pages may then be released)."""
        if self._pump is not None:
            await asyncio.wait({self._pump})

    async def finish(
        self, block_ids: tuple[int, ...], state_slot: int | None, compute_end: float, digest: bool
    ) -> PushReport:
        """Push every page not pushed yet, then the state buffers, after the parts in flight.

        Args:
            block_ids: all of the request's pages, in order.
            state_slot: its state slot (None for runners without one).
            compute_end: time.perf_counter() when the prompt's compute ended.
            digest: also return the SHA-256 of every buffer pushed.

        Raises TransferError (or TimeoutError) when a part failed; asyncio.TimeoutError is
        reported as TransferError naming the part.
        """
        await self.wait_idle()
        self._block_ids, self._state_slot = block_ids, state_slot
        if self._error is None:
            try:
                await self._push_part(len(block_ids), with_state=True)
            except Exception:
                pass  # kept in self._error: reported below, as a part's error is
        if self._error is not None:
            if isinstance(self._error, TimeoutError):
                raise TransferError(
                    f"[transfer {self.transfer_id}] a push part to {self.address} took over {self.timeout_s} s"
                ) from self._error
            raise self._error
        exposed = time.perf_counter() - compute_end
        text = ""
        if digest:  # of what the push wrote: decode's reused pages are its own
            buffers = self.kv_cache.push_buffers(block_ids[self.skip_pages :], state_slot)
            text = pages_digest(buffers, self.kv_cache.runner.page_layout.describe())
        return PushReport(self.nbytes, self.seconds, exposed, self.num_parts, text)
