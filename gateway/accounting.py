"""One attempt's stages and the gateway's accounting on its two instances.

    routed -> reserved -> prefilled -> decoding -> finished
       \\________\\___________\\___________\\-------> aborted

An attempt is counted on its instances the moment it is routed (a burst sees it before any
stats report does): a request in flight on decode, and on prefill a request in flight plus
the prefill tokens it adds to the queue. `finish()` and `abort(failure)` end it exactly once:
an aborted attempt's routed tokens are undone (the cache_aware tie-break forgets it), an open
decode stream is cancelled, a reservation no stream claimed is released (one answered after
the end too), and the instance a failure is blamed on counts it in its circuit breaker.
The calls that move an attempt along its stages are in gateway/attempt.py.
"""

from __future__ import annotations

import asyncio
import enum

from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.instance_load import InstanceLoad


class Stage(enum.Enum):
    """Where an attempt is (module docstring); FINISHED and ABORTED are its ends."""

    ROUTED = "routed"
    RESERVED = "reserved"
    PREFILLED = "prefilled"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


class AttemptAccounting:
    """The stages of one try of one request and the gateway's accounting on its instances;
    the stages need no call (tests drive them by hand).

    Args:
        pool: spawns background tasks and sends Release (kvmesh.gateway.pool.InstancePool).
        request_id: the request's id, for messages and Release.
        prefill: the prefill instance, or None to route it later with `route_prefill`.
        decode: the decode instance.
        queued_tokens: prefill tokens this request adds to `prefill`'s queue.
    """

    def __init__(
        self, pool, request_id: str, prefill: InstanceLoad | None, decode: InstanceLoad, queued_tokens: int = 0
    ) -> None:
        self.pool = pool
        self.request_id = request_id
        self.prefill: InstanceLoad | None = None
        self.decode = decode
        self.queued_tokens = 0
        self.stage = Stage.ROUTED
        self.transfer_id: int | None = None
        """The transfer id decode reserved under (None until Reserve answered)."""
        self.decode_call = None
        self._prefill_open = False
        self._reserve_call: asyncio.Future | None = None
        # counted on its instances at once: a burst sees it before any report does
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
        if self.transfer_id is not None and (stage == Stage.ABORTED or self.decode_call is None):
            # aborted: the cancel may never reach decode, even where the call is done already
            # (grpc.aio cancels a call whose awaiting task is cancelled, and one cancelled before
            # Generate went out never arrives: its reservation would hold the pages until its KV
            # deadline, ~40 s). Release is idempotent. Finished with no stream (the first token
            # was the whole answer): nothing claimed the reservation. A frozen decode frees the
            # pages itself when the reservation's deadline passes.
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
