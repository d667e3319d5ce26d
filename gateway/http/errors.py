"""What a refused or failed request answers over HTTP: the HTTP status of the request path's
gRPC status (HTTP_STATUS), OpenAI's error object, and Retry-After on a 429.

A RequestFailed from the path carries a cause whose gRPC status (kvmesh.runtime.wire.status_of)
fixes the HTTP one here, so HTTP and gRPC clients read the same failure the same way.
"""

from __future__ import annotations

import math

import grpc
from starlette.responses import JSONResponse

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.failure import RequestFailed
from kvmesh.runtime.wire import status_of

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""The HTTP status of each gRPC status the request path produces; any other is a 500 (a mesh
set up wrong, FAILED_PRECONDITION, is the server's fault, not the caller's)."""

_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_ERROR_CODE = {
    FailureCause.UNAUTHENTICATED: "invalid_api_key",
    FailureCause.UNKNOWN_MODEL: "model_not_found",
    FailureCause.OVERLOADED: "rate_limit_exceeded",
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status (see HTTP_STATUS)."""
    return HTTP_STATUS.get(code, 500)


def error(status: int, message: str, cause: FailureCause | None = None, param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    code = _ERROR_CODE.get(cause, cause.value.lower()) if cause is not None else None
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def failure_error(failure: RequestFailed) -> dict:
    """OpenAI's error object of a RequestFailed (what a stream's error event carries)."""
    return error(http_status(status_of(failure.cause)), str(failure), failure.cause)


def error_response(
    status: int, message: str, cause: FailureCause | None, param: str | None = None, retry_after_s: float | None = None
) -> JSONResponse:
    """OpenAI's error object with `status` (and Retry-After, whole seconds, when given)."""
    headers = {"retry-after": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse(error(status, message, cause, param), status_code=status, headers=headers)


def failure_response(failure: RequestFailed, param: str | None = None) -> JSONResponse:
    """The HTTP answer to a RequestFailed: the status of its cause's gRPC status; `param`
    names the field at fault (an unknown model's is `model`)."""
    retry = failure.retry_after_s
    if failure.cause == FailureCause.OVERLOADED and retry is None:
        retry = 1.0
    if failure.cause == FailureCause.UNKNOWN_MODEL:
        param = "model"
    return error_response(http_status(status_of(failure.cause)), str(failure), failure.cause, param, retry)


class Refused(Exception):
    """A request answered before it reaches the request path (no key, a body too big, not
    JSON, a bad field): `response` is its answer."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response
