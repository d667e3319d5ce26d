"""A request's life at the gateway, as one object per attempt.

    routed -> reserved -> prefilled -> decoding -> finished
       \\________\\___________\\___________\\-------> aborted

`RequestLife` holds both legs of one attempt (the prefill instance and the decode
instance with its reservation) and the gateway's accounting on each. The decode leg may
come first: the gateway sends Reserve as soon as it picks decode and chooses prefill (after
the prefix index answers) while Reserve is in flight (`route_prefill`). `finish()` and
`abort(failure)` end it exactly once: the routed-token accounting of an aborted attempt
is undone (so cancels do not skew routing), a decode stream still open
is cancelled, a reservation no stream claimed is released, and the instance a failure
is blamed on counts it in its circuit breaker.
"""

from __future__ import annotations

import asyncio
import enum
import logging

import grpc

from engine.outcomes import FailureCause
from gateway.router import InstanceLoad
from runtime.wire import cause_of, retry_after_of

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    ROUTED = "routed"
    RESERVED = "reserved"
    PREFILLED = "prefilled"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


class RequestFailed(Exception):
    """Why an attempt failed: the cause (which fixes the client's status), a message that
    names the instance, and the instance to blame (None when none is at fault)."""

    def __init__(
        self,
        cause: FailureCause,
        message: str,
        instance: InstanceLoad | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.instance = instance
        self.retry_after_s = retry_after_s
        self.wait_for_room = False
        """The attempt found a full pool and may be tried again once answers end."""


def failure_from_rpc(
    error: grpc.aio.AioRpcError,
    kind: str,
    inst: InstanceLoad,
    decode: InstanceLoad,
    request_id: str,
    slow_is_lost: bool = True,
) -> RequestFailed:
    """Turn a failed call to `inst` (a `kind` instance) into a RequestFailed.

    A service names its cause in the trailers (runtime.wire.abort); a call that failed in
    transport (dead, frozen or unreachable: UNAVAILABLE, the keepalive pings included) is
    the instance lost. A call past its deadline is the instance lost when `slow_is_lost`
    (a small control RPC), else a DEADLINE (a long prefill on a busy, live instance: the
    pings say it lives, so no retry piles more work on the mesh). A failed KV push is
    blamed on the decode instance it went to.
    """
    cause = cause_of(error)
    code = error.code()
    if cause is None:
        cause = {
            grpc.StatusCode.INVALID_ARGUMENT: FailureCause.BAD_REQUEST,
            grpc.StatusCode.RESOURCE_EXHAUSTED: FailureCause.OVERLOADED,
            grpc.StatusCode.FAILED_PRECONDITION: FailureCause.MISMATCH,
            grpc.StatusCode.INTERNAL: FailureCause.INTERNAL,
            grpc.StatusCode.UNKNOWN: FailureCause.INTERNAL,
            grpc.StatusCode.DEADLINE_EXCEEDED: (FailureCause.INSTANCE_LOST if slow_is_lost else FailureCause.DEADLINE),
        }.get(code, FailureCause.INSTANCE_LOST)
    blamed = decode if cause == FailureCause.KV_PUSH_FAILED else inst
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and cause_of(error) is None:
        details = "did not answer in time"
    else:
        details = error.details() or code.name
    name = blamed.instance_id or blamed.address
    where = f"{kind} {name}" if blamed is inst else f"{kind} {inst.instance_id or inst.address} -> decode {name}"
    return RequestFailed(
        cause,
        f"[{request_id}] {where}: {details}",
        blamed if cause in _BLAMES_INSTANCE else None,
        retry_after_of(error),
    )


# failures that say something about the instance (its breaker counts them)
_BLAMES_INSTANCE = frozenset({FailureCause.INSTANCE_LOST, FailureCause.KV_PUSH_FAILED})


class RequestLife:
    """One attempt of one request: its two legs and the gateway's accounting on them."""

    def __init__(
        self, pool, request_id: str, prefill: InstanceLoad | None, decode: InstanceLoad, queued_tokens: int = 0
    ) -> None:
        """Count the attempt on its instances at once (a burst sees it before any report does).

        prefill None: chosen later with `route_prefill` (queued_tokens is given there)."""
        self.pool = pool
        self.request_id = request_id
        self.prefill: InstanceLoad | None = None
        self.decode = decode
        self.queued_tokens = 0
        self.stage = Stage.ROUTED
        self.transfer_id: int | None = None
        self.decode_call = None
        self._reserve_call: asyncio.Future | None = None
        self._prefill_open = False
        decode.in_flight_requests += 1
        decode.breaker.on_routed()
        if prefill is not None:
            self.route_prefill(prefill, queued_tokens)

    def route_prefill(self, prefill: InstanceLoad, queued_tokens: int) -> None:
        """The prefill leg: count `queued_tokens` (the prefill tokens this request adds to its
        queue) on `prefill`. Once, before the attempt ends."""
        assert self.prefill is None and self.stage in (Stage.ROUTED, Stage.RESERVED), (self.request_id, self.stage)
        self.prefill = prefill
        self.queued_tokens = queued_tokens
        self._prefill_open = True
        prefill.in_flight_requests += 1
        prefill.in_flight_tokens += queued_tokens
        prefill.total_routed_tokens += queued_tokens
        prefill.breaker.on_routed()

    def reserving(self, call: asyncio.Future) -> None:
        """The Reserve call is in flight: if the attempt ends before it answers, decode may
        still reserve, so its answer is released when it comes."""
        self._reserve_call = call

    def reserved(self, transfer_id: int) -> None:
        self._advance(Stage.ROUTED, Stage.RESERVED)
        self.transfer_id = transfer_id

    def prefilled(self) -> None:
        assert self.prefill is not None, self.request_id
        self._advance(Stage.RESERVED, Stage.PREFILLED)
        self._end_prefill()
        self.prefill.breaker.record_success()

    def decoding(self, call) -> None:
        self._advance(Stage.PREFILLED, Stage.DECODING)
        self.decode_call = call

    def finish(self) -> None:
        """The answer ended normally (on decode, or with the first token)."""
        if self.stage in (Stage.FINISHED, Stage.ABORTED):
            return
        self.decode.breaker.record_success()
        self._close(Stage.FINISHED)

    def abort(self, failure: RequestFailed | None) -> None:
        """End the attempt after a failure (None: the client went away); once only."""
        if self.stage in (Stage.FINISHED, Stage.ABORTED):
            return
        for inst in (self.prefill, self.decode):
            if inst is None:
                continue
            if failure is not None and failure.instance is inst:
                inst.breaker.record_failure()
            else:
                inst.breaker.record_neutral()
        self._close(Stage.ABORTED)

    def _close(self, stage: Stage) -> None:
        self.stage = stage
        self._end_prefill()
        if stage == Stage.ABORTED and self.prefill is not None:
            # a cancelled or failed attempt leaves no trace in the routing tie-break, whatever
            # stage it reached: idle, equal instances share new work evenly again
            self.prefill.total_routed_tokens -= self.queued_tokens
        self.decode.in_flight_requests -= 1
        if self.decode_call is not None and not self.decode_call.done():
            self.decode_call.cancel()  # decode frees the pages when it sees the cancel
            if stage == Stage.ABORTED and self.transfer_id is not None:
                # and in case the cancel never reaches it (Generate not yet sent): Release is idempotent
                self._release(self.transfer_id)
        elif self.transfer_id is not None and self.decode_call is None:
            # no stream ever claimed the reservation: give the pages back now (a frozen
            # decode frees them itself when the reservation's deadline passes)
            self._release(self.transfer_id)
        elif self.transfer_id is None and self._reserve_call is not None:
            # ended while Reserve was in flight (or as its answer arrived, before it was
            # read): decode may have reserved all the same; release whatever it answers
            self._reserve_call.add_done_callback(self._release_late_reservation)

    def _release(self, transfer_id: int) -> None:
        self.pool.spawn(self.pool.release(self.decode, self.request_id, transfer_id))

    def _release_late_reservation(self, call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None:
            self._release(call.result().transfer_id)

    def _end_prefill(self) -> None:
        if not self._prefill_open or self.prefill is None:
            return
        self._prefill_open = False
        self.prefill.in_flight_requests -= 1
        self.prefill.in_flight_tokens -= self.queued_tokens

    def _advance(self, expected: Stage, to: Stage) -> None:
        assert self.stage == expected, (self.request_id, self.stage, to)
        self.stage = to
