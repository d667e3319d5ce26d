"""OpenAI Chat Completions (POST /v1/chat/completions, https://platform.openai.com/docs/api-reference/chat):
the body's own fields (messages, tools, chat's logprobs) and its translation, `parse_chat`.

Messages go through the model's chat template at the gateway's prompt builder; an assistant's
earlier tool calls are shown as the JSON array the tool prompt asks for (kvmesh.gateway.tools), so
the model sees what it called. Chat `tools` are described in the system message and, for
tool_choice required or a named function, enforced by a grammar (kvmesh.gateway.tools.call_schema).
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.engine.sampling_params import MAX_LOGPROBS
from kvmesh.gateway.http.fields import BadField, get_field, refuses_out_of_range
from kvmesh.gateway.http.grammar import read_grammar
from kvmesh.gateway.http.openai_request import OpenAIRequest, generate_options, new_request, read_shared
from kvmesh.gateway.tools import ToolError, ToolRequest, call_schema, parse_tools, tool_schemas
from kvmesh.protos.v1 import gateway_pb2

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""OpenAI's message roles -> the chat template's ("developer" is OpenAI's newer name for system)."""


@refuses_out_of_range
def parse_chat(body: Any, request_id: str = "", tool_parser: str = "json") -> OpenAIRequest:
    """Translate the JSON body of /v1/chat/completions: messages through the chat template.

    `request_id` (from an X-Request-Id header) names the request; empty: a new uuid.
    `tool_parser` (kvmesh.gateway.tools.TOOL_PARSERS) finds calls in a free answer.
    Raises BadField for a body that is not an object, a missing or mistyped field, n outside
    [1, 128], a field of /v1/completions, or an UNSUPPORTED field that is not off.
    """
    shared = read_shared(body)
    logprobs = read_logprobs(body)
    for name, off in (("echo", False), ("best_of", 1)):
        if body.get(name) not in (None, off):
            raise BadField(f"{name} is for /v1/completions", name)
    sampling = generate_options(shared, logprobs)
    grammar_field, grammar = read_grammar(body)
    tools = read_tools(body, tool_parser)
    schema = call_schema(tools) if tools is not None else None
    if schema is not None:
        if grammar is not None:
            raise BadField(f"this tool_choice constrains the answer: send no {grammar_field} with it", grammar_field)
        grammar_field, grammar = "tools", ("json_schema", schema)
    request = new_request(request_id, shared.model, sampling, grammar)
    request.messages.extend(read_messages(body))
    if tools is not None:  # rendered by the gateway's prompt builder (chat template or system message)
        request.tools = json.dumps(tool_schemas(tools), ensure_ascii=False)
    return OpenAIRequest(
        request=request,
        chat=True,
        stream=shared.stream,
        include_usage=shared.include_usage,
        grammar_field=grammar_field,
        tools=tools,
        n=shared.n or 1,
        logprobs=logprobs is not None,
    )


def read_logprobs(body: dict) -> int | None:
    """How many top alternatives each token's logprobs list (None: no logprobs): `logprobs` (a
    boolean) with `top_logprobs` (0..MAX_LOGPROBS)."""
    wanted = get_field(body, "logprobs", (bool,), "a boolean")
    top = get_field(body, "top_logprobs", (int,), "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadField(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if top is not None and not wanted:
        raise BadField("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if wanted else None


def read_tools(body: dict, tool_parser: str) -> ToolRequest | None:
    """The request's tools and tool_choice (kvmesh.gateway.tools.parse_tools); None: no tools."""
    try:
        return parse_tools(body, tool_parser)
    except ToolError as exc:
        raise BadField(str(exc), exc.param) from None


def read_messages(body: dict) -> list[gateway_pb2.ChatMessage]:
    """The conversation: a non-empty list of {"role", "content"} objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField(f"{where} must be an object with a string role", where)
        role = CHAT_ROLES.get(m["role"], m["role"])  # an unknown role: the request path names the allowed ones
        out.append(gateway_pb2.ChatMessage(role=role, content=_content(m, where)))
    return out


def _content(m: dict, where: str) -> str:
    """A message's text; an assistant's earlier tool calls are shown as the JSON array the tool
    prompt asks for (kvmesh.gateway.tools), so the model sees what it called."""
    text = _text(m.get("content"), f"{where}.content")
    calls = m.get("tool_calls")
    if m.get("role") == "assistant" and calls:
        shown = _shown_calls(calls, where)
        text = (text + "\n" if text else "") + json.dumps(shown, ensure_ascii=False)
    return text


def _shown_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls as [{"name", "arguments"}], arguments parsed from their JSON text."""
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
    ):
        raise BadField(f"{where}.tool_calls must be a list of function calls", f"{where}.tool_calls")
    shown = []
    for c in calls:
        fn = c["function"]
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError, RecursionError):
            raise BadField(f"{where}.tool_calls: arguments must be JSON text", f"{where}.tool_calls") from None
        shown.append({"name": fn.get("name"), "arguments": arguments})
    return shown


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadField(f"{where}[{i}] must be a text part {{'type': 'text', 'text': '...'}}", where)
            texts.append(part["text"])
        return "".join(texts)
    raise BadField(f"{where} must be a string or a list of text parts", where)
