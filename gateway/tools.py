"""Tool calling for the OpenAI front: `tools` and `tool_choice` in, `tool_calls` out.

This module knows nothing of the gateway's other parts; they use it. A request's tools reach the
prompt through the gateway's prompt builder (kvmesh.gateway.requests, kvmesh.gateway.chat_template):
the chat template renders them where it renders tools (a tool whose text holds a special token is
refused there), and otherwise they are described in the system message (`with_tools`: their names,
descriptions and argument schemas as JSON, and how to call them: a JSON array of {"name",
"arguments"}), as content: tool definitions are data, never control tokens. Then:

- tool_choice "required", or a named function: the answer is constrained to that JSON array by
  a grammar (kvmesh.engine.grammar, a JSON Schema whose items are the allowed tools, each with its own
  argument schema), so any model calls a tool, with arguments that validate;
- "auto": the model answers freely and a parser registered by name (TOOL_PARSERS: "json" for the
  array above, "hermes" for <tool_call>{...}</tool_call> blocks, as Qwen and Hermes models write
  them) finds the calls in the text; no call found, the text is the answer;
- "none": the tools are described and never called (OpenAI's meaning), nothing is parsed.

Calls become OpenAI's `tool_calls` ({"id", "type": "function", "function": {"name",
"arguments": JSON text}}) with finish_reason "tool_calls". Pure translation, no I/O.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A malformed `tools` or `tool_choice` (HTTP 400; `param` names the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of its tools: the tools, how they may be called, and the parser
    that finds calls in a free answer ("auto")."""

    tools: tuple[Tool, ...]
    choice: str
    """"auto", "required", "none", or "function" (forced: `forced`)."""
    forced: str = ""
    """The function tool_choice names (choice "function")."""
    parallel: bool = True
    """More than one call per answer (parallel_tool_calls)."""
    parser: str = "json"

    @property
    def may_call(self) -> bool:
        """Calls are parsed from the answer (every choice but "none")."""
        return self.choice != "none"


def parse_tools(body: dict, parser: str = "json") -> ToolRequest | None:
    """The request's tools and tool_choice (None when it has no tools). Raises ToolError for a
    tool that is not {"type": "function", "function": {"name", "parameters"?, "description"?}},
    a bad name (OpenAI's [A-Za-z0-9_-]{1,64}), parameters that are not a JSON Schema object, a
    tool_choice that is not none/auto/required or a named function among the tools; ValueError
    for a `parser` not in TOOL_PARSERS."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > 128:
        raise ToolError("tools must be a list of at most 128 function tools", "tools")
    tools = [_tool(i, t) for i, t in enumerate(raw)]
    if len({t.name for t in tools}) != len(tools):
        raise ToolError("tools must have distinct names", "tools")
    choice, forced = _choice(choice, {t.name for t in tools})
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}; one of {sorted(TOOL_PARSERS)}")
    return ToolRequest(tuple(tools), choice, forced, parallel, parser)


def _tool(i: int, t: Any) -> Tool:
    """tools[i], a function tool: {"type": "function", "function": {"name", "parameters"?, "description"?}}."""
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolError(f"tools[{i}].function.parameters must be a JSON Schema of an object", "tools")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"tools[{i}].function.description must be a string", "tools")
    return Tool(name, description, params)


def _choice(choice: Any, names: set[str]) -> tuple[str, str]:
    """(ToolRequest.choice, ToolRequest.forced) of a tool_choice: none, auto (also when absent),
    required, or {"type": "function", "function": {"name"}} naming one of `names`."""
    if choice is None:
        return "auto", ""
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str) or named not in names:
            raise ToolError("tool_choice must name a function among the tools", "tool_choice")
        return "function", named
    if choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    return choice, ""


def tool_schemas(request: ToolRequest) -> list[dict]:
    """The tools as OpenAI's list of function tools (what a chat template's `tools` renders)."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in request.tools
    ]


def system_text(request: ToolRequest) -> str:
    """What the system message says about the tools (JSON lines, then how to call them)."""
    lines = [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
        for t in request.tools
    ]
    how = (
        'To call functions, answer with only a JSON array of calls: [{"name": "<function name>", "arguments": {...}}].'
        " If no function is needed, answer normally."
    )
    return "You can call these functions (each with a JSON Schema of its arguments):\n" + "\n".join(lines) + "\n" + how


def with_tools(messages: list[tuple[str, str]], request: ToolRequest) -> list[tuple[str, str]]:
    """The conversation with the tools described in its system message (appended to the first
    message when it is a system one, else a system message put first)."""
    text = system_text(request)
    if messages and messages[0][0] == "system":
        return [("system", f"{messages[0][1]}\n\n{text}"), *messages[1:]]
    return [("system", text), *messages]


def call_schema(request: ToolRequest) -> str | None:
    """The JSON Schema an answer must follow for tool_choice "required" or a named function: a
    JSON array of {"name", "arguments"} calls, each an allowed tool with arguments valid for it
    (one call unless parallel calls are allowed); None when the choice is free (auto, none)."""
    if request.choice not in ("required", "function"):
        return None
    allowed = [t for t in request.tools if request.choice == "required" or t.name == request.forced]
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"enum": [t.name]}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in allowed
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not request.parallel or request.choice == "function":
        schema["maxItems"] = 1
    return json.dumps(schema)


def _calls_from_json(value: Any, names: set[str]) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] when `value` is a call or a list of calls to known tools."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], arguments))
    return calls or None


def parse_json_calls(text: str, names: set[str]) -> tuple[str, list[tuple[str, dict]]]:
    """The "json" parser: the whole answer is a JSON call or array of calls (what system_text
    asks for, and what the grammar of "required" produces). Returns (content, calls); content
    is the text when no call was found, else ""."""
    try:
        calls = _calls_from_json(json.loads(text.strip()), names)
    except ValueError:
        calls = None
    return ("", calls) if calls else (text, [])


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes_calls(text: str, names: set[str]) -> tuple[str, list[tuple[str, dict]]]:
    """The "hermes" parser: <tool_call>{"name", "arguments"}</tool_call> blocks (Hermes, Qwen);
    the content is the text outside them. A block that is not a call to a known tool stays text."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            found = _calls_from_json(json.loads(block), names)
        except ValueError:
            found = None
        if found is None:
            return text, []
        calls += found
    return (_HERMES.sub("", text).strip(), calls) if calls else (text, [])


TOOL_PARSERS: dict[str, Callable[[str, set[str]], tuple[str, list[tuple[str, dict]]]]] = {
    "json": parse_json_calls,
    "hermes": parse_hermes_calls,
}
"""Parsers that find tool calls in an answer, by the name `--tool-parser` gives."""


def tool_calls(request: ToolRequest, text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a whole answer: the calls the request's parser finds
    (content None when there are calls and no other text), or the text and no calls."""
    if not request.may_call:
        return text, []
    content, calls = TOOL_PARSERS[request.parser](text, {t.name for t in request.tools})
    if not calls:
        return text, []
    out = [
        {
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        for name, arguments in calls
    ]
    return content or None, out
