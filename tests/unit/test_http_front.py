"""The HTTP front as an adapter (gateway/http/server.py and openai_call.py), over a scripted request path: the
status and headers of a failure before the first token, the event stream of one after it,
the body bound and health. Starlette's TestClient runs the app in-process; no mesh."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http import server
from kvmesh.gateway.http.server import HttpFront
from kvmesh.protos.v1 import gateway_pb2


class ScriptedPath:
    """A RequestPath that answers every request with `script`: messages, or a RequestFailed."""

    def __init__(self, script: list) -> None:
        self.script = script
        self.builder = SimpleNamespace(model_name="M")
        self.requests: list[gateway_pb2.GenerateRequest] = []

    def authenticate(self, authorization):
        return ""

    def models(self, authorization):
        return gateway_pb2.ListModelsResponse(models=["M"], max_context_tokens=100)

    async def generate(self, request, metadata, authorization):
        self.requests.append(request)
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item


def _delta(text: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(delta=gateway_pb2.TextDelta(text=text, token_ids=[1]))


FINAL = gateway_pb2.GenerateResponse(
    final=gateway_pb2.Final(finish_reason="stop", prompt_tokens=4, cached_tokens=0, generated_tokens=2)
)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def front():
    fronts = []

    def make(script: list) -> tuple[TestClient, ScriptedPath]:
        path = ScriptedPath(script)
        f = HttpFront(path, "127.0.0.1", 0)  # type: ignore[arg-type]
        fronts.append(f)
        return TestClient(f.app), path

    yield make
    for f in fronts:
        f._sock.close()


def test_a_failure_before_the_first_token_has_its_own_status_even_when_streaming(front):
    client, _ = front([RequestFailed(FailureCause.OVERLOADED, "key-1 has 1 request in flight", retry_after_s=2.5)])
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    # not a 200 event stream: a 429 with whole seconds to wait, rounded up
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"] == {
        "message": "key-1 has 1 request in flight",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    client, _ = front([RequestFailed(FailureCause.NO_INSTANCE, "no decode instance is routable")])
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "retry-after" not in r.headers


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event_then_done(front):
    client, _ = front([_delta("Hel"), _delta("lo"), RequestFailed(FailureCause.INSTANCE_LOST, "decode d1: gone")])
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert (
        error["message"] == "decode d1: gone" and error["code"] == "instance_lost" and error["type"] == "server_error"
    )
    assert [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-2]] == ["Hel", "lo"]


def test_a_whole_answer_joins_the_deltas_and_the_request_goes_to_the_path_translated(front):
    client, path = front([_delta("Hel"), _delta(""), _delta("lo"), FINAL])
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}, headers={"x-request-id": "abc"})
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "cmpl-abc" and body["choices"][0]["text"] == "Hello" and body["usage"]["total_tokens"] == 6
    assert path.requests[0].prompt == b"x" and path.requests[0].sampling.max_tokens == 5


def test_bodies_past_the_bound_or_not_json_are_refused_before_the_path_sees_them(front, monkeypatch):
    monkeypatch.setattr(server, "MAX_BODY_BYTES", 1 << 20)
    client, path = front([FINAL])
    r = client.post("/v1/completions", content=json.dumps({"prompt": "x" * (2 << 20)}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "bad_request"
    assert client.post("/v1/completions", content=b"{").status_code == 400
    assert client.post("/v1/completions", json={"prompt": 3}).json()["error"]["param"] == "prompt"
    assert path.requests == []


def test_health_says_503_until_started_and_models_list_the_served_one(front):
    client, _ = front([])
    assert client.get("/health").status_code == 503  # not started: not serving
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["M"]
    assert client.get("/v1/models/m").json()["max_model_len"] == 100  # any case, as the gateway matches
    assert client.get("/v1/models/gpt-4").status_code == 404


def test_a_body_nested_too_deeply_for_the_json_parser_is_a_400(front):
    client, path = front([FINAL])
    r = client.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
    assert path.requests == []


def _request(headers: dict[str, str], receive) -> Request:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive)


def test_a_declared_length_past_the_bound_is_a_413_before_a_byte_of_the_body_is_read():
    import asyncio

    from kvmesh.gateway.http.body import read_json
    from kvmesh.gateway.http.errors import Refused

    async def receive():
        raise AssertionError("the body was read")

    with pytest.raises(Refused) as refused:
        asyncio.run(read_json(_request({"content-length": str(2 << 20)}, receive), 1 << 20))
    assert refused.value.response.status_code == 413


def test_a_body_that_trickles_in_past_the_read_bound_is_a_408(monkeypatch):
    """A slow client (a few bytes, then nothing) holds its connection only BODY_READ_S seconds."""
    import asyncio

    from kvmesh.gateway.http import body
    from kvmesh.gateway.http.errors import Refused

    monkeypatch.setattr(body, "BODY_READ_S", 0.2)
    parts = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.sleep(3600)  # the rest never comes

    async def read():
        return await asyncio.wait_for(body.read_json(_request({}, receive), 1 << 20), 10)

    with pytest.raises(Refused) as refused:
        asyncio.run(read())
    assert refused.value.response.status_code == 408
    assert b"did not arrive within" in refused.value.response.body
