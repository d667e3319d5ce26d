"""The decode side of a request's life: one table owns each transfer's pages, the future
that says its KV landed, and its expiry.

A transfer is RESERVED (pages held, the push may land) -> LANDED (every byte in, no
Generate yet) -> DECODING (a Generate call owns it; the engine frees the pages when the
answer ends) -> RELEASED. `release` ends a transfer from any state exactly once: an
unfinished push is cut off first (kvstore.ucx_receiver cancels its posted receives), and
the pages go back to the pool only once no byte can land in them any more. A transfer
that no Generate call claims by its deadline (Reserve's kv_deadline_s) is released by its
expiry timer, even while the sender is stopped mid-push.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

from decode_svc.engine import DecodeEngine, Reservation
from kvstore.transport import KVPushReceiver

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    RESERVED = "reserved"
    LANDED = "landed"
    DECODING = "decoding"
    RELEASED = "released"


@dataclass(eq=False)
class Transfer:
    """One request's reservation on this decode instance."""

    request_id: str
    reservation: Reservation
    landed: asyncio.Future
    """The KV receiver's future: TransferResult once every byte landed, TransferError when
    the push broke off, cancelled when the push was cut off or never came."""
    deadline: float
    """Loop time by which a Generate call must claim the transfer."""
    expiry: asyncio.TimerHandle | None = None
    state: TransferState = TransferState.RESERVED

    @property
    def transfer_id(self) -> int:
        return self.reservation.transfer_id


class TransferTable:
    """Every open transfer of one decode instance (call from its event loop only)."""

    def __init__(self, engine: DecodeEngine, receiver: KVPushReceiver) -> None:
        self.engine = engine
        self.receiver = receiver
        self._transfers: dict[int, Transfer] = {}

    def __len__(self) -> int:
        return len(self._transfers)

    def __contains__(self, transfer_id: int) -> bool:
        return transfer_id in self._transfers

    def reserve(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, kv_deadline_s: float, transfer_id: int = 0
    ) -> Transfer:
        """Reserve pages (DecodeEngine.reserve), expect the push into them, arm the expiry.

        transfer_id: the caller's id for the push (0: one is picked). Raises ValueError /
        CapacityError as DecodeEngine.reserve does.
        """
        loop = asyncio.get_running_loop()
        res = self.engine.reserve(request_id, num_prompt_tokens, max_tokens, transfer_id)
        try:
            landed = self.receiver.expect(res.transfer_id, self.engine.transfer_buffers(res.transfer_id))
        except BaseException:
            self.engine.release(res.transfer_id)
            raise
        t = Transfer(request_id, res, landed, deadline=loop.time() + kv_deadline_s)
        self._transfers[res.transfer_id] = t
        t.expiry = loop.call_at(t.deadline, self._expire, t)
        landed.add_done_callback(lambda f: self._on_landed(t, f))
        return t

    def claim(self, transfer_id: int) -> Transfer:
        """Attach a Generate call: the transfer is DECODING from now on and no longer expires.

        Raises LookupError for an unknown, released or already claimed transfer.
        """
        t = self._transfers.get(transfer_id)
        if t is None or t.state in (TransferState.DECODING, TransferState.RELEASED):
            raise LookupError(f"no open reservation for transfer {transfer_id:x}")
        t.state = TransferState.DECODING
        if t.expiry is not None:
            t.expiry.cancel()
        return t

    def release(self, transfer_id: int, reason: str) -> bool:
        """End a transfer from any state, once; False when it is unknown (finished or released).

        A push still landing is cut off and the pages are freed once UCX let go of them;
        a decoding request leaves the batch at the next step.
        """
        t = self._transfers.pop(transfer_id, None)
        if t is None:
            return False
        was = t.state
        t.state = TransferState.RELEASED
        if t.expiry is not None:
            t.expiry.cancel()
        if was != TransferState.DECODING:
            logger.info("[%s] reservation released (%s)", t.request_id, reason)
        if t.landed.done():
            self.engine.release(transfer_id)
        else:
            self.receiver.cancel(transfer_id)  # cuts a push in progress off
            t.landed.add_done_callback(lambda _f: self.engine.release(transfer_id))
        return True

    def _expire(self, t: Transfer) -> None:
        if self._transfers.get(t.transfer_id) is t and t.state in (TransferState.RESERVED, TransferState.LANDED):
            logger.warning(
                "[%s] reservation expired: %s",
                t.request_id,
                "KV landed but no Generate came"
                if t.state == TransferState.LANDED
                else "the KV push did not land in time",
            )
            self.release(t.transfer_id, "expired")

    def _on_landed(self, t: Transfer, future: asyncio.Future) -> None:
        if t.state == TransferState.RESERVED and not future.cancelled() and future.exception() is None:
            t.state = TransferState.LANDED
        elif t.state == TransferState.RESERVED and not future.cancelled():
            # the push broke off (the sender died): no byte can land any more
            self.release(t.transfer_id, f"push failed: {future.exception()}")
