"""The gateway's answer -> OpenAI's Responses objects: the Response (its output items: an
assistant message of output_text, or function_call items when the answer calls tools), usage,
and the typed events of a streamed one, each with its sequence number. Pure translation, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.http.responses_request import ResponsesRequest, new_id
from kvmesh.gateway.http.sse import sse
from kvmesh.gateway.tools import tool_calls
from kvmesh.protos.v1 import gateway_pb2


def envelope(response_id: str, read: ResponsesRequest, model: str, created: int, previous: str | None) -> dict:
    """A Response object with no output yet (status "in_progress"): what response.created carries."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "previous_response_id": previous,
        "reasoning": {"effort": None, "summary": None},
        "store": read.store,
        "usage": None,
        **read.echoed,
        **{k: d if read.echoed.get(k) is None else read.echoed[k] for k, d in _DEFAULTS.items()},
    }


_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "parallel_tool_calls": True}
"""What a Response shows for these fields when the request left them out (OpenAI's defaults)."""


def usage(final: gateway_pb2.Final) -> dict:
    """The Responses `usage` (tokens): cached_tokens are the prompt tokens prefill reused."""
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.generated_tokens,
    }


@dataclass
class Output:
    """A whole answer's output items, and the chat message that shows it in the next turn's prompt."""

    items: list[dict]
    message: dict
    """{"role": "assistant", "content", "tool_calls"?}: how the next turn's prompt shows this answer."""
    text: str = ""
    calls: list[dict] = field(default_factory=list)


def output_of(ask: OpenAIRequest, text: str, logprobs: list[dict] | None, message_id: str = "") -> Output:
    """The output items of a whole answer `text`: function_call items when the request's tools
    parser finds calls in it (and a message of the rest, if any), else one message with one
    output_text part (`logprobs`: its tokens', chat's entries, when asked for)."""
    content: str | None = text
    calls: list[dict] = []
    if ask.tools is not None:
        content, calls = tool_calls(ask.tools, text)
    items = []
    if content:
        items.append(message_item(message_id or new_id("msg"), content, logprobs, "completed"))
    for call in calls:
        fn = call["function"]
        items.append(call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = calls
    return Output(items, message, content or "", calls)


def message_item(item_id: str, text: str | None, logprobs: list[dict] | None, status: str) -> dict:
    """An assistant message item (text None: no content part yet)."""
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def text_part(text: str, logprobs: list[dict] | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(logprobs)}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _logprobs(entries: list[dict] | None) -> list[dict]:
    """Chat's logprobs entries ({"token", "logprob", "bytes", "top_logprobs"}) as the Responses
    API's, which are the same objects."""
    return list(entries or [])


def finished(base: dict, output: Output, final: gateway_pb2.Final) -> dict:
    """The Response once its answer is whole: status "completed", or "incomplete" with reason
    max_output_tokens when the answer ran out of tokens (a tool call cut short has no call)."""
    status, details = "completed", None
    if final.finish_reason == "length" and not output.calls:
        status, details = "incomplete", {"reason": "max_output_tokens"}
    return {**base, "status": status, "incomplete_details": details, "output": output.items, "usage": usage(final)}


def failed(base: dict, code: str, message: str) -> dict:
    """The Response of a request that failed after its stream began."""
    return {**base, "status": "failed", "error": {"code": code, "message": message}}


class ResponseEvents:
    """The typed events of one streamed response, numbered as they go out (sequence_number
    from 0), each an SSE `event:` line and its `data:`."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data, kind)

    def text_start(self, index: int, item_id: str) -> list[bytes]:
        """A message item opened, and its output_text part."""
        return [
            self.event(
                "response.output_item.added", output_index=index, item=message_item(item_id, None, None, "in_progress")
            ),
            self.event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=text_part("", None),
            ),
        ]

    def text_delta(self, index: int, item_id: str, delta: str, logprobs: list[dict] | None) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=delta,
            logprobs=_logprobs(logprobs),
        )

    def text_end(self, index: int, item: dict) -> list[bytes]:
        """A message item's text done, its part done, the item done."""
        part = item["content"][0]
        return [
            self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self.event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def whole_item(self, index: int, item: dict) -> list[bytes]:
        """An item sent whole at the end (the answer was held back for tool calls): a function
        call's arguments as one delta, or a message's text as one."""
        if item["type"] == "message":
            part = item["content"][0]
            return [
                *self.text_start(index, item["id"]),
                self.text_delta(index, item["id"], part["text"], part["logprobs"]),
                *self.text_end(index, item),
            ]
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [
            self.event("response.output_item.added", output_index=index, item=opened),
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
