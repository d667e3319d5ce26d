"""Structured output asked for in a request body: OpenAI's response_format, vLLM's
structured_outputs ({"json" | "regex" | "choice": ...}) and its older guided_* fields, each
read into the (kind, spec) of a GenerateOptions.grammar (kvmesh.engine.sampling_params.GrammarSpec,
whose compile is the instances' check). Only shapes are checked here (BadField naming the field)."""

from __future__ import annotations

import json

from kvmesh.gateway.http.fields import BadField, get_field

GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
"""Where a request may ask for structured output: OpenAI's response_format, vLLM's
structured_outputs ({"json" | "regex" | "choice": ...}) and its older guided_* fields."""

Found = tuple[str, tuple[str, str]]
"""(the field that asked, (kind, spec))."""


def read_grammar(body: dict) -> tuple[str, tuple[str, str] | None]:
    """The structured output a request asks for: (the field that asked, (kind, spec)), or
    ("", None) for free text. Raises BadField for a malformed one or for two at once."""
    found = _response_format(body) + _structured_outputs(body)
    if len(found) > 1:
        raise BadField(
            f"ask for one structured output, got {len(found)} ({', '.join(f for f, _ in found)})", found[1][0]
        )
    return found[0] if found else ("", None)


def _response_format(body: dict) -> list[Found]:
    """OpenAI's response_format: json_object, json_schema ({"name", "schema"}) or text (none)."""
    response_format = get_field(body, "response_format", (dict,), "an object")
    if response_format is None:
        return []
    kind = response_format.get("type")
    if kind == "json_object":
        return [("response_format", ("json_object", ""))]
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict | bool):
            raise BadField(
                "response_format.json_schema must be an object with a 'name' and a 'schema'", "response_format"
            )
        return [("response_format", ("json_schema", json.dumps(inner.get("schema", {}))))]
    if kind != "text":
        raise BadField(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)[:40]}",
            "response_format",
        )
    return []


def _structured_outputs(body: dict) -> list[Found]:
    """vLLM's structured_outputs object, then its older guided_json, guided_regex, guided_choice."""
    outputs = get_field(body, "structured_outputs", (dict,), "an object")
    legacy = {
        key: body[f"guided_{key}"] for key in ("json", "regex", "choice") if body.get(f"guided_{key}") is not None
    }
    found = []
    for field, given in (("structured_outputs", outputs or {}), *((f"guided_{k}", {k: v}) for k, v in legacy.items())):
        for key, value in given.items():
            if value is not None:
                found.append((field, _output(field, key, value)))
    return found


def _output(field: str, key: str, value: object) -> tuple[str, str]:
    """The (kind, spec) of one vLLM structured output: json (a JSON Schema, an object or its
    text), regex (a string) or choice (a non-empty list of strings)."""
    if key == "json":
        if not isinstance(value, dict | str | bool):
            raise BadField(f"{field}: json must be a JSON Schema (an object or its text)", field)
        return "json_schema", value if isinstance(value, str) else json.dumps(value)
    if key == "regex":
        if not isinstance(value, str):
            raise BadField(f"{field}: regex must be a string", field)
        return "regex", value
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadField(f"{field}: choice must be a non-empty list of strings", field)
        return "choice", json.dumps(value)
    raise BadField(f"{field}.{key} is not supported (json, regex or choice are)", field)
