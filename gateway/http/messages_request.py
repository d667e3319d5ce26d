"""Anthropic's Messages API request (POST /v1/messages, https://docs.anthropic.com/en/api/messages)
-> the body of a chat completion, which the OpenAI front already serves (chat_completions.parse_chat):
one request path, so validation, admission, priorities, sessions and tracing are chat's.

`system` (a string or text blocks) becomes a system message; `messages` with text, `tool_use`
and `tool_result` blocks chat messages (an assistant's tool_use blocks its tool_calls, a user's
tool_result blocks tool messages, first); `tools` ({"name", "description", "input_schema"})
and `tool_choice` (auto / any / tool / none) chat's; `max_tokens` (required) max_tokens;
`stop_sequences` stop; `output_config.format` (a JSON Schema) response_format. Every field the
`anthropic` client (2.17) sends is read here: honoured, accepted with a documented meaning
(ACCEPTED_AS), or refused with a 400 naming it (REFUSED); an unknown field is a 400, as
Anthropic's API answers it ("Extra inputs are not permitted"). Pure translation, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.gateway.http.fields import BadField, get_field, off

REFUSED: dict[str, Callable[[Any], bool]] = {
    "thinking": lambda v: v is None or v == {"type": "disabled"},
    "container": off(),
    "mcp_servers": off([]),
    "context_management": off(),
    "diagnostics": off(),
    "inference_geo": off(),
    "speed": off("standard"),
}
"""Fields kvmesh cannot honour, each with the test for the value that turns it off: any other
is a 400 naming the field (extended thinking, code-execution containers, MCP servers, context
editing, diagnostics, an inference region, fast mode)."""

ACCEPTED_AS = {
    "cache_control": "no effect: every prompt's full blocks are cached; usage.cache_read_input_tokens counts the hits",
    "service_tier": "auto and standard_only are the one tier kvmesh has; another value is a 400",
    "metadata": "metadata.user_id is accepted and not used",
}
"""Fields accepted with the meaning given (docs/http-api.md lists them)."""

READ = {
    "model",
    "messages",
    "max_tokens",
    "system",
    "tools",
    "tool_choice",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "output_config",
}
"""The fields honoured (with ACCEPTED_AS's and REFUSED's): any other is a 400."""

_PARAM_OF_CHAT = {"messages": "messages", "message roles": "messages", "response_format": "output_config.format"}


def param_of_chat(param: str | None) -> str | None:
    """The Messages field behind a chat field named in an error."""
    return _PARAM_OF_CHAT.get(param, param) if param else param


@dataclass(frozen=True)
class MessagesRequest:
    chat: dict
    """The chat completion body (messages, tools, sampling) the request becomes."""
    stream: bool
    stop_sequences: tuple[str, ...]


def read_messages_body(body: Any, count_only: bool = False) -> MessagesRequest:
    """Read a POST /v1/messages body (`count_only`: /v1/messages/count_tokens', where
    max_tokens is not needed). Raises BadField (HTTP 400) naming the field."""
    if not isinstance(body, dict):
        raise BadField("the body must be a JSON object", None)
    unknown = sorted(set(body) - READ - set(ACCEPTED_AS) - set(REFUSED) - {"stream"})
    if unknown:
        raise BadField(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    for name, is_off in REFUSED.items():
        if name in body and not is_off(body[name]):
            raise BadField(f"{name}: not supported by this server; leave it out", name)
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise BadField("service_tier: must be 'auto' or 'standard_only'", "service_tier")
    chat: dict = {"model": get_field(body, "model", (str,), "a string") or "", "messages": []}
    max_tokens = get_field(body, "max_tokens", (int,), "an integer")
    if max_tokens is None and not count_only:
        raise BadField("max_tokens: Field required", "max_tokens")
    if max_tokens is not None:
        if max_tokens < 1:
            raise BadField(f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
        chat["max_tokens"] = max_tokens
    _sampling(body, chat)
    stops = get_field(body, "stop_sequences", (list,), "a list of strings") or []
    if not all(isinstance(s, str) and s for s in stops):
        raise BadField("stop_sequences: must be a list of non-empty strings", "stop_sequences")
    if stops:
        chat["stop"] = stops
    chat["messages"] = _system(body.get("system")) + read_messages(body.get("messages"))
    _tools(body, chat)
    _output_format(body, chat)
    return MessagesRequest(chat, get_field(body, "stream", (bool,), "a boolean") or False, tuple(stops))


def _sampling(body: dict, chat: dict) -> None:
    """temperature and top_p in [0, 1] (Anthropic's ranges), top_k >= 0."""
    for name in ("temperature", "top_p"):
        value = get_field(body, name, (int, float), "a number")
        if value is not None:
            if not 0 <= value <= 1:
                raise BadField(f"{name}: must be in [0, 1], got {value}", name)
            chat[name] = value
    top_k = get_field(body, "top_k", (int,), "an integer")
    if top_k is not None:
        if top_k < 0:
            raise BadField(f"top_k: must be at least 0, got {top_k}", "top_k")
        chat["top_k"] = top_k
    metadata = get_field(body, "metadata", (dict,), "an object") or {}
    get_field(metadata, "user_id", (str,), "a string")


def _system(system: Any) -> list[dict]:
    """`system`: a string or a list of text blocks (their cache_control has no effect)."""
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _text_blocks(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadField(f"{where}: must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise BadField(f"{where}.{j}: blocks of type {json.dumps(kind)[:40]} are not supported here (text)", where)
        texts.append(block["text"])
    return "".join(texts)


def read_messages(raw: Any) -> list[dict]:
    """`messages` as chat messages. Raises BadField: a role other than user / assistant, a
    block kvmesh cannot take (images, documents, thinking), a tool_result whose tool_use_id is
    not a tool_use of the previous message, or a conversation that ends with the assistant."""
    if not isinstance(raw, list) or not raw:
        raise BadField("messages: must be a non-empty list of {'role', 'content'} objects", "messages")
    out: list[dict] = []
    previous_uses: set[str] = set()
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else None
            raise BadField(f'{where}: Unexpected role {json.dumps(role)[:40]}: "user" and "assistant" are', "messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadField(f"{where}.content: must be a string or a list of content blocks", "messages")
        if m["role"] == "assistant":
            message, previous_uses = _assistant(blocks, where)
            out.append(message)
        else:
            out.extend(_user(blocks, where, previous_uses))
            previous_uses = set()
    if raw[-1].get("role") != "user":
        raise BadField("messages: the last message must be the user's (kvmesh does not continue a prefill)", "messages")
    return out


def _assistant(blocks: list, where: str) -> tuple[dict, set[str]]:
    """An assistant message's text and tool_use blocks: one chat message with tool_calls."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise BadField(f"{where}.content.{j}: a tool_use block needs a string id and name", "messages")
            if not isinstance(block.get("input", {}), dict):
                raise BadField(f"{where}.content.{j}.input: must be an object", "messages")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        else:
            raise BadField(f"{where}.content.{j}: blocks of type {json.dumps(kind)[:40]} are not supported", "messages")
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message, {c["id"] for c in calls}


def _user(blocks: list, where: str, uses: set[str]) -> list[dict]:
    """A user message's blocks: its tool_result blocks as tool messages (first), its text as a user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            use_id = block.get("tool_use_id")
            if use_id not in uses:
                raise BadField(
                    f"{where}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {str(use_id)[:64]}. "
                    "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
                    "messages",
                )
            text = _text_blocks(block.get("content", ""), f"{where}.content.{j}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}"  # how the model learns that the tool failed
            results.append({"role": "tool", "content": text, "tool_call_id": use_id})
        else:
            raise BadField(f"{where}.content.{j}: blocks of type {json.dumps(kind)[:40]} are not supported", "messages")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tools(body: dict, chat: dict) -> None:
    """`tools` (custom tools: name, description, input_schema) and `tool_choice` as chat's."""
    tools = get_field(body, "tools", (list,), "a list of tools") or []
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadField(
                f"tools.{i}: tools of type {json.dumps(kind)[:40]} are not supported (custom tools)", "tools"
            )
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    if out:
        chat["tools"] = out
    choice = get_field(body, "tool_choice", (dict,), "an object")
    if choice is None:
        return
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise BadField("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _output_format(body: dict, chat: dict) -> None:
    """output_config: `format` ({"type": "json_schema", "schema"}) as chat's response_format;
    an `effort` is refused (kvmesh has no reasoning effort)."""
    config = get_field(body, "output_config", (dict,), "an object") or {}
    if config.get("effort") is not None:
        raise BadField("output_config.effort: not supported by this server; leave it out", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadField("output_config.format: must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
