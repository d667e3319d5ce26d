"""OpenAI's Responses API request (POST /v1/responses, https://platform.openai.com/docs/api-reference/responses)
-> the body of a chat completion, which the OpenAI front already serves (chat_completions.parse_chat):
one request path, so validation, admission, priorities, sessions and tracing are chat's.

`input` (a string, or a list of items: messages with text parts, `function_call`,
`function_call_output`) becomes chat messages; `instructions` a system message first (this
turn's only: OpenAI does not carry instructions over `previous_response_id`); function `tools`
and `tool_choice` chat's; `text.format` chat's response_format; `max_output_tokens` max_tokens;
`top_logprobs` (or `include: ["message.output_text.logprobs"]`) logprobs. Every field OpenAI
documents is read here, honoured or refused with a 400 naming it (REFUSED); an unknown field is
a 400 too, as OpenAI answers it. Pure translation, no I/O.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.gateway.http.fields import BadField, get_field, off, refuse_unsupported

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one `include` value kvmesh honours: each output text part carries its tokens' logprobs."""

REFUSED: dict[str, Callable[[Any], bool]] = {
    "background": off(False),
    "conversation": off(),
    "prompt": off(),
    "reasoning": off({}),
    "max_tool_calls": off(),
    "service_tier": off("auto", "default"),
}
"""Responses fields kvmesh does not implement, each with the test for the value that turns it
off: any other value is a 400 naming the field (background runs, conversation objects, stored
prompt templates, reasoning, a cap on built-in tool calls, service tiers)."""

ACCEPTED = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "top_logprobs",
    "include",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "store",
    "previous_response_id",
    "truncation",
    "stream",
    "stream_options",
}
"""The fields read (with REFUSED's): any other is a 400, "Unknown parameter"."""

ECHOED = ("max_output_tokens", "temperature", "top_p", "top_logprobs", "parallel_tool_calls", "user")
"""Request fields a Response object repeats as they were sent (its defaults where absent)."""

TEXT_PARTS = {"input_text", "output_text", "text"}

_PARAM_OF_CHAT = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "message roles": "input",
    "prompt": "input",
}
"""A chat field an error names -> the Responses field the client sent."""


def param_of_chat(param: str | None) -> str | None:
    """The Responses field behind a chat field named in an error (None stays None)."""
    return _PARAM_OF_CHAT.get(param, param) if param else param


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: `prefix` + 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass(frozen=True)
class ResponsesRequest:
    """One POST /v1/responses, read: this turn's messages and the chat fields to send with them."""

    items: list[dict]
    """This turn's input items, each with an id (what GET .../input_items lists)."""
    messages: list[dict]
    """This turn's input as chat messages ({"role", "content", "tool_calls"?, "tool_call_id"?})."""
    instructions: str | None
    sampling: dict
    """The chat completion fields of this turn: model, tools, tool_choice, response_format, max_tokens, ..."""
    store: bool
    previous_response_id: str | None
    stream: bool
    truncation: str
    """"disabled" (a conversation too long for the context is a 400) or "auto" (its oldest turns are dropped)."""
    echoed: dict = field(default_factory=dict)
    """What the Response object repeats of the request (tools, tool_choice, text, metadata, ECHOED)."""

    def chat_body(self, history: list[dict]) -> dict:
        """The chat completion body of this turn after `history` (the chat messages of the
        previous responses, their outputs included), this turn's instructions first."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {**self.sampling, "messages": system + history + self.messages}


def read_responses(body: Any) -> ResponsesRequest:
    """Read a POST /v1/responses body. Raises BadField (HTTP 400) naming the field: a body that
    is not an object, an unknown field, a REFUSED field that is not off, a mistyped field, an
    input item kvmesh cannot take (images, files, built-in tools' items)."""
    if not isinstance(body, dict):
        raise BadField("the body must be a JSON object", None)
    unknown = sorted(set(body) - ACCEPTED - set(REFUSED))
    if unknown:
        raise BadField(f"Unknown parameter: '{unknown[0]}'.", unknown[0])
    refuse_unsupported(body, REFUSED)
    items, messages = read_input(body.get("input"))
    instructions = get_field(body, "instructions", (str,), "a string")
    store = get_field(body, "store", (bool,), "a boolean")
    previous = get_field(body, "previous_response_id", (str,), "a string")
    truncation = get_field(body, "truncation", (str,), "a string") or "disabled"
    if truncation not in ("disabled", "auto"):
        raise BadField(f"truncation must be 'disabled' or 'auto', got {truncation[:40]!r}", "truncation")
    metadata = _metadata(body)
    sampling, echoed = _sampling(body)
    return ResponsesRequest(
        items=items,
        messages=messages,
        instructions=instructions,
        sampling=sampling,
        store=store is not False,  # OpenAI's default: stored
        previous_response_id=previous,
        stream=get_field(body, "stream", (bool,), "a boolean") or False,
        truncation=truncation,
        echoed={**echoed, "metadata": metadata, "truncation": truncation, "instructions": instructions},
    )


def _metadata(body: dict) -> dict:
    """`metadata`: at most 16 string pairs (keys up to 64 characters, values up to 512)."""
    metadata = get_field(body, "metadata", (dict,), "an object") or {}
    if len(metadata) > 16 or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
    ):
        raise BadField("metadata must hold at most 16 string keys (64 characters) and values (512)", "metadata")
    return metadata


