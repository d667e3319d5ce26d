"""The OpenAI request translation (gateway/http/): bodies -> GenerateRequest, the
gateway's answer -> OpenAI's objects, statuses and error objects. Shapes only: ranges are the
request path's checks, the same for gRPC and HTTP (tests/integration/test_http_api.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.http import errors, logprobs, openai_answer, openai_request, sse
from kvmesh.gateway.http.fields import BadField
from kvmesh.gateway.http.openai_call import parse
from kvmesh.protos.v1 import common_pb2, gateway_pb2
from kvmesh.runtime.wire import status_of


def test_a_chat_body_becomes_messages_and_sampling():
    ask = parse(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None},
            ],
            "max_tokens": 7,
            "max_completion_tokens": 9,  # the newer name wins
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "user": "u-1",
            "logit_bias": {},  # an OpenAI field kvmesh lacks, turned off: accepted
            "x_vendor_hint": 1,  # no OpenAI field: ignored, as OpenAI ignores unknown fields
        },
        chat=True,
        request_id="rid-1",
    )
    r = ask.request
    assert [(m.role, m.content) for m in r.messages] == [
        ("system", "Be brief."),
        ("user", "Hi there"),
        ("assistant", ""),
    ]
    assert r.prompt == b"" and not r.chat and r.model == "m" and r.request_id == "rid-1"
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop)) == (9, 0.0, 0.5, 3, ["\n"])
    assert ask.stream and ask.include_usage and ask.response_id == "chatcmpl-rid-1"


def test_defaults_follow_openai():
    ask = parse({"prompt": "Once"}, chat=False)
    s = ask.request.sampling
    # temperature 1 (OpenAI's default), top_p, max_tokens and seed unset: the gateway's defaults
    assert s.temperature == 1.0 and not s.HasField("top_p") and not s.HasField("max_tokens")
    assert not s.HasField("seed") and not ask.stream and not ask.include_usage
    assert len(ask.request.request_id) == 32 and ask.response_id.startswith("cmpl-")


@pytest.mark.parametrize(
    "prompt,text,ids",
    [("Once", b"Once", []), ([1, 2, 3], b"", [1, 2, 3]), (["Once"], b"Once", []), ([[4, 5]], b"", [4, 5])],
)
def test_a_completion_prompt_is_text_or_token_ids_alone_or_as_a_batch_of_one(prompt, text, ids):
    r = parse({"prompt": prompt, "stop": ["a", "b"]}, chat=False).request
    assert (r.prompt, list(r.prompt_token_ids), list(r.messages)) == (text, ids, [])
    assert list(r.sampling.stop) == ["a", "b"]


@pytest.mark.parametrize(
    "body,chat,param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, True, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, True, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, True, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, True, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 129}, True, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, True, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, True, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, True, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": 4}, True, "model"),
        ({"messages": [{"role": "user", "content": 5}]}, True, "messages[0].content"),
        ({"messages": [{"content": "hi"}]}, True, "messages[0]"),
        ({"messages": []}, True, "messages"),
        ({"prompt": "hi"}, True, "messages"),
        ({"prompt": ["a", "b"]}, False, "prompt"),  # a batch: one prompt per request
        ({"prompt": [1, "a"]}, False, "prompt"),
        ({"prompt": [2**40]}, False, "prompt"),
        ({"prompt": []}, False, "prompt"),
        ({"messages": [{"role": "user", "content": "hi"}]}, False, "prompt"),
        ([1, 2], False, None),
        ({"prompt": "hi", "logprobs": 6}, False, "logprobs"),  # completions: at most 5
        ({"prompt": "hi", "logprobs": True}, False, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, True, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, True, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
            True,
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, True, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, True, "tools"),
        ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, False, "tools"),
        ({"prompt": "hi", "best_of": 129}, False, "best_of"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, False, "best_of"),
        ({"prompt": "hi", "best_of": 2, "stream": True}, False, "best_of"),
        ({"prompt": "hi", "suffix": "end"}, False, "suffix"),
        ({"prompt": "hi", "guided_json": 5}, False, "guided_json"),
        ({"prompt": "hi", "guided_grammar": "root ::= 'a'"}, False, "guided_grammar"),
        ({"prompt": "hi", "store": True}, False, "store"),
    ],
)
def test_a_wrong_type_or_shape_names_the_field(body, chat, param):
    with pytest.raises(BadField) as err:
        parse(body, chat=chat)
    assert err.value.param == param


def _final(**kw) -> gateway_pb2.Final:
    return gateway_pb2.Final(finish_reason="length", prompt_tokens=10, cached_tokens=8, generated_tokens=3, **kw)


def test_answers_carry_usage_with_cached_tokens_and_the_finish_reason():
    chat = parse({"messages": [{"role": "user", "content": "hi"}]}, chat=True, request_id="r")
    whole = openai_answer.response(chat, "M", 5, ["Hello"], _final())
    assert whole["object"] == "chat.completion" and whole["id"] == "chatcmpl-r" and whole["model"] == "M"
    assert whole["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert whole["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    text = parse({"prompt": "x"}, chat=False, request_id="r")
    assert openai_answer.response(text, "M", 5, ["Hi"], _final())["choices"][0]["text"] == "Hi"


def test_stream_chunks_name_the_role_first_and_usage_only_when_asked():
    ask = parse({"messages": [{"role": "user", "content": "hi"}], "stream": True}, chat=True)
    first = openai_answer.chunk(ask, "M", 5, "He", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"} and "usage" not in first
    last = openai_answer.chunk(ask, "M", 5, None, "stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    with_usage = parse(
        {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, chat=True
    )
    assert openai_answer.chunk(with_usage, "M", 5, "x")["usage"] is None
    tail = openai_answer.usage_chunk(with_usage, "M", 5, _final())
    assert tail["choices"] == [] and tail["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    event = sse.sse(first)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and json.loads(event[6:]) == first
    assert sse.sse("[DONE]") == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "cause,status,code",
    [
        (FailureCause.BAD_REQUEST, 400, "bad_request"),
        (FailureCause.UNAUTHENTICATED, 401, "invalid_api_key"),
        (FailureCause.UNKNOWN_MODEL, 404, "model_not_found"),
        (FailureCause.OVERLOADED, 429, "rate_limit_exceeded"),
        (FailureCause.NO_INSTANCE, 503, "no_instance"),
        (FailureCause.INSTANCE_LOST, 503, "instance_lost"),
        (FailureCause.DEADLINE, 504, "deadline"),
        (FailureCause.MISMATCH, 500, "mismatch"),  # a mesh set up wrong: the server's fault
        (FailureCause.INTERNAL, 500, "internal"),
    ],
)
def test_each_cause_has_the_http_status_of_its_grpc_status_and_an_openai_error_object(cause, status, code):
    got = errors.http_status(status_of(cause))
    assert got == status
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "rate_limit_error" if status == 429 else "server_error"
    )
    body = errors.error(got, "what to change", cause, "p")
    assert body == {"error": {"message": "what to change", "type": kind, "param": "p", "code": code}}


def test_statuses_outside_the_table_are_500():
    assert errors.http_status(grpc.StatusCode.DATA_LOSS) == 500
    assert errors.http_status(grpc.StatusCode.RESOURCE_EXHAUSTED) == 429


@pytest.mark.parametrize(
    "field,off", sorted((name, v) for name, v in {
        "modalities": ["text"], "functions": [], "function_call": "none",
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "store": False, "audio": None,
        "service_tier": "auto", "min_p": 0,
    }.items()),
)  # fmt: skip
def test_an_unsupported_field_that_is_turned_off_is_accepted(field, off):
    parse({"messages": [{"role": "user", "content": "hi"}], field: off}, chat=True)
    # every unsupported field is listed with a check; a value not off is refused
    assert field in openai_request.UNSUPPORTED


def test_logprobs_ask_for_the_top_alternatives_and_are_shaped_as_openai_shows_them():
    chat = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}, chat=True)
    assert chat.request.sampling.logprobs == 2
    assert (
        parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, chat=True).request.sampling.logprobs
        == 0
    )
    assert not parse({"prompt": "hi"}, chat=False).request.sampling.HasField("logprobs")
    texts = {1: ("He", b"He"), 2: ("llo", b"llo"), 3: (" \ufffd", b" \xe6")}
    entries = [
        common_pb2.TokenLogprobs(token_id=1, logprob=-0.5, top_token_ids=[1, 3], top_logprobs=[-0.5, -1.5]),
        common_pb2.TokenLogprobs(token_id=3, logprob=-2.0, top_token_ids=[2, 1], top_logprobs=[-0.25, -1.0]),
    ]
    shaped = logprobs.LogprobsShaper(chat, texts.__getitem__).shape(entries)
    assert shaped == {
        "content": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [
                {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
                {"token": " \ufffd", "logprob": -1.5, "bytes": [32, 0xE6]}]},
            {"token": " \ufffd", "logprob": -2.0, "bytes": [32, 0xE6], "top_logprobs": [
                {"token": "llo", "logprob": -0.25, "bytes": [108, 108, 111]},
                {"token": "He", "logprob": -1.0, "bytes": [72, 101]}]},
        ],
        "refusal": None,
    }  # fmt: skip
    completion = parse({"prompt": "hi", "logprobs": 1}, chat=False)
    shaper = logprobs.LogprobsShaper(completion, texts.__getitem__, offset=2)  # after an echoed "hi"
    first, second = shaper.shape(entries[:1]), shaper.shape(entries[1:])
    assert first == {"tokens": ["He"], "token_logprobs": [-0.5], "top_logprobs": [{"He": -0.5, " \ufffd": -1.5}],
                     "text_offset": [2]}  # fmt: skip
    # the sampled token is always in top_logprobs (up to logprobs + 1 entries), offsets run on
    assert second["top_logprobs"] == [{"llo": -0.25, "He": -1.0, " \ufffd": -2.0}] and second["text_offset"] == [4]
    assert logprobs.LogprobsShaper(parse({"prompt": "hi"}, chat=False), texts.__getitem__).shape(entries) is None
    whole = openai_answer.response(chat, "M", 5, ["Hello"], _final(), [shaped])
    assert whole["choices"][0]["logprobs"] is shaped
    assert openai_answer.chunk(chat, "M", 5, "x", logprobs=shaped)["choices"][0]["logprobs"] is shaped


def test_n_choices_are_asked_for_and_answered_each_with_its_own_finish():
    ask = parse({"prompt": "hi", "n": 3}, chat=False)
    assert ask.request.sampling.n == 3
    assert parse({"prompt": "hi", "n": 1}, chat=False).request.sampling.n == 0  # the default: one
    final = _final(choice_finish=[common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP] * 1 + [1])
    whole = openai_answer.response(ask, "M", 5, ["a", "b", "c"], final)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "a", "length"),
        (1, "b", "stop"),
        (2, "c", "stop"),
    ]
    assert openai_answer.chunk(ask, "M", 5, "x", index=2)["choices"][0]["index"] == 2


def test_best_of_generates_more_and_returns_the_n_with_the_highest_summed_logprob():
    ask = parse({"prompt": "hi", "best_of": 3, "n": 2}, chat=False)
    s = ask.request.sampling
    assert s.n == 3 and s.logprobs == 0 and not ask.logprobs  # scored by logprobs nobody asked to see
    lp = [[common_pb2.TokenLogprobs(logprob=v) for v in values] for values in ([-1.0, -2.0], [-0.5], [-0.5, -0.1])]
    assert openai_answer.best_choices(ask, lp) == [1, 2]  # -0.5, then -0.6; -3.0 is dropped
    final = _final(choice_finish=[1, 2, 1])
    body = openai_answer.response(ask, "M", 5, ["a", "b", "c"], final, [None] * 3, openai_answer.best_choices(ask, lp))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "b", "length"),
        (1, "c", "stop"),
    ]
    assert body["usage"]["completion_tokens"] == final.generated_tokens  # every choice's tokens
    assert logprobs.LogprobsShaper(ask, lambda t: ("", b"")).shape(lp[0]) is None
    assert parse({"prompt": "hi", "best_of": 2, "n": 2}, chat=False).best_of == 0  # nothing to pick from


def test_echo_with_logprobs_asks_for_the_prompt_s_and_shapes_its_first_token_as_null():
    ask = parse({"prompt": "hi", "logprobs": 2, "echo": True}, chat=False)
    assert ask.echo and ask.request.sampling.prompt_logprobs == 2 and ask.request.sampling.logprobs == 2
    assert not parse({"prompt": "hi", "echo": True}, chat=False).request.sampling.HasField("prompt_logprobs")
    texts = {1: ("Hi", b"Hi"), 2: (" there", b" there")}
    entries = [
        common_pb2.TokenLogprobs(token_id=1, logprob=float("nan")),
        common_pb2.TokenLogprobs(token_id=2, logprob=-1.5, top_token_ids=[1], top_logprobs=[-0.5]),
    ]
    shaped = logprobs.LogprobsShaper(ask, texts.__getitem__).shape(entries)
    assert shaped == {
        "tokens": ["Hi", " there"],
        "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {"Hi": -0.5, " there": -1.5}],
        "text_offset": [0, 2],
    }


def test_a_logprob_of_minus_infinity_reads_as_openai_s_floor_in_json():
    # a grammar's mask leaves fewer allowed tokens than top_logprobs asks for: the rest are -inf
    chat = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}, chat=True)
    entry = common_pb2.TokenLogprobs(token_id=1, logprob=0.0, top_token_ids=[1, 2], top_logprobs=[0.0, float("-inf")])
    shaped = logprobs.LogprobsShaper(chat, lambda t: (str(t), b"x")).shape([entry])
    assert [t["logprob"] for t in shaped["content"][0]["top_logprobs"]] == [0.0, logprobs.LOGPROB_FLOOR]
    json.dumps(shaped, allow_nan=False)  # valid JSON
    completion = parse({"prompt": "hi", "logprobs": 1}, chat=False)
    shaped = logprobs.LogprobsShaper(completion, lambda t: (str(t), b"x")).shape([entry])
    assert shaped["top_logprobs"] == [{"1": 0.0, "2": logprobs.LOGPROB_FLOOR}]


@pytest.mark.parametrize(
    "body,chat,param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, True, "echo"),
        ({"messages": [{"role": "user", "content": "hi"}], "best_of": 3}, True, "best_of"),
        ({"prompt": "hi", "tool_choice": "auto"}, False, "tool_choice"),
    ],
)
def test_a_field_of_the_other_endpoint_is_refused_not_ignored(body, chat, param):
    with pytest.raises(BadField) as err:
        parse(body, chat=chat)
    assert err.value.param == param
