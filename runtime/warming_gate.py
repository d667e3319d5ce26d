"""The gate every kvmesh gRPC server keeps shut while its service starts: until the model is warm
and the service admits work (`Service.admit`), every RPC but health checks and reflection ends
UNAVAILABLE with failure cause INSTANCE_LOST, so the caller goes elsewhere and comes back later.

Why: the port opens before the model's warm-up (health answers NOT_SERVING meanwhile), and a
gateway that polls a restarted instance's stats at its old address would otherwise route to it at
once. The warm-up runs a step on page 0, so a request admitted during it could hold page 0 while
the warm-up writes it: its prompt's KV is overwritten, its answer is wrong, and the block is
cached and reused wrong (the soak's wrong answers after decode restarts, issue 45).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kvmesh.engine.outcomes import FailureCause
from kvmesh.runtime.wire import abort

ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Method-name prefixes the gate never stops: a starting service answers its health checks."""

RETRY_AFTER_S = 1.0


class WarmingGate(grpc.aio.ServerInterceptor):
    """Refuses every RPC (but ALWAYS_OPEN's) while `is_open()` is False; `name` goes in the message."""

    def __init__(self, name: str, is_open: Callable[[], bool]) -> None:
        self.name = name
        self.is_open = is_open

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self.is_open() or method.startswith(ALWAYS_OPEN):
            return handler
        return _refusing(handler, f"{self.name} is starting (its model warms up): {method} refused, try elsewhere")


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind and serializers that ends the call UNAVAILABLE (INSTANCE_LOST)."""

    async def refuse(_request, context) -> None:
        await abort(context, FailureCause.INSTANCE_LOST, message, retry_after_s=RETRY_AFTER_S)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