def _sampling(body: dict) -> tuple[dict, dict]:
    """(the chat completion fields of the request's own, what the Response repeats of them)."""
    chat: dict = {"model": get_field(body, "model", (str,), "a string") or ""}
    for name, chat_name in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens")):
        value = get_field(body, name, (int, float) if name != "max_output_tokens" else (int,), "a number")
        if value is not None:
            chat[chat_name] = value
    top_k = get_field(body, "top_k", (int,), "an integer")  # vLLM's extension, as on chat
    if top_k is not None:
        chat["top_k"] = top_k
    include = get_field(body, "include", (list,), "a list") or []
    for value in include:
        if value != LOGPROBS_INCLUDE:
            raise BadField(f"include: {json.dumps(value)[:60]} is not supported (only {LOGPROBS_INCLUDE!r})", "include")
    top = get_field(body, "top_logprobs", (int,), "an integer")
    if top is not None or include:
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        get_field(body, name, (str,), "a string")  # accepted, no effect (abuse tracking; kvmesh caches every prefix)
    options = get_field(body, "stream_options", (dict,), "an object") or {}
    get_field(options, "include_obfuscation", (bool,), "a boolean")  # no obfuscation to turn off
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    parallel = get_field(body, "parallel_tool_calls", (bool,), "a boolean")
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    text = get_field(body, "text", (dict,), "an object") or {}
    if text.get("verbosity") not in (None, "medium"):
        raise BadField("text.verbosity is not supported by this server; leave it out", "text.verbosity")
    response_format = _format(text.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    echoed = {name: body.get(name) for name in ECHOED}
    echoed.update(
        tools=body.get("tools") or [],
        tool_choice=body.get("tool_choice") or "auto",
        text={"format": text.get("format") or {"type": "text"}},
    )
    return chat, echoed


def _tools(body: dict) -> list[dict]:
    """Function tools ({"type": "function", "name", "description"?, "parameters"?, "strict"?})
    as chat's; any other tool type (the built-in web_search, file_search, ...) is refused."""
    tools = get_field(body, "tools", (list,), "a list of tools") or []
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadField(
                f"tools[{i}]: tools of type {json.dumps(kind)[:40]} are not supported (function only)", "tools"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    """tool_choice: none, auto, required, or {"type": "function", "name"} (chat's named function)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadField("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _format(fmt: Any) -> dict | None:
    """text.format -> chat's response_format: text (none), json_object, or json_schema
    ({"name", "schema", "strict"?}, flat in the Responses API)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadField("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def read_input(raw: Any) -> tuple[list[dict], list[dict]]:
    """(the input items, each with an id; the chat messages they make). Raises BadField naming
    the item at fault."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise BadField("input must be a string or a non-empty list of items", "input")
    items: list[dict] = []
    messages: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadField(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message_item(item, where))
            messages.append({"role": _ROLES[item["role"]], "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            items.append(_call_item(item, where))
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            items.append(_output_item(item, where))
            messages.append(
                {"role": "tool", "content": _text_of(item["output"], where), "tool_call_id": item["call_id"]}
            )
        else:
            raise BadField(
                f"{where}: items of type {json.dumps(kind)[:40]} are not supported "
                "(message, function_call and function_call_output are)",
                where,
            )
    return items, messages


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _message_item(item: dict, where: str) -> dict:
    """A message item as stored: {"type": "message", "id", "role", "content": [text parts]}."""
    if item.get("role") not in _ROLES:
        raise BadField(f"{where}.role must be one of {sorted(_ROLES)}", where)
    content = item.get("content")
    part_type = "output_text" if item["role"] == "assistant" else "input_text"
    parts = [{"type": part_type, "text": content}] if isinstance(content, str) else content
    _text_of(parts, where)
    return {
        "type": "message",
        "id": _item_id(item, "msg", where),
        "role": item["role"],
        "content": parts,
        "status": "completed",
    }


def _call_item(item: dict, where: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise BadField(f"{where}.{name} must be a string", where)
    try:
        json.loads(item["arguments"])
    except (ValueError, RecursionError):
        raise BadField(f"{where}.arguments must be JSON text", where) from None
    return {
        "type": "function_call",
        "id": _item_id(item, "fc", where),
        "call_id": item["call_id"],
        "name": item["name"],
        "arguments": item["arguments"],
        "status": "completed",
    }


def _output_item(item: dict, where: str) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise BadField(f"{where}.call_id must be a string", where)
    _text_of(item.get("output"), where)
    return {
        "type": "function_call_output",
        "id": _item_id(item, "fco", where),
        "call_id": item["call_id"],
        "output": item["output"],
        "status": "completed",
    }


def _text_of(content: Any, where: str) -> str:
    """The text of a content: a string, or a list of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadField(f"{where}.content must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadField(
                f"{where}.content[{j}]: parts of type {json.dumps(kind)[:40]} are not supported (text only)", where
            )
        texts.append(part["text"])
    return "".join(texts)


def check_tool_outputs(messages: list[dict]) -> None:
    """Every function_call_output answers a function call made earlier in the conversation
    (OpenAI's 400 otherwise). Raises BadField naming the call id."""
    called: set[str] = set()
    for m in messages:
        called.update(c["id"] for c in m.get("tool_calls", ()))
        if m["role"] == "tool" and m.get("tool_call_id") not in called:
            raise BadField(
                f"No tool call found for function call output with call_id {m.get('tool_call_id')}.", "input"
            )


def _item_id(item: dict, prefix: str, where: str) -> str:
    """An input item's id: the client's (a string of at most 128 characters) or a new one."""
    given = item.get("id")
    if given is None:
        return new_id(prefix)
    if not isinstance(given, str) or not 0 < len(given) <= 128:
        raise BadField(f"{where}.id must be a string of at most 128 characters", where)
    return given
