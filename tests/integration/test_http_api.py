"""The gateway's OpenAI-compatible HTTP front on a real mesh, driven by the official `openai`
package (sync and async, streaming and not) and by raw HTTP (httpx) for the SSE framing.

The instances are the session's shared mesh (tests/conftest.py `observed_mesh`); this module
adds a second gateway in front of them (a gateway loads only a tokenizer: seconds), started
with API keys (a file and KVMESH_API_KEYS), a bound of one request in flight per key, TLS on
both ports with a certificate made here, and HTTP. The shared mesh's own gateway (plain gRPC,
no keys) answers the same greedy requests for comparison: one request path, two fronts.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
import tokenizers
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvmesh.client import GatewayClient, make_request
from kvmesh.engine.loader import resolve_model
from kvmesh.kvstore.block_hash import hash_blocks, tenant_root
from kvmesh.kvstore.redis_index import RedisKVIndex
from kvmesh.launcher import PARENT_PID_ENV
from kvmesh.redis_server import free_port
from kvmesh.runtime.service import wait_for_health
from tests.conftest import instance_stats
from tests.integration.meshutil import complete, wait_idle

KEY_A, KEY_B, KEY_C = "sk-test-alpha-0123", "sk-test-beta-4567", "sk-test-gamma-8901"
"""A and C (the key file's) share the cache namespace team-a; B (KVMESH_API_KEYS) has its own."""
QUESTION = "What is the capital of France?"
LONG = {"max_tokens": 1500, "ignore_eos": True}  # an answer that runs for 15 s or more unless cancelled


@pytest.fixture(scope="module")
def mesh(observed_mesh):
    """Shared with test_mesh and test_observability: 1 prefill, 1 decode, their own gateway."""
    return observed_mesh


def _self_signed(tmp) -> tuple[str, str]:
    """A certificate for 127.0.0.1 (its own CA), and its key, as PEM files in `tmp`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh test gateway")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "gateway.crt", tmp / "gateway.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@dataclass
class Front:
    """The second gateway: gRPC and HTTP over TLS, keys required."""

    grpc_address: str
    base_url: str
    ca_path: str
    log_path: str

    @property
    def ca(self) -> bytes:
        with open(self.ca_path, "rb") as f:
            return f.read()

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_path)

    def http(self, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, verify=self.ssl_context(), timeout=timeout_s)

    def openai(self, key: str = KEY_A) -> openai.OpenAI:
        # no retries: a test sees every status as the gateway sent it
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60, http_client=self.http())

    def async_openai(self, key: str = KEY_A) -> openai.AsyncOpenAI:
        client = httpx.AsyncClient(verify=self.ssl_context(), timeout=60)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60, http_client=client)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="module")
def front(mesh, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front")
    cert, key = _self_signed(tmp)
    (tmp / "keys").write_text(
        f"# the test's keys: A and C share a cache namespace; A's requests go first\n"
        f"{KEY_A} team-a priority=5 weight=2\n{KEY_C} team-a\n"
    )
    grpc_port, http_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="kvmesh-http-gateway-", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "serve",
        "gateway",
        "--port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--redis-url",
        mesh.redis_url,
        *[a for p in mesh.prefill_addresses for a in ("--prefill", p)],
        *[a for d in mesh.decode_addresses for a in ("--decode", d)],
        "--api-key-file",
        str(tmp / "keys"),
        "--max-requests-per-key",
        "1",
        "--tls-cert",
        cert,
        "--tls-key",
        key,
        "--drain-grace",
        "2",
        "--slo-miss",
        "shed",  # requests without an SLO are not affected; one with an SLO no instance can meet is refused
    ]
    env = {**os.environ, "KVMESH_API_KEYS": KEY_B, PARENT_PID_ENV: str(os.getpid())}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    f = Front(f"127.0.0.1:{grpc_port}", f"https://127.0.0.1:{http_port}/v1", cert, log.name)
    try:
        # health is open: no key needed, over TLS
        asyncio.run(wait_for_health(f.grpc_address, 120, root_certificates=f.ca))
        with f.http(timeout_s=5) as c:
            assert c.get(f"https://127.0.0.1:{http_port}/health").json() == {"status": "ok"}
        yield f
    except BaseException:
        print(f.log()[-4000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def _model() -> str:
    return resolve_model(None).name


def test_openai_chat_sync_gives_the_grpc_path_s_greedy_text_and_usage(mesh, front):
    want = complete(mesh, "", messages=[("user", QUESTION)], max_tokens=12)  # the shared mesh's plain gateway
    with front.openai() as client:
        _check_chat(client, want)

    # this gateway's gRPC port, over TLS with the key in the metadata, answers the same
    async def via_grpc():
        async with GatewayClient(front.grpc_address, KEY_B, front.ca) as c:
            return await c.complete(make_request(messages=[("user", QUESTION)], max_tokens=12), timeout_s=60)

    assert asyncio.run(via_grpc()).text == want.text
    wait_idle(mesh)


def _check_chat(client: openai.OpenAI, want) -> None:
    r = client.chat.completions.create(
        model=_model(), messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.model == _model()
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.final.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.final.prompt_tokens, want.final.generated_tokens)
    # the same question again under the same key: its full blocks come from the key's cache
    again = client.chat.completions.create(
        model=_model(), messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0
    )
    assert again.choices[0].message.content == want.text and again.usage.prompt_tokens_details.cached_tokens >= 16
    # streamed, the same text; the first chunk names the role
    chunks = list(
        client.chat.completions.create(
            model=_model(), messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == want.final.finish_reason
    assert [m.id for m in client.models.list().data] == [_model()]


def test_openai_async_completions_streamed_and_whole_agree_and_token_id_prompts_work(mesh, front):
    prompt = "The capital of France is"
    # the tokenizer's own file (the gateway encodes plain text the same way), faster than transformers'
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(resolve_model(None).checkpoint_dir, "tokenizer.json"))
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids

    async def run():
        client = front.async_openai()
        extra = {"ignore_eos": True}  # vLLM's extension: exactly max_tokens tokens
        whole = await client.completions.create(
            model=_model(), prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
        )
        stream = await client.completions.create(
            model=_model(),
            prompt=ids,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens == len(ids)
    # a completion prompt goes as it is (no chat template): its ids are the text's ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    *text_chunks, usage = chunks
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 8 and usage.usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in text_chunks)
    wait_idle(mesh)


def test_raw_sse_framing_and_stop_strings(mesh, front):
    want = complete(mesh, "", messages=[("user", QUESTION)], max_tokens=20, stop=["Paris"])
    body = {
        "model": _model(),
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 20,
        "temperature": 0,
        "stop": "Paris",
        "stream": True,
    }
    with front.http() as c:
        with c.stream("POST", "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(r.iter_bytes())
    # events: "data: <json>" and a blank line each, the last "data: [DONE]"
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.count(b"data: [DONE]") == 1
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-1])
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "stop" and finishes.count(None) == len(chunks) - 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == want.text and "Paris" not in text and text.strip()
    wait_idle(mesh)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_errors_are_openai_error_objects_with_the_right_status(mesh, front):
    chat = {"model": _model(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    a = {"Authorization": f"Bearer {KEY_A}"}
    since = len(front.log())
    with front.http() as c:
        # keys: none or a wrong one is 401 (models too); health needs none
        assert _error(c.post("/chat/completions", json=chat), 401)["code"] == "invalid_api_key"
        assert _error(c.post("/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-no"}), 401)
        assert _error(c.get("/models"), 401)
        assert c.get(front.base_url.removesuffix("/v1") + "/health").status_code == 200
        # wrong types and shapes: 400 naming the field; limits: the request path's own words (as on gRPC)
        assert _error(c.post("/chat/completions", json={**chat, "temperature": "hot"}, headers=a), 400)["param"] == (
            "temperature"
        )
        assert (
            "n must be in [1, 128]"
            in _error(c.post("/chat/completions", json={**chat, "n": 0}, headers=a), 400)["message"]
        )
        too_few = _error(c.post("/chat/completions", json={**chat, "max_tokens": 0}, headers=a), 400)
        assert too_few["message"].startswith("max_tokens must be in [1, ") and too_few["code"] == "bad_request"
        assert _error(c.post("/completions", content=b"{not json", headers=a), 400)
        # an unknown model: 404
        assert _error(c.post("/chat/completions", json={**chat, "model": "gpt-4"}, headers=a), 404)["param"] == "model"
        # an unknown field is ignored, as OpenAI does
        r = c.post("/chat/completions", json={**chat, "frequency_penalty_v9": {"x": 1}}, headers=a)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    # the openai package raises its own types for them
    with front.openai(key="sk-wrong") as wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with front.openai() as client:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4", messages=chat["messages"], max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=_model(), prompt="Hi", n=129)

    # gRPC: no key is UNAUTHENTICATED, an unknown model NOT_FOUND (both fronts, one path)
    async def grpc_code(address, key, ca, **kwargs) -> grpc.StatusCode:
        async with GatewayClient(address, key, ca) as g:
            try:
                await g.complete(make_request("Hi", max_tokens=1, **kwargs), timeout_s=30)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert asyncio.run(grpc_code(front.grpc_address, "", front.ca)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(grpc_code(mesh.gateway_address, "", None, model="gpt-4")) == grpc.StatusCode.NOT_FOUND
    log = front.log()[since:]
    assert "request ended: UNAUTHENTICATED" in log and "request finished: length" in log
    # a whole answer is never logged (nor counted) as cancelled, though the caller stops reading at its end
    assert "request ended: CANCELLED" not in log
    assert not any(k in front.log() for k in (KEY_A, KEY_B, KEY_C, "sk-wrong", "sk-no")), "a key was logged"
    wait_idle(mesh)


def test_openai_logprobs_are_the_grpc_path_s_streamed_or_whole_and_echo_prepends_the_prompt(mesh, front):
    want = complete(mesh, "", messages=[("user", QUESTION)], max_tokens=10, logprobs=3)  # gRPC, checked
    assert len(want.logprobs) == len(want.token_ids)  # against transformers in test_mesh
    ask = dict(model=_model(), messages=[{"role": "user", "content": QUESTION}], max_tokens=10, temperature=0)
    with front.openai() as client:
        whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
        chunks = list(client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True))
        plain = client.chat.completions.create(**ask)
        completion = client.completions.create(model=_model(), prompt=QUESTION, max_tokens=6, temperature=0, logprobs=2)
        echoed = client.completions.create(model=_model(), prompt=QUESTION, max_tokens=6, temperature=0, echo=True)
    content = whole.choices[0].logprobs.content
    # the same numbers within 1e-4 (a cached prefix or another batch moves the last digits)
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    got_top = [t.logprob for e in content for t in e.top_logprobs]
    assert got_top == pytest.approx([v for lp in want.logprobs for v in lp.top_logprobs], abs=1e-4)
    # each token's bytes, end to end, are the answer's text (the last token, EOS, has none)
    text = whole.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode().removesuffix("<|im_end|>") == text == want.text
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    # streamed: every token's entry once, in order, over the chunks
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert plain.choices[0].logprobs is None
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == completion.usage.completion_tokens
    assert all(2 <= len(top) <= 3 and top[t] == v for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert echoed.choices[0].text == QUESTION + completion.choices[0].text
    wait_idle(mesh)


def test_openai_n_choices_whole_and_streamed_assemble_per_choice(mesh, front):
    want = complete(mesh, "", messages=[("user", QUESTION)], max_tokens=8)
    ask = dict(model=_model(), messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0, n=3)
    with front.openai() as client:
        whole = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert [(c.index, c.message.content) for c in whole.choices] == [(i, want.text) for i in range(3)]
    assert whole.usage.completion_tokens == 3 * want.final.generated_tokens
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [want.text] * 3
    finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finishes == {i: want.final.finish_reason for i in range(3)}
    assert chunks[-1].usage.completion_tokens == 3 * want.final.generated_tokens
    wait_idle(mesh)


REFUSED = [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the deprecated form of tools
    ({"tool_choice": "required"}, "tool_choice"),  # with no tools
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
]


def test_an_openai_field_kvmesh_lacks_is_refused_by_name_and_the_front_keeps_serving(mesh, front):
    chat = {"model": _model(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    a = {"Authorization": f"Bearer {KEY_A}"}
    with front.http() as c:
        for body, param in REFUSED:
            error = _error(c.post("/chat/completions", json={**chat, **body}, headers=a), 400)
            assert error["param"] == param and param in error["message"], (body, error)
        # fields with the value that turns them off, after all those refusals: answered
        off = {"tools": [], "tool_choice": "none", "frequency_penalty": 0, "logit_bias": {}, "modalities": ["text"]}
        r = c.post("/chat/completions", json={**chat, **off}, headers=a)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def _wait_freed(mesh, timeout_s: float) -> float:
    """Seconds until decode holds no request and no page and prefill references no page;
    fails after timeout_s (an answer that was not cancelled runs far longer)."""
    start = time.monotonic()
    while True:
        d = instance_stats(mesh.decode_addresses[0], "decode")
        p = instance_stats(mesh.prefill_addresses[0], "prefill")
        if d.num_active_requests == 0 and d.num_free_pages == d.num_pages and p.num_referenced_pages == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, (d, p)
        time.sleep(0.1)


def test_a_key_over_its_bound_gets_429_with_retry_after_and_a_client_gone_mid_stream_frees_both_legs(mesh, front):
    chat = {"model": _model(), "messages": [{"role": "user", "content": "Count to a thousand."}]}
    a, b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
    with front.http() as c:
        with c.stream("POST", "/chat/completions", json={**chat, **LONG, "stream": True}, headers=a) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # key A's one request is running
            assert instance_stats(mesh.decode_addresses[0], "decode").num_active_requests == 1
            # key A is at its bound of 1: refused at once with a retry hint, not queued on prefill
            over = c.post("/chat/completions", json={**chat, "max_tokens": 1}, headers=a)
            assert _error(over, 429)["code"] == "rate_limit_exceeded" and int(over.headers["retry-after"]) >= 1

            # and on gRPC: RESOURCE_EXHAUSTED with retry-after in the trailing metadata
            async def grpc_over():
                async with GatewayClient(front.grpc_address, KEY_A, front.ca) as g:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await g.complete(make_request("Hi", max_tokens=1), timeout_s=30)
                    return err.value

            err = asyncio.run(grpc_over())
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(err.trailing_metadata())["retry-after"]) >= 1
            # another key is not held back by key A's
            assert c.post("/chat/completions", json={**chat, "max_tokens": 2}, headers=b).status_code == 200
        # the stream closed mid-answer: the gateway cancels it on both legs within moments
        _wait_freed(mesh, timeout_s=8)
        assert "client disconnected mid-stream" in front.log()
        # and key A's slot came back
        assert c.post("/chat/completions", json={**chat, "max_tokens": 1}, headers=a).status_code == 200
    wait_idle(mesh)


def test_a_client_gone_before_a_whole_answer_cancels_it(mesh, front):
    with front.http(timeout_s=2) as c:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s and closes
            c.post(
                "/completions",
                json={"prompt": "Count to a thousand:", **LONG},
                headers={"Authorization": f"Bearer {KEY_A}"},
            )
    _wait_freed(mesh, timeout_s=8)
    assert "client disconnected before the answer" in front.log()
    wait_idle(mesh)


TENANT_PROMPT = "The tenants' ledger: " + ", ".join(f"account {i} holds {i * 7} coins" for i in range(12))


def test_each_key_is_a_tenant_of_the_prefix_cache_and_a_shared_namespace_shares_it(mesh, front):
    """The same prompt twice under each key: a key's first request finds nothing another key
    cached (no hit, no faster answer to time), its second finds its own blocks; C, sharing A's
    namespace, finds A's; the keyless gateway finds none of them. The index keeps each tenant's
    blocks under its own salted hashes."""
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(resolve_model(None).checkpoint_dir, "tokenizer.json"))
    ids = tokenizer.encode(TENANT_PROMPT, add_special_tokens=False).ids
    reusable = (len(ids) - 1) // 16 * 16  # prefill recomputes at least the last token
    assert reusable >= 48, len(ids)

    def cached(key: str) -> int:
        with front.openai(key) as client:
            r = client.completions.create(model=_model(), prompt=TENANT_PROMPT, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(KEY_A), cached(KEY_A)] == [0, reusable]
    assert [cached(KEY_B), cached(KEY_B)] == [0, reusable]  # A's blocks are no hit for B
    assert cached(KEY_C) == reusable  # C shares A's namespace

    # the index: A's and B's blocks each under their tenant's chain, none under the keyless one
    prefill_id = instance_stats(mesh.prefill_addresses[0], "prefill").instance_id
    chains = {
        tenant: hash_blocks(ids, 16, tenant_root(tenant))
        for tenant in ("ns:team-a", "key:" + hashlib.sha256(KEY_B.encode()).hexdigest(), "")
    }
    assert len({h for chain in chains.values() for h in chain}) == 3 * len(ids) // 16  # no hash shared

    def indexed() -> list[int]:
        index = RedisKVIndex(mesh.redis_url, model=resolve_model(None).name)
        try:
            return [index.longest_prefix(chain, [prefill_id])[prefill_id] for chain in chains.values()]
        finally:
            index.close()

    deadline = time.monotonic() + 30
    while indexed() != [len(ids) // 16, len(ids) // 16, 0]:  # KV events reach Redis a moment later
        assert time.monotonic() < deadline, indexed()
        time.sleep(0.1)
    # the keyless gateway is one more tenant: none of the keys' blocks is a hit for it
    assert complete(mesh, TENANT_PROMPT, max_tokens=1).final.cached_tokens == 0
    wait_idle(mesh)


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"enum": ["France", "Spain", "Italy"]},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}


def test_structured_output_follows_the_schema_regex_or_choice_from_the_first_token(mesh, front):
    import jsonschema

    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    ask = dict(model=_model(), max_tokens=60)
    with front.openai() as client:
        # a prompt whose free answer starts with words: the mask on prefill's token makes it "{"
        greedy = client.chat.completions.create(
            **ask, messages=[{"role": "user", "content": "Say hello."}], temperature=0, response_format=schema_format
        )
        sampled = client.chat.completions.create(
            **ask, messages=[{"role": "user", "content": "Name a city."}], temperature=1.0, seed=5, n=2,
            response_format=schema_format,
        )  # fmt: skip
        streamed = client.chat.completions.create(
            **ask, messages=[{"role": "user", "content": "Name a city."}], temperature=0, stream=True,
            response_format=schema_format,
        )  # fmt: skip
        streamed_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        regex = client.completions.create(
            **ask, prompt="My phone number is", temperature=0.8, seed=3,
            extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
        )  # fmt: skip
        choice = client.chat.completions.create(
            **ask, messages=[{"role": "user", "content": "What is the capital of Italy?"}], temperature=0,
            extra_body={"guided_choice": ["Paris", "Rome", "Madrid"]},
        )  # fmt: skip
        anything = client.chat.completions.create(
            **ask, messages=[{"role": "user", "content": 'Reply with {"ok": true} and nothing else.'}], temperature=0,
            response_format={"type": "json_object"}, max_completion_tokens=200,
        )  # fmt: skip
    free = complete(mesh, "", messages=[("user", "Say hello.")], max_tokens=3)
    assert not free.text.startswith("{")  # unconstrained, the answer starts otherwise
    for text in [greedy.choices[0].message.content, *(c.message.content for c in sampled.choices), streamed_text]:
        jsonschema.validate(json.loads(text), SCHEMA)  # parses and validates, every time
    assert greedy.choices[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].text), regex.choices[0].text
    assert choice.choices[0].message.content in {"Paris", "Rome", "Madrid"}
    assert anything.choices[0].finish_reason == "stop"  # the object closed before max_tokens
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    # gRPC carries the same grammar
    rx = complete(mesh, "My phone number is", max_tokens=20, grammar=("regex", "[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", rx.text) and rx.final.finish_reason == "stop"
    wait_idle(mesh)


BAD_GRAMMARS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "matches no text"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "not supported"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "'not'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
      {"x": {"type": "array", "contains": {"const": 1}}}}}}], "tool_choice": "required"}, "tools", "'contains'"),
    ({"n": 1000}, "n", "n must be in"),
    ({"n": 100}, "n", "largest decode batch"),
]  # fmt: skip


def test_a_bad_grammar_is_a_400_naming_its_field_and_nothing_is_held(mesh, front):
    chat = {"model": _model(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    a = {"Authorization": f"Bearer {KEY_A}"}
    with front.http() as c:
        for body, param, words in BAD_GRAMMARS:
            error = _error(c.post("/chat/completions", json={**chat, **body}, headers=a), 400)
            assert error["param"] == param and words in error["message"], (body, error)
        assert c.post("/chat/completions", json=chat, headers=a).status_code == 200
    wait_idle(mesh)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_required_or_named_makes_any_model_call_a_tool_streamed_or_whole(mesh, front):
    import jsonschema

    ask = dict(
        model=_model(),
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=60,
        temperature=0,
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    with front.openai() as client:
        whole = client.chat.completions.create(**ask, tool_choice="required")
        forced = client.chat.completions.create(**ask, tool_choice=named)
        chunks = list(client.chat.completions.create(**ask, tool_choice=named, stream=True))
        with pytest.raises(openai.BadRequestError) as err:
            bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            client.chat.completions.create(**{**ask, "tools": [bad]}, tool_choice="required")
    assert err.value.body["param"] == "tools"
    for r in (whole, forced):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert [c.function.name for c in forced.choices[0].message.tool_calls] == ["get_weather"]
    # streamed: the openai client's deltas assemble into the same call
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(forced.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    wait_idle(mesh)


def test_a_session_header_is_taken_and_a_session_id_too_long_is_a_400(mesh, front):
    chat = {"model": _model(), "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2, "temperature": 0}
    a = {"Authorization": f"Bearer {KEY_A}"}
    with front.http() as c:
        first = c.post("/chat/completions", json=chat, headers={**a, "x-session-id": "chat-42"})
        again = c.post("/chat/completions", json=chat, headers={**a, "x-session-id": "chat-42"})
        assert first.status_code == again.status_code == 200
        assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
        error = _error(c.post("/chat/completions", json=chat, headers={**a, "x-session-id": "s" * 300}), 400)
        assert "session id" in error["message"]
    assert "chat-42" not in front.log()  # a session id is user text: never logged
    wait_idle(mesh)


def test_instances_publish_latency_profiles_and_an_slo_none_can_meet_is_shed_with_a_predicted_retry_after(mesh, front):
    # the instances measure themselves as they serve: after a few requests (the earlier tests' on
    # this shared mesh, or these) both publish a profile
    deadline = time.monotonic() + 60
    for i in range(20):
        prefill = instance_stats(mesh.prefill_addresses[0], "prefill")
        decode = instance_stats(mesh.decode_addresses[0], "decode")
        if prefill.prefill_fit and prefill.push_fit and decode.decode_fit and decode.decode_compute_fit:
            break
        # EOS ignored: a raw prompt may end at its first token, and decode must step to measure
        complete(mesh, f"{QUESTION} Answer number {i}, in a long sentence please.", max_tokens=4, ignore_eos=True)
    assert len(prefill.prefill_fit) == 4 and len(prefill.push_fit) == 2 and len(decode.decode_fit) == 3
    # a step's own cost apart from its turn on shared cores, and which cores each shares (one
    # host's for both, or none)
    assert len(decode.decode_compute_fit) == 3 and prefill.core_group == decode.core_group
    # the gateway routes with a prediction (once its stats polls brought both profiles: the two
    # instances are polled apart) and says what it predicted (gRPC Final)
    while not (
        (final := complete(mesh, QUESTION, max_tokens=4).final).predicted_itl_s > 0 and final.predicted_ttft_s > 0
    ):
        assert time.monotonic() < deadline, f"the gateway never predicted both: {final}"
    chat = {"model": _model(), "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
    a = {"Authorization": f"Bearer {KEY_A}"}
    with front.http() as c:
        # 1 ms to the first token: no instance is predicted to make it; refused before any page is
        # taken (served, as without an SLO, until this gateway's poll brings the profiles)
        while (over := c.post("/chat/completions", json=chat, headers={**a, "x-slo-ttft-ms": "1"})).status_code == 200:
            assert time.monotonic() < deadline, "the gateway never shed"
        assert _error(over, 429)["code"] == "rate_limit_exceeded" and int(over.headers["retry-after"]) >= 1
        assert "SLO" in over.json()["error"]["message"]
        # a generous one is served, and a malformed one is the caller's to fix
        assert c.post("/chat/completions", json=chat, headers={**a, "x-slo-ttft-ms": "60000"}).status_code == 200
        assert (
            "x-slo-tpot-ms"
            in _error(c.post("/chat/completions", json=chat, headers={**a, "x-slo-tpot-ms": "soon"}), 400)["message"]
        )
    wait_idle(mesh)


def test_best_of_returns_the_choice_whose_tokens_have_the_highest_summed_logprob(mesh, front):
    ask = dict(model=_model(), prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=21)
    with front.openai() as client:
        every = client.completions.create(**ask, n=3, logprobs=0)
        best = client.completions.create(**ask, best_of=3)
    # best_of=3 draws the same three choices as n=3 with the same seed (choice i: seed + i)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len(set(c.text for c in every.choices)) > 1
    winner = max(range(3), key=lambda i: (scores[i], -i))
    assert [c.text for c in best.choices] == [every.choices[winner].text]
    assert best.choices[0].logprobs is None  # scored with logprobs the client did not ask for
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every drawn token counts
    wait_idle(mesh)


def test_echo_with_logprobs_gives_the_prompt_s_tokens_their_logprobs_first(mesh, front):
    prompt = "The capital of France is"
    want = complete(mesh, prompt, max_tokens=4, prompt_logprobs=1, logprobs=1)  # gRPC
    ask = dict(model=_model(), prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    with front.openai() as client:
        whole = client.completions.create(**ask)
        chunks = list(client.completions.create(**ask, stream=True))
    lp = whole.choices[0].logprobs
    n_prompt = len(want.prompt_logprobs)
    assert whole.choices[0].text == prompt + want.text
    assert len(lp.tokens) == n_prompt + len(want.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first
    expected = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(lp.tokens[:n_prompt]) == prompt and lp.text_offset[0] == 0
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    wait_idle(mesh)


def test_the_fuzzer_s_open_streams_probe_sees_the_key_bound_and_fails_past_it(mesh, front):
    from kvmesh.bench.fuzz_probes import probe_open_streams

    base, key = front.base_url.removesuffix("/v1"), {"authorization": f"Bearer {KEY_C}"}
    # key C's bound is 1: one stream open, the next request is a 429, and the slot comes back
    assert asyncio.run(probe_open_streams(base, _model(), 1, headers=key, verify=front.ssl_context())) == "ok"
    # told the bound is 2, the probe fails: its second stream is itself refused
    past = asyncio.run(probe_open_streams(base, _model(), 2, headers=key, verify=front.ssl_context()))
    assert past.startswith("1 of the 2 streams were refused: 429"), past
    # the probe left each stream as soon as it started: the gateway released decode's
    # reservation at once, not when its KV deadline (~40 s) freed it (a Generate cancelled
    # before it went out never reached decode, and no Release followed: 2 in 8 runs)
    wait_idle(mesh, timeout_s=15)
