"""The Responses and Messages fronts' pure parts: their bodies translated into the chat completion
the gateway serves, the fields each refuses, the stored-response memory store, the typed events'
numbering, Anthropic's stop reasons, and which stop string ended an answer."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from kvmesh.gateway.detokenizer import StopStringMatcher
from kvmesh.gateway.http.chat_completions import parse_chat
from kvmesh.gateway.http.fields import BadField
from kvmesh.gateway.http.messages_answer import content_of
from kvmesh.gateway.http.messages_request import read_messages_body
from kvmesh.gateway.http.responses_answer import ResponseEvents, output_of
from kvmesh.gateway.http.responses_call import truncate_to_context
from kvmesh.gateway.http.responses_request import check_tool_outputs, read_responses
from kvmesh.gateway.response_store import MemoryResponseStore, RedisResponseStore, ResponseStoreError
from kvmesh.protos.v1 import gateway_pb2
from kvmesh.redis_server import free_port

TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_a_responses_body_becomes_chat_s_with_instructions_first_and_calls_as_tool_calls():
    read = read_responses(
        {
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            ],
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "weather", "parameters": TOOL}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": TOOL}},
            "max_output_tokens": 7,
            "top_logprobs": 2,
        }
    )
    body = read.chat_body([{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}])
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert body["messages"][4]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert body["max_tokens"] == 7 and body["logprobs"] is True and body["top_logprobs"] == 2
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": TOOL}}
    assert [i["type"] for i in read.items] == ["message", "function_call", "function_call_output"]
    assert all(i["id"] for i in read.items) and read.store is True  # stored unless told not to
    # the named tool's call is a grammar; it conflicts with text.format, as on chat
    with pytest.raises(BadField):
        parse_chat(body)
    del body["response_format"]
    ask = parse_chat(body)
    assert ask.tools is not None and ask.request.sampling.max_tokens == 7


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "frequency_penalty": 1}, "frequency_penalty"),  # unknown to the Responses API
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "service_tier": "flex"}, "service_tier"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        (
            {"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0]"),
        ({"input": []}, "input"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ],
)
def test_responses_fields_kvmesh_cannot_honour_are_400s_naming_them(body, param):
    with pytest.raises(BadField) as caught:
        read_responses(body)
    assert caught.value.param == param


def test_a_tool_output_must_answer_a_call_made_earlier():
    called = [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1"}]}]
    check_tool_outputs([*called, {"role": "tool", "content": "x", "tool_call_id": "call_1"}])
    with pytest.raises(BadField, match="call_2"):
        check_tool_outputs([*called, {"role": "tool", "content": "x", "tool_call_id": "call_2"}])


def test_the_memory_store_keeps_records_per_owner_expires_them_and_drops_the_least_recent():
    async def scenario():
        store = MemoryResponseStore(ttl_s=3600, max_records=2)
        await store.put("a", "resp_1", {"n": 1})
        assert await store.get("a", "resp_1") == {"n": 1}
        assert await store.get("b", "resp_1") is None  # another owner's id finds nothing
        assert not await store.delete("b", "resp_1")
        await store.put("a", "resp_2", {"n": 2})
        await store.get("a", "resp_1")  # used: resp_2 is now the least recent
        await store.put("a", "resp_3", {"n": 3})
        assert await store.get("a", "resp_2") is None and len(store) == 2
        expired = MemoryResponseStore(ttl_s=-1)
        await expired.put("a", "resp_1", {"n": 1})
        assert await expired.get("a", "resp_1") is None and len(expired) == 0

    asyncio.run(scenario())


def test_response_events_are_numbered_from_zero_and_a_held_call_goes_out_whole():
    events = ResponseEvents()
    item = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "f",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    sent = [json.loads(e.decode().split("data: ", 1)[1]) for e in events.whole_item(0, item)]
    assert [e["sequence_number"] for e in sent] == [0, 1, 2, 3]
    assert [e["type"] for e in sent] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert sent[0]["item"]["arguments"] == "" and sent[1]["delta"] == sent[2]["arguments"] == '{"a": 1}'


def test_output_items_of_a_tool_call_and_of_text():
    ask = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": TOOL}}],
        }
    )
    called = output_of(ask, '[{"name": "f", "arguments": {"city": "Oslo"}}]', None)
    assert [i["type"] for i in called.items] == ["function_call"] and called.message["tool_calls"]
    assert json.loads(called.items[0]["arguments"]) == {"city": "Oslo"}
    plain = output_of(ask, "Just text.", None)
    assert [i["type"] for i in plain.items] == ["message"] and plain.message == {
        "role": "assistant",
        "content": "Just text.",
    }


def test_a_messages_body_becomes_chat_s_with_tool_results_as_tool_messages():
    read = read_messages_body(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            "tools": [{"name": "w", "input_schema": TOOL}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "temperature": 0,
        }
    )
    chat = read.chat
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["max_tokens"] == 9
    assert parse_chat(chat).request.sampling.max_tokens == 9


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "max_tokens": 1,
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}
                ],
            },
            "tool_use_id",
        ),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "last message",
        ),
        ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "role"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
            "thinking",
        ),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "n": 2}, "Extra inputs"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124"}]},
            "tools",
        ),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}},
            "effort",
        ),
    ],
)
def test_messages_bodies_anthropic_refuses_are_400s_naming_the_field(body, named):
    with pytest.raises(BadField, match=named):
        read_messages_body(body)


def test_count_tokens_needs_no_max_tokens_and_thinking_disabled_is_accepted():
    read = read_messages_body(
        {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}}, count_only=True
    )
    assert "max_tokens" not in read.chat


def test_anthropic_stop_reasons():
    ask = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert content_of(ask, "a", gateway_pb2.Final(finish_reason="length")).stop_reason == "max_tokens"
    assert content_of(ask, "a", gateway_pb2.Final(finish_reason="stop")).stop_reason == "end_turn"
    stopped = content_of(ask, "a", gateway_pb2.Final(finish_reason="stop", stop_sequence="END"))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")


def test_the_stop_string_matcher_names_the_first_stop_string_in_the_text():
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("hello world") == ("hel", True) and m.matched == "lo"
    assert StopStringMatcher(["x"]).matched == ""


def test_a_store_redis_does_not_answer_raises_response_store_error():
    async def scenario():
        store = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60, timeout_s=0.5)
        try:
            for call in (store.get("a", "resp_1"), store.put("a", "resp_1", {}), store.delete("a", "resp_1")):
                with pytest.raises(ResponseStoreError):
                    await call
        finally:
            await store.close()

    asyncio.run(scenario())


class _Builder:
    """A prompt builder whose tokens are a message's words plus 2 a message (the unit under test
    only counts them)."""

    max_context, default_max_tokens = 40, 10

    def tokenize(self, prompt, messages, chat, token_ids=(), tools=None):
        return [0] * sum(len(content.split()) + 2 for _, content in messages)


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits_and_starts_with_a_user_turn():
    words = " ".join(["w"] * 8)  # 10 tokens a message
    body = {
        "messages": [
            {"role": "system", "content": "rules"},  # 3 tokens, always kept
            *({"role": role, "content": words} for role in ("user", "assistant") * 3),
            {"role": "user", "content": "last question"},  # 4 tokens
        ],
        "max_tokens": 10,
    }
    ask = parse_chat(body)
    front = SimpleNamespace(path=SimpleNamespace(builder=_Builder()))
    truncate_to_context(front, ask)  # budget 40 - 10 = 30 tokens: system, 2 whole turns ... too many
    roles = [m.role for m in ask.request.messages]
    assert roles == ["system", "user", "assistant", "user"], roles  # 3 + 10 + 10 + 4 = 27 <= 30
    assert ask.request.messages[-1].content == "last question"


def test_values_protobuf_cannot_hold_and_bad_text_are_400s_not_server_errors():
    from kvmesh.gateway.http.body import _has_lone_surrogate

    with pytest.raises(BadField, match="out of its range"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_k": 2**31})
    nested = "[" * 100_000 + "]" * 100_000
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": nested}
    with pytest.raises(BadField, match="JSON text"):
        read_responses({"input": [call]})
    lone = b'{"input": "a\\ud800b"}'
    assert _has_lone_surrogate(lone, json.loads(lone))
    pair = b'{"input": "\\ud83d\\ude00"}'
    assert not _has_lone_surrogate(pair, json.loads(pair))
    assert not _has_lone_surrogate(b'{"input": "plain"}', {"input": "plain"})


class _CountingBuilder(_Builder):
    """_Builder that counts its tokenizations and refuses, as the real one does by bytes, a
    conversation of more than 40 messages before tokenizing it."""

    def __init__(self) -> None:
        self.calls = 0

    def tokenize(self, prompt, messages, chat, token_ids=(), tools=None):
        if len(messages) > 40:
            raise ValueError("prompt is too many bytes")
        self.calls += 1
        return super().tokenize(prompt, messages, chat, token_ids, tools)


def test_truncation_auto_bisects_takes_too_many_bytes_as_too_long_and_keeps_a_system_turn_in_the_middle():
    builder = _CountingBuilder()
    turns = [{"role": role, "content": "w"} for _ in range(500) for role in ("user", "assistant")]
    turns[600] = {"role": "developer", "content": "mid"}  # a system turn inside the conversation
    ask = parse_chat({"messages": [{"role": "system", "content": "rules"}, *turns[:-1]], "max_tokens": 10})
    truncate_to_context(SimpleNamespace(path=SimpleNamespace(builder=builder)), ask)
    kept = [(m.role, m.content) for m in ask.request.messages]
    assert kept[0] == ("system", "rules") and kept[1][0] == "user" and kept[-1] == ("user", "w")
    assert sum(3 if c == "rules" else len(c.split()) + 2 for _, c in kept) <= 30  # the budget: 40 - 10
    assert builder.calls <= 12  # ~log2(500 cut points) tokenizations, not one per dropped turn
