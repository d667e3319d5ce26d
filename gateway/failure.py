"""Why an attempt at the gateway failed, as one exception whose cause fixes the client's status.

`failure_from_rpc` reads a failed call to a prefill or decode instance: the cause its service
named in the trailers (kvmesh.runtime.wire.abort), else one read from the gRPC status, and the
instance the failure is blamed on (its circuit breaker counts it).
"""

from __future__ import annotations

import grpc

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.runtime.wire import cause_of, retry_after_of


class RequestFailed(Exception):
    """Why an attempt failed: the cause (which fixes the client's status), a message that
    names the instance, and the instance to blame (None when none is at fault)."""

    def __init__(
        self,
        cause: FailureCause,
        message: str,
        instance: InstanceLoad | None = None,
        retry_after_s: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.instance = instance
        self.retry_after_s = retry_after_s
        self.param = param
        """The request field at fault (OpenAI's error `param`), when one is."""
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

    A service names its cause in the trailers (kvmesh.runtime.wire.abort); a call that failed in
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
