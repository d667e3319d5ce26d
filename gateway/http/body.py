"""Reading a request's JSON body, bounded, for every POST API of the HTTP front: a body past
the bound is a 413 before it is parsed, one that is not JSON (or nests too deeply for the
parser) a 400."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.http.errors import Refused, error_response


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request's body, parsed as JSON (any JSON value: the API checks its shape).

    Raises Refused: a 413 once more than `max_bytes` (bytes) have come, a 400 when the body is
    not JSON or nests too deeply."""
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > max_bytes:
            raise Refused(
                error_response(
                    413, f"the body is over {max_bytes >> 20} MiB; send a shorter prompt", FailureCause.BAD_REQUEST
                )
            )
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused(error_response(400, "the body is not valid JSON", FailureCause.BAD_REQUEST)) from None
    except RecursionError:
        raise Refused(error_response(400, "the body nests too deeply", FailureCause.BAD_REQUEST)) from None
