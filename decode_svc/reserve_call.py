"""One Reserve RPC on a decode instance, as one object whose methods are its steps.

    call = ReserveCall(parts, request, context)
    await call.run(draining)
        refuse_if_unavailable()  draining (shutting down) or broken: INSTANCE_LOST, reserve elsewhere
        check()                  the request id (BAD_REQUEST), page size and KV layout (MISMATCH)
        reserve()                pages in the engine's table, the push expected, the expiry armed
        _to_pb()                 where the push goes and how many leading pages decode holds

Each step ends the RPC with the status its failure maps to (kvmesh.runtime.wire.abort). A
refused Reserve that named its transfer id refuses the push for that id at once (the caller
may have sent Prefill already), so prefill does not wait out its bound.
"""

from __future__ import annotations

import math

from kvmesh.decode_svc.delivery import CapacityError
from kvmesh.decode_svc.parts import DecodeParts
from kvmesh.engine.outcomes import FailureCause
from kvmesh.engine.request import Request
from kvmesh.protos.v1 import decode_pb2
from kvmesh.runtime.wire import abort, check_request_id, kv_layout_mismatch, page_size_mismatch

MAX_KV_DEADLINE_S = 24 * 3600.0
"""The longest a reservation waits for its push and its Generate call (seconds), whatever the
caller's kv_deadline_s says."""


class ReserveCall:
    """One Reserve RPC: `run` takes it through its steps (the module docstring) and returns the
    ReserveResponse, or ends the RPC with the status of what failed."""

    def __init__(self, parts: DecodeParts, request: decode_pb2.ReserveRequest, context) -> None:
        """request: the ReserveRequest; context: its grpc.aio context."""
        self.parts, self.engine = parts, parts.engine
        self.request, self.context = request, context
        self.rid = request.request_id
        self._name = f"decode {parts.model.instance_id}"  # how messages name this instance

    async def run(self, draining: bool) -> decode_pb2.ReserveResponse:
        """The steps, in the order they run. draining: the instance is shutting down."""
        await self.refuse_if_unavailable(draining)
        await self.check()
        reserved = await self.reserve()
        return self._to_pb(reserved)

    async def refuse_if_unavailable(self, draining: bool) -> None:
        """INSTANCE_LOST (UNAVAILABLE: the gateway reserves on another decode) while this
        instance drains or once it cannot step any more."""
        if draining:
            await abort(
                self.context,
                FailureCause.INSTANCE_LOST,
                f"[{self.rid}] {self._name} is draining (shutting down): reserve elsewhere",
            )
        if self.engine.broken:
            await abort(
                self.context,
                FailureCause.INSTANCE_LOST,
                f"[{self.rid}] {self._name} cannot step ({self.engine.broken}): reserve elsewhere",
            )

    async def check(self) -> None:
        """Refuse a bad request id (BAD_REQUEST), another page size or KV layout (MISMATCH)."""
        try:
            check_request_id(self.rid)
        except ValueError as exc:
            await abort(self.context, FailureCause.BAD_REQUEST, str(exc))
        mismatch = page_size_mismatch(self._name, self.engine.config.page_size, self.request.page_size)
        mismatch = mismatch or kv_layout_mismatch(
            self._name, self.engine.runner.page_layout.describe(), self.request.kv_layout
        )
        if mismatch:
            await abort(self.context, FailureCause.MISMATCH, f"[{self.rid}] {mismatch}")

    async def reserve(self) -> Request:
        """Reserve the pages (kvmesh.decode_svc.transfers.Transfers.reserve) until the KV deadline
        (kv_deadline_s, or the config's reservation_timeout_s; at most MAX_KV_DEADLINE_S). A
        prompt and answer past the model's context or a bad count: BAD_REQUEST; no room:
        OVERLOADED with a retry hint of 1 s."""
        request = self.request
        try:
            kv_deadline_s = self._kv_deadline_s()
            reserved = self.parts.transfers.reserve(
                self.rid,
                request.num_prompt_tokens,
                request.max_tokens,
                min(kv_deadline_s, MAX_KV_DEADLINE_S),
                request.transfer_id,
                list(request.block_hashes),
                request.reuse_cached,
                request.n or 1,
            )
        except ValueError as exc:
            self._refuse_push()
            await abort(self.context, FailureCause.BAD_REQUEST, str(exc))
        except CapacityError as exc:
            self._refuse_push()
            await abort(self.context, FailureCause.OVERLOADED, str(exc), retry_after_s=1.0)
        return reserved

    def _kv_deadline_s(self) -> float:
        """Seconds the reservation waits for its push and its Generate call; ValueError when the
        prompt and answer exceed the model's context or the caller's deadline is no number > 0."""
        n, m, max_context = self.request.num_prompt_tokens, self.request.max_tokens, self.parts.model.max_context
        if n + m > max_context:
            raise ValueError(f"num_prompt_tokens ({n}) + max_tokens ({m}) exceeds the context of {max_context} tokens")
        kv_deadline = self.request.kv_deadline_s or self.engine.config.reservation_timeout_s
        if not (math.isfinite(kv_deadline) and kv_deadline > 0):
            raise ValueError(f"kv_deadline_s must be a finite number > 0, got {self.request.kv_deadline_s}")
        return kv_deadline

    def _refuse_push(self) -> None:
        """A Reserve that named its transfer id was refused: a push for that id (the caller may
        have sent Prefill already) is refused at once instead of waiting for a reservation.
        An id already open here belongs to another request and is left alone."""
        transfer_id = self.request.transfer_id
        if transfer_id and not self.parts.transfers.is_open(transfer_id):
            self.parts.receiver.refuse(transfer_id)

    def _to_pb(self, reserved: Request) -> decode_pb2.ReserveResponse:
        """Where the push goes (the receiver's address, the transfer id) and what it fills."""
        return decode_pb2.ReserveResponse(
            kv_address=self.parts.receiver.address,
            transfer_id=reserved.transfer_id,
            num_pages=reserved.num_prompt_pages,
            page_nbytes=self.engine.runner.page_nbytes,
            instance_id=self.parts.model.instance_id,
            num_cached_pages=reserved.num_reused_pages,
        )
