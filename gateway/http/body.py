"""Reading a request's JSON body, bounded, for every POST API of the HTTP front: a body past
the bound is a 413 before it is parsed (at once when its Content-Length says so), one that does
not arrive within BODY_READ_S a 408 (a slow client holds a connection and its buffer no longer),
one that is not JSON (or nests too deeply for the parser) a 400."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.http.errors import Refused, error_response

BODY_READ_S = 30.0
"""Seconds a request's body may take to arrive, whole (a 64 MiB body at 2.2 MB/s)."""


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request's body, parsed as JSON (any JSON value: the API checks its shape).

    Raises Refused: a 413 when the Content-Length header or the bytes come past `max_bytes`, a
    408 when the body has not come whole within BODY_READ_S seconds, a 400 when it is not JSON
    or nests too deeply."""
    too_big = Refused(
        error_response(413, f"the body is over {max_bytes >> 20} MiB; send a shorter prompt", FailureCause.BAD_REQUEST)
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    raw = bytearray()
    try:
        async with asyncio.timeout(BODY_READ_S):
            async for part in request.stream():
                raw += part
                if len(raw) > max_bytes:
                    raise too_big
    except TimeoutError:
        raise Refused(
            error_response(408, f"the body did not arrive within {BODY_READ_S:.0f} s", FailureCause.BAD_REQUEST)
        ) from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused(error_response(400, "the body is not valid JSON", FailureCause.BAD_REQUEST)) from None
    except RecursionError:
        raise Refused(error_response(400, "the body nests too deeply", FailureCause.BAD_REQUEST)) from None
    if _has_lone_surrogate(raw, body):
        raise Refused(
            error_response(
                400,
                "the body holds a lone surrogate escape (\\uD800-\\uDFFF): text must be valid Unicode",
                FailureCause.BAD_REQUEST,
            )
        )
    return body


def _has_lone_surrogate(raw: bytes | bytearray, body: Any) -> bool:
    """Whether a string of `body` holds half of a UTF-16 surrogate pair, which no UTF-8 text (a
    prompt, a protobuf string, an answer) can carry. Only a \\uD8xx-\\uDFxx escape in the raw
    JSON makes one, so bodies without such an escape are not walked."""
    if not re.search(rb"\\u[dD][89a-fA-F]", raw):
        return False
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
