"""The Gateway gRPC service: a thin adapter over kvmesh.gateway.request_path.RequestPath.

The caller's key comes from the `authorization` metadata ("Bearer <key>"); a RequestFailed
from the path ends the RPC with its cause's status (kvmesh.runtime.wire.abort), and a retry hint
in the trailing metadata (`retry-after-s`, and `retry-after` as HTTP spells it) when the
request was over a bound.
"""

from __future__ import annotations

from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.request_path import RequestPath
from kvmesh.protos.v1 import gateway_pb2_grpc
from kvmesh.runtime.wire import abort


def _authorization(context) -> str | None:
    return next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate and ListModels over the shared request path."""

    def __init__(self, path: RequestPath) -> None:
        self.path = path

    async def ListModels(self, request, context):
        """The served model and its limits; UNAUTHENTICATED without a known key."""
        try:
            return self.path.models(_authorization(context))
        except RequestFailed as failure:
            await abort(context, failure.cause, str(failure))

    async def Generate(self, request, context):
        """Stream the answer (deltas, then `final`); a failure ends the RPC with its cause's status."""
        metadata = context.invocation_metadata() or ()
        try:
            async for msg in self.path.generate(request, metadata, _authorization(context)):
                yield msg
        except RequestFailed as failure:
            await abort(context, failure.cause, str(failure), retry_after_s=failure.retry_after_s)
