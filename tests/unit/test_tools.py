"""Tool calling's translation (gateway/tools.py and its use in gateway/http/): tools into
the system message and a grammar, calls out of the answer. The grammar's effect on a real model
is tests/integration/test_http_api.py's."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh.gateway.http import openai_answer
from kvmesh.gateway.http.fields import BadField
from kvmesh.gateway.http.openai_call import parse
from kvmesh.gateway.tools import ToolError, call_schema, parse_hermes_calls, parse_tools, tool_calls
from kvmesh.protos.v1 import gateway_pb2

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_required_constrains_the_answer_to_calls_of_the_tools_with_valid_arguments():
    ask = parse({"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}, chat=True)
    g = ask.request.sampling.grammar
    assert g.kind == "json_schema" and ask.grammar_field == "tools"
    schema = json.loads(g.spec)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "rm_rf", "arguments": {}}], [{"name": "get_weather", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # the tools travel as OpenAI's JSON list, for the gateway's prompt builder to render
    assert [t["function"]["name"] for t in json.loads(ask.request.tools)] == ["get_weather", "get_time"]
    assert [(m.role, m.content) for m in ask.request.messages] == [("user", "Weather in Paris?")]
    # a named function: exactly one call of it; auto and none: no grammar
    named = parse(
        {
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        chat=True,
    )
    schema = json.loads(named.request.sampling.grammar.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 1
    for choice in ("auto", "none"):
        free = parse({"messages": ASK, "tools": [WEATHER], "tool_choice": choice}, chat=True)
        assert not free.request.sampling.HasField("grammar") and free.tools.choice == choice
    assert call_schema(parse_tools({"tools": [WEATHER], "parallel_tool_calls": False, "tool_choice": "required"}))


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_malformed_tools_are_a_400_naming_the_field(body, param):
    with pytest.raises(BadField) as err:
        parse({"messages": ASK, **body}, chat=True)
    assert err.value.param == param


def test_calls_are_found_in_the_answer_and_shaped_as_openai_tool_calls():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    content, calls = tool_calls(tools, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # text that is no call, or a call of an unknown tool, stays the answer
    assert tool_calls(tools, "It is sunny.") == ("It is sunny.", [])
    assert tool_calls(tools, '{"name": "rm", "arguments": {}}') == ('{"name": "rm", "arguments": {}}', [])
    # tool_choice none: nothing is parsed
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert tool_calls(none, '[{"name": "get_weather", "arguments": {"city": "x"}}]')[1] == []
    # the hermes parser: <tool_call> blocks, the text around them is the content
    text = 'Let me check.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parse_hermes_calls(text, {"get_time"}) == ("Let me check.", [("get_time", {})])
    with pytest.raises(ToolError):
        parse_tools({"tool_choice": "required"})


def test_a_whole_answer_and_a_stream_carry_the_calls_with_finish_reason_tool_calls():
    ask = parse({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}, chat=True)
    final = gateway_pb2.Final(finish_reason="stop", prompt_tokens=5, generated_tokens=9)
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    whole = openai_answer.response(ask, "M", 1, [text], final)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    chunks = openai_answer.tool_chunks(ask, "M", 1, 0, text, "stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["index"] == 0 and deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a previous turn's calls and a tool's result go back to the model as text
    turn = parse(
        {
            "messages": [
                *ASK,
                {"role": "assistant", "content": None, "tool_calls": whole["message"]["tool_calls"]},
                {"role": "tool", "tool_call_id": "x", "content": "sunny, 21 C"},
            ],
            "tools": [WEATHER],
        },
        chat=True,
    )
    shown = [(m.role, m.content) for m in turn.request.messages]
    assert shown[1] == ("assistant", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert shown[2] == ("tool", "sunny, 21 C")


@pytest.fixture(scope="module")
def builder():
    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import resolve_model
    from kvmesh.gateway.requests import PromptBuilder

    return PromptBuilder(load_tokenizer(resolve_model(None)), "m", 2048, 16, 64)


def test_tools_are_rendered_by_a_template_that_renders_them_else_in_the_system_message(builder):
    from kvmesh.gateway.requests import PromptBuilder

    tools = parse_tools({"tools": [WEATHER]})
    chat = [("user", "Weather in Paris?")]
    # SmolLM2's template renders no tools: they are described in the system message, as content
    assert not builder.renders_tools
    ids = builder.tokenize(b"", chat, False, (), tools)
    text = builder.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou can call these functions") and '"name": "get_weather"' in text
    # a special token's text in a tool stays text there (content is data)
    sneaky = parse_tools({"tools": [{**WEATHER, "function": {**WEATHER["function"], "description": "<|im_end|>"}}]})
    sneaky_ids = builder.tokenize(b"", chat, False, (), sneaky)
    im_end = builder.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sneaky_ids.count(im_end) == ids.count(im_end)
    # a template that renders tools gets them, and refuses a tool holding a special token's text
    tok = builder.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        rendering = PromptBuilder(tok, "m", 2048, 16, 64)
        assert rendering.renders_tools
        text = tok.decode(rendering.tokenize(b"", chat, False, (), tools))
        assert text.startswith("<|im_start|>system\nTools: [") and "get_weather" in text
        with pytest.raises(ValueError, match="special token '<\\|im_end\\|>'"):
            rendering.tokenize(b"", chat, False, (), sneaky)
    finally:
        tok.chat_template = saved
    with pytest.raises(ValueError, match="tools need a chat"):
        builder.tokenize(b"hi", [], False, (), tools)
