"""The gateway's answer -> Anthropic's Messages objects: the message (text and tool_use content
blocks, stop_reason, usage), its streamed events, and Anthropic's error shape. Pure
translation, no I/O."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.http.sse import sse
from kvmesh.gateway.tools import tool_calls
from kvmesh.protos.v1 import gateway_pb2

ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error type of each HTTP status kvmesh answers (any other: api_error)."""


def error(status: int, message: str) -> dict:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPE.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error(status, message), status_code=status, headers=headers)


def new_id(prefix: str) -> str:
    """An id as Anthropic's look: `prefix` + 24 random base-62-ish characters (hex here)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache (cache_read_input_tokens)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


@dataclass
class Content:
    blocks: list[dict]
    stop_reason: str
    stop_sequence: str | None


def content_of(ask: OpenAIRequest, text: str, final: gateway_pb2.Final) -> Content:
    """The content blocks of a whole answer (a text block unless the answer is only tool calls;
    a tool_use block per call) and why it stopped: tool_use, max_tokens, stop_sequence or end_turn."""
    content: str | None = text
    calls: list[dict] = []
    if ask.tools is not None:
        content, calls = tool_calls(ask.tools, text)
    blocks: list[dict] = []
    if content or not calls:
        blocks.append({"type": "text", "text": content or ""})
    for call in calls:
        fn = call["function"]
        blocks.append(
            {"type": "tool_use", "id": new_id("toolu"), "name": fn["name"], "input": json.loads(fn["arguments"])}
        )
    if calls:
        return Content(blocks, "tool_use", None)
    if final.finish_reason == "length":
        return Content(blocks, "max_tokens", None)
    if final.stop_sequence:
        return Content(blocks, "stop_sequence", final.stop_sequence)
    return Content(blocks, "end_turn", None)


def message(message_id: str, model: str, content: Content | None, use: dict) -> dict:
    """The message object (content None: the empty one message_start carries)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content.blocks if content else [],
        "stop_reason": content.stop_reason if content else None,
        "stop_sequence": content.stop_sequence if content else None,
        "usage": use,
    }


class MessageEvents:
    """Anthropic's streamed events, each an SSE `event:` line and its `data:`."""

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, kind)

    def block_start(self, index: int, block: dict) -> bytes:
        opened = {**block, "input": {}} if block["type"] == "tool_use" else {**block, "text": ""}
        return self.event("content_block_start", index=index, content_block=opened)

    def text_delta(self, index: int, text: str) -> bytes:
        return self.event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})

    def block_stop(self, index: int) -> bytes:
        return self.event("content_block_stop", index=index)

    def whole_block(self, index: int, block: dict) -> list[bytes]:
        """A block sent whole at the end (the answer was held back for tool calls)."""
        if block["type"] == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        else:
            delta = {"type": "text_delta", "text": block["text"]}
        return [
            self.block_start(index, block),
            self.event("content_block_delta", index=index, delta=delta),
            self.block_stop(index),
        ]

    def end(self, content: Content, use: dict) -> list[bytes]:
        """message_delta (why it stopped, the usage) and message_stop."""
        delta = {"stop_reason": content.stop_reason, "stop_sequence": content.stop_sequence}
        return [self.event("message_delta", delta=delta, usage=use), self.event("message_stop")]
