"""The agents' APIs on a real mesh: OpenAI's Responses API (driven by the `openai` client's
responses.create / responses.stream) and Anthropic's Messages API (the `anthropic` client's
messages.create / messages.stream), each answer compared with /v1/chat/completions' for the same
conversation: one request path behind three fronts.

The instances are the session's shared mesh (tests/conftest.py `observed_mesh`); this module adds
two gateways in front of them that share the mesh's Redis (where stored responses live), each
with two API keys, so a conversation continues through either gateway, and through a restart.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import anthropic
import httpx
import jsonschema
import openai
import pytest
import redis

from kvmesh.redis_server import free_port
from tests.integration.meshutil import gateway_args, reap, serving, spawn_service, terminate, wait_idle

KEY_A, KEY_B = "sk-agents-alpha-0123", "sk-agents-beta-4567"
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
"""The tool's argument schema, which the grammar enforces and the test validates against."""


@pytest.fixture(scope="module")
def mesh(observed_mesh):
    """Shared with test_http_api, test_mesh and test_observability: 1 prefill, 1 decode."""
    return observed_mesh


@dataclass
class Gateway:
    proc: object
    grpc_address: str
    http_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def openai(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def anthropic(self, key: str = KEY_A) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=60)


class Gateways:
    """Two gateways over the mesh, sharing its Redis; `restart(i)` stops one and starts it again."""

    def __init__(self, mesh, keys_path: str, log_path: str) -> None:
        self.mesh, self.keys_path, self.log_path = mesh, keys_path, log_path
        self.all = [self._start(), self._start()]
        serving([(g.proc, g.grpc_address) for g in self.all])
        for g in self.all:
            _wait_http(g)

    def _start(self, http_port: int = 0) -> Gateway:
        port = http_port or free_port()
        args = gateway_args(self.mesh, "--http-port", str(port), "--api-key-file", self.keys_path, "--drain-grace", "1")
        proc, address = spawn_service("gateway", args, self.log_path)
        return Gateway(proc, address, port)

    def stop_one(self, i: int) -> None:
        """Stop gateway i (SIGTERM) and start it again on the same HTTP port; `serving_again` waits for it."""
        old = self.all[i]
        terminate([old.proc])
        reap([old.proc])
        self.all[i] = self._start(old.http_port)

    def serving_again(self, i: int) -> None:
        serving([(self.all[i].proc, self.all[i].grpc_address)])
        _wait_http(self.all[i])

    def stop(self) -> None:
        procs = [g.proc for g in self.all]
        terminate(procs)
        reap(procs)


