"""gRPC adapter for the decode engine: Reserve, Generate (stream), Release, GetStats.

A request's life on this side is one `kvmesh.engine.request.Request` in the engine's table (its pages,
its stream) with its landing and expiry kept by kvmesh.decode_svc.transfers.Transfers. Reserve and
Generate are call objects whose methods are their steps (kvmesh.decode_svc.reserve_call,
kvmesh.decode_svc.generate_call): they validate, map errors to statuses (kvmesh.runtime.wire.abort
with a FailureCause) and stream tokens.
"""

from __future__ import annotations

import logging

import grpc

from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.decode_svc.generate_call import GenerateCall
from kvmesh.decode_svc.parts import DecodeParts
from kvmesh.decode_svc.reserve_call import ReserveCall
from kvmesh.decode_svc.transfers import Transfers
from kvmesh.engine.precision import dtype_name
from kvmesh.kvstore.transport import KVPushReceiver
from kvmesh.protos.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from kvmesh.runtime import tracing
from kvmesh.runtime.served_model import ServedModel

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Reservations live in the engine's table (landing and expiry: Transfers); pages are freed
    only once no push can still land in them."""

    def __init__(self, engine: DecodeEngine, receiver: KVPushReceiver, model: ServedModel) -> None:
        self.engine = engine
        self.receiver = receiver
        self.model = model
        self.transfers = Transfers(engine, receiver)
        self.parts = DecodeParts(engine, self.transfers, receiver, model)
        self.draining = False

    async def drain(self, timeout_s: float) -> None:
        """Shutting down: refuse new reservations (UNAVAILABLE: the gateway reserves on another
        decode), then wait up to timeout_s seconds until every reservation made is claimed by its
        Generate or ended, so that no request whose first token prefill already sent finds the
        server closed."""
        self.draining = True
        left = await self.transfers.wait_claimed(timeout_s)
        if left:
            logger.warning("%d reservations still unclaimed after the drain grace", left)

    async def Reserve(self, request, context):
        """Reserve pages for a request's KV and answer where its push goes
        (kvmesh.decode_svc.reserve_call.ReserveCall: the steps)."""
        with tracing.server_span("decode.reserve", context, request.request_id, self.model.instance_id) as span:
            response = await ReserveCall(self.parts, request, context).run(self.draining)
            span.set_attributes(
                {
                    "kvmesh.kv.prompt_pages": response.num_pages,
                    "kvmesh.kv.decode_cached_pages": response.num_cached_pages,
                    "kvmesh.transfer_id": format(response.transfer_id, "x"),
                }
            )
            return response

    async def Release(self, request, context):
        return decode_pb2.ReleaseResponse(released=self.transfers.release(request.transfer_id, "Release"))

    async def Generate(self, request, context):
        """Wait for the request's KV, decode it in the batch and stream its tokens
        (kvmesh.decode_svc.generate_call.GenerateCall: the steps). The request's decode span
        continues the caller's trace (prefill's KV push)."""
        with tracing.server_span("decode.generate", context, request.request_id, self.model.instance_id) as span:
            async for msg in GenerateCall(self.parts, request, context, span).run():
                yield msg

    async def GetStats(self, request, context):
        if self.engine.broken:  # gateways stop routing here, as to an instance that does not answer
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode cannot step any more: {self.engine.broken}")
        stats = self.engine.stats()
        return common_pb2.InstanceStats(
            instance_id=self.model.instance_id,
            page_size=self.engine.config.page_size,
            model_fingerprint=self.model.fingerprint,
            max_requests=self.engine.config.max_batch_size,
            kv_address=self.receiver.address,
            kv_layout=self.engine.runner.page_layout.describe(),
            dtype=dtype_name(self.engine.runner.dtype),
            num_kv_pushes_sent=self.receiver.num_sent,
            num_kv_pushes_pulled=self.receiver.num_pulled,
            **stats,
        )
