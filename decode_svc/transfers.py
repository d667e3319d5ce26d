"""The landing half of a decode request's life, on the event loop: the push expected into its
pages, the future that says the KV landed, its expiry, and a release that happens exactly once.

The request itself is the engine's (`DecodeEngine._requests`, one table by transfer id, one
`RequestStatus`): this adds its `landed` future, `deadline` and `expiry` and moves it through
RESERVED (pages held, the push may land) -> LANDED (every byte in, no Generate yet) -> CLAIMED (a
Generate call owns it; the engine takes over at begin()) or ABORTED. `release` ends a request
from any state once: an unfinished push is cut off first (kvmesh.kvstore.ucx_receiver cancels its
posted receives), and the pages go back to the pool only once no byte can land in them any
more. A request that no Generate call claims by its deadline (Reserve's kv_deadline_s) is
released by its expiry timer, even while the sender is stopped mid-push.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.kvstore.block_hash import BlockHash
from kvmesh.kvstore.transport import KVPushReceiver

logger = logging.getLogger(__name__)

_UNCLAIMED = (RequestStatus.RESERVED, RequestStatus.LANDED)


class Transfers:
    """Reservations and their pushes for one decode instance (call from its event loop only)."""

    def __init__(self, engine: DecodeEngine, receiver: KVPushReceiver) -> None:
        self.engine = engine
        self.receiver = receiver

    def num_unclaimed(self) -> int:
        """Reservations no Generate has claimed yet (their push may still be landing)."""
        return sum(r.status in _UNCLAIMED for r in self.engine.requests())

    async def wait_claimed(self, timeout_s: float) -> int:
        """Wait up to timeout_s seconds until no reservation is unclaimed (each claimed by its
        Generate, released or expired); returns how many are still unclaimed then."""
        deadline = time.monotonic() + timeout_s
        while self.num_unclaimed() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.num_unclaimed()

    def is_open(self, transfer_id: int) -> bool:
        """A request holds `transfer_id` and was not released."""
        r = self.engine.get(transfer_id)
        return r is not None and not r.is_done

    def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        kv_deadline_s: float,
        transfer_id: int = 0,
        block_hashes: Sequence[BlockHash] = (),
        reuse_cached: bool = False,
        n: int = 1,
    ) -> Request:
        """Reserve pages (DecodeEngine.reserve, with the prompt's block hashes, whether to reuse
        the pages held for them, and the n choices), expect the push into the rest, arm the expiry.

        transfer_id: the caller's id for the push (0: one is picked). Raises ValueError /
        CapacityError as DecodeEngine.reserve does.
        """
        loop = asyncio.get_running_loop()
        r = self.engine.reserve(request_id, num_prompt_tokens, max_tokens, transfer_id, block_hashes, reuse_cached, n)
        try:
            r.landed = self.receiver.expect(r.transfer_id, self.engine.transfer_buffers(r.transfer_id))
        except BaseException:
            self.engine.release(r.transfer_id)
            raise
        r.deadline = loop.time() + kv_deadline_s
        r.expiry = loop.call_at(r.deadline, self._expire, r)
        r.landed.add_done_callback(lambda f: self._on_landed(r, f))
        return r

    def claim(self, transfer_id: int) -> Request:
        """Attach a Generate call: the request is CLAIMED from now on and no longer expires.

        Raises LookupError for an unknown, released or already claimed transfer.
        """
        r = self.engine.get(transfer_id)
        if r is None or r.status not in _UNCLAIMED:
            raise LookupError(f"no open reservation for transfer {transfer_id:x}")
        r.status = RequestStatus.CLAIMED
        if r.expiry is not None:
            r.expiry.cancel()
        return r

    def release(self, transfer_id: int, reason: str) -> bool:
        """End a request from any state, once; False when it is unknown (finished) or released.

        A push still landing is cut off and the pages are freed once UCX let go of them; a
        decoding request leaves the batch at the next step.
        """
        r = self.engine.get(transfer_id)
        if r is None or r.is_done:
            return False
        if r.expiry is not None:
            r.expiry.cancel()
        if r.status in _UNCLAIMED:
            logger.info("[%s] reservation released (%s)", r.request_id, reason)
        if r.landed is None or r.landed.done():
            return self.engine.release(transfer_id)
        self.receiver.cancel(transfer_id)  # cuts a push in progress off
        released = self.engine.release(transfer_id, keep_pages=True)
        r.landed.add_done_callback(lambda _f: self.engine.release(transfer_id))
        return released

    def _expire(self, r: Request) -> None:
        if self.engine.get(r.transfer_id) is r and r.status in _UNCLAIMED:
            logger.warning(
                "[%s] reservation expired: %s",
                r.request_id,
                "KV landed but no Generate came"
                if r.status is RequestStatus.LANDED
                else "the KV push did not land in time",
            )
            self.release(r.transfer_id, "expired")

    def _on_landed(self, r: Request, future: asyncio.Future) -> None:
        if r.status is not RequestStatus.RESERVED or future.cancelled():
            return
        if future.exception() is None:
            self.engine.kv_landed(r.transfer_id)  # staged: host buffers into the pages, before any step reads them
            r.status = RequestStatus.LANDED
        else:  # the push broke off (the sender died): no byte can land any more
            self.release(r.transfer_id, f"push failed: {future.exception()}")