def _wait_http(g: Gateway, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(g.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway's HTTP port did not open"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def gateways(mesh, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    (tmp / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    log_path = str(tmp / "gateways.log")
    gws = Gateways(mesh, str(tmp / "keys"), log_path)
    try:
        yield gws
    except BaseException:
        with open(log_path, errors="replace") as f:
            print(f.read()[-4000:])
        raise
    finally:
        gws.stop()


def _chat(g: Gateway, messages: list[dict], max_tokens: int = 12, **extra):
    """The reference: /v1/chat/completions' greedy answer to the same conversation."""
    return g.openai().chat.completions.create(
        model="", messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


def _stored_count(mesh) -> int:
    client = redis.Redis.from_url(mesh.redis_url)
    try:
        return sum(1 for _ in client.scan_iter(match="kvmesh:response:*", count=1000))
    finally:
        client.close()


def test_responses_equal_chat_whole_and_streamed_and_are_stored_per_key(mesh, gateways):
    g = gateways.all[0]
    want = _chat(g, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    client = g.openai()
    r = client.responses.create(
        model="", instructions="Answer briefly.", input=QUESTION, max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.output_text == want.choices[0].message.content
    assert r.usage.input_tokens == want.usage.prompt_tokens and r.usage.output_tokens == want.usage.completion_tokens
    assert r.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")

    kinds, numbers = [], []
    with client.responses.stream(
        model="", instructions="Answer briefly.", input=QUESTION, max_output_tokens=12, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
        streamed = stream.get_final_response()
    assert streamed.output_text == want.choices[0].message.content
    assert numbers == list(range(len(numbers)))  # numbered from 0, none skipped
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_item.done",
    ):
        assert kind in kinds, kinds

    # stored: retrievable by its key, its input listed; another key sees nothing (404, not 403)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    items = client.responses.input_items.list(r.id).data
    assert [i.type for i in items] == ["message"] and items[0].content[0].text == QUESTION
    with pytest.raises(openai.NotFoundError):
        g.openai(KEY_B).responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        g.openai(KEY_B).responses.delete(r.id)
    # the other gateway reads the same Redis
    assert gateways.all[1].openai().responses.retrieve(r.id).id == r.id
    # deleted, it is gone; store false keeps nothing
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="", input=QUESTION, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    wait_idle(mesh)


def test_responses_tool_round_trip_through_previous_response_id(mesh, gateways):
    g = gateways.all[0]
    client = g.openai()
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
    asked = dict(
        model="", tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=40, temperature=0
    )
    r = client.responses.create(input="What is the weather in Paris?", **asked)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)

    # streamed, the same call arrives as argument events and one function_call item
    with client.responses.stream(input="What is the weather in Paris?", **asked) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(o.type, o.arguments) for o in streamed.output] == [("function_call", calls[0].arguments)]

    # the tool's output continues the stored conversation, which the client does not resend
    answer = client.responses.create(
        model="",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        tools=tools,
        max_output_tokens=16,
        temperature=0,
    )
    assert answer.previous_response_id == r.id and answer.output_text.strip()
    assert answer.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt is a prefix hit
    wait_idle(mesh)


def test_a_five_turn_chain_alternates_gateways_through_a_restart_and_hits_the_cache(mesh, gateways):
    previous = None
    turns = []
    for turn in range(5):
        if turn == 1:
            gateways.stop_one(0)  # restarted while turn 1 goes through the other gateway
        if turn == 2:
            gateways.serving_again(0)  # stored responses live in Redis: the new process continues the chain
        g = gateways.all[turn % 2]
        r = g.openai().responses.create(
            model="",
            input=f"Turn {turn}: name one city in Europe.",
            previous_response_id=previous,
            max_output_tokens=8,
            temperature=0,
        )
        assert r.status in ("completed", "incomplete") and r.output_text, r
        turns.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
        previous = r.id
    inputs = [n for n, _ in turns]
    assert inputs == sorted(inputs) and len(set(inputs)) == 5, turns  # each turn carries the ones before
    assert all(cached > 0 for _, cached in turns[1:]), turns
    wait_idle(mesh)


def test_responses_refuse_bad_input_and_store_nothing(mesh, gateways):
    g = gateways.all[1]
    client, other = g.openai(), g.openai(KEY_B)
    mine = client.responses.create(model="", input=QUESTION, max_output_tokens=2, temperature=0)
    before = _stored_count(mesh)
    bad = [
        (
            dict(input=[{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            400,
        ),
        (dict(input=[{"type": "web_search_call", "id": "ws_1"}]), 400),
        (dict(input="hi", previous_response_id="resp_unknown"), 404),
        (dict(input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]), 400),
        (dict(input="hi", reasoning={"effort": "high"}), 400),
        (dict(input="hi", tools=[{"type": "web_search"}]), 400),
        (dict(input="hi", extra_body={"frequency_penalty": 1}), 400),
    ]
    for fields, status in bad:
        with pytest.raises(openai.APIStatusError) as caught:
            client.responses.create(model="", max_output_tokens=4, **fields)
        assert caught.value.status_code == status, (fields, caught.value.body)
        assert caught.value.body["message"], caught.value.body
    # another key's response cannot be continued: 404, as if it did not exist
    with pytest.raises(openai.NotFoundError) as caught:
        other.responses.create(model="", input="hi", previous_response_id=mine.id, max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"
    assert _stored_count(mesh) == before
    wait_idle(mesh)


def test_messages_equal_chat_whole_and_streamed(mesh, gateways):
    g = gateways.all[0]
    want = _chat(g, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    text = want.choices[0].message.content
    client = g.anthropic()
    asked = dict(
        model="SmolLM2-135M-Instruct",
        max_tokens=12,
        system="Answer briefly.",
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},
    )
    m = client.messages.create(**asked)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert m.usage.output_tokens == want.usage.completion_tokens

    with client.messages.stream(**asked) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == text and streamed.stop_reason == m.stop_reason
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    for kind in ("content_block_start", "content_block_stop", "message_delta"):
        assert kind in kinds, kinds
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == want.usage.prompt_tokens

    counted = client.messages.count_tokens(
        model="SmolLM2-135M-Instruct", system="Answer briefly.", messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == want.usage.prompt_tokens

    # a stop sequence inside the greedy answer ends it there, and is named
    stop = text.split()[2]
    cut = client.messages.create(**{**asked, "max_tokens": 30}, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    wait_idle(mesh)


def test_messages_tool_round_trip(mesh, gateways):
    client = gateways.all[1].anthropic()
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    asked = dict(
        model="SmolLM2-135M-Instruct",
        max_tokens=40,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    m = client.messages.create(messages=[question], **asked)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", m.content
    jsonschema.validate(uses[0].input, WEATHER)

    with client.messages.stream(messages=[question], **asked) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas == ["input_json_delta"] and streamed.content[0].input == uses[0].input

    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}
    answer = client.messages.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=16,
        tools=tools,
        messages=[question, {"role": "assistant", "content": m.content}, {"role": "user", "content": [result]}],
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].text.strip()
    wait_idle(mesh)


def test_messages_errors_are_anthropic_s(mesh, gateways):
    g = gateways.all[0]
    question = [{"role": "user", "content": QUESTION}]

    def post(body: dict, headers: dict | None = None) -> httpx.Response:
        return httpx.post(g.url + "/v1/messages", json=body, headers=headers or {"x-api-key": KEY_A}, timeout=60)

    cases = [
        ({"model": "", "messages": question}, 400, "max_tokens"),
        (
            {
                "model": "",
                "max_tokens": 4,
                "messages": [
                    *question,
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]},
                ],
            },
            400,
            "tool_use_id",
        ),
        (
            {
                "model": "",
                "max_tokens": 4,
                "messages": question,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            400,
            "thinking",
        ),
        ({"model": "", "max_tokens": 4, "messages": question, "frequency_penalty": 1}, 400, "frequency_penalty"),
        (
            {
                "model": "",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
            },
            400,
            "image",
        ),
    ]
    for body, status, named in cases:
        r = post(body)
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and named in r.json()["error"]["message"], r.text
    bad_key = post({"model": "", "max_tokens": 4, "messages": question}, {"x-api-key": "sk-wrong"})
    assert bad_key.status_code == 401 and bad_key.json()["error"]["type"] == "authentication_error"
    bearer = post({"model": "", "max_tokens": 2, "messages": question}, {"authorization": f"Bearer {KEY_B}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    wait_idle(mesh)
