"""Server-sent events: how a streamed answer is framed on the wire, whatever API it answers
(kvmesh.gateway.http.streaming.EventStream sends them)."""

from __future__ import annotations

import json

DONE = "[DONE]"
"""The data of the event that ends an OpenAI stream."""


def sse(data: dict | str, event: str = "") -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the string),
    after an `event: <name>` line when `event` is given (the Responses and Messages APIs' typed
    events)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()
