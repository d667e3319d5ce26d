"""`kvmesh fuzz --http`: random and hostile requests against the gateway's HTTP front, every field
of the four APIs it serves (OpenAI's chat completions, completions and Responses, Anthropic's
Messages), headers, bodies at and past their bounds, and clients that leave or stall.

Request i is a plain valid one of a random API (1-8 tokens) bent by one or more cases (HTTP_CASES):
a field set to a hostile value (wrong type, null, huge or negative numbers, NaN and Infinity
literals, huge, control-token or lone-surrogate text, deep nesting), a field the API does not know,
a message of an odd role or shape, odd headers (authorization, session, SLO, content type), a body
that is not JSON, nests too deeply, is a JSON array, or is past the size bound, a stream the
client leaves after its first chunk. Built from (seed, i) alone, as `kvmesh fuzz` builds its gRPC
requests (bench/fuzz_cases.py), so a failure's seed and index replay it.

A request fails the run when it gets a 5xx, when a 200 is not the API's shape (a body that is
not JSON, a stream without its end), or when a small request (max tokens set and small) gets
no answer within its deadline. The bound probes run beside them (bench/fuzz_probes.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvmesh.bench.fuzz_cases import CONTROL_TEXT, PROMPTS
from kvmesh.bench.fuzz_report import Result, send_all

ENDPOINTS = {
    "/v1/chat/completions": [
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
        "stream", "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "tools", "tool_choice",
        "parallel_tool_calls", "response_format", "ignore_eos", "min_tokens", "metadata", "store",
        "service_tier", "prompt_logprobs", "reasoning_effort",
    ],
    "/v1/completions": [
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
        "stop", "seed", "echo", "suffix", "best_of", "logprobs", "logit_bias", "user", "presence_penalty",
        "frequency_penalty", "ignore_eos", "prompt_logprobs",
    ],
    "/v1/responses": [
        "model", "input", "instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p",
        "tools", "tool_choice", "text", "store", "stream", "metadata", "truncation", "reasoning", "user",
    ],
    "/v1/messages": [
        "model", "system", "messages", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
        "stream", "tools", "tool_choice", "metadata",
    ],
}  # fmt: skip
"""Each API's fields, as its reference documents them (and kvmesh's extensions)."""
HTTP_CASES = {"field": 8, "unknown_field": 1, "messages": 3, "headers": 2, "body": 2, "leave": 1}
SMALL_MAX_TOKENS = 8
NAN_LITERALS = ("NaN", "Infinity", "-Infinity")


@dataclass(frozen=True)
class HttpCase:
    """One request: what bent it, its method, path, headers and raw body, whether it streams, and
    whether it is small (its deadline must not pass)."""

    case: str
    path: str
    headers: dict[str, str | bytes]
    """Values as bytes are sent as they are (not ASCII)."""
    body: bytes
    stream: bool
    small: bool
    leave_after_first_chunk: bool = False

    def describe(self) -> str:
        return f"{self.path} {self.body[:160]!r}{'...' if len(self.body) > 160 else ''} headers={self.headers}"


def _text(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return rng.choice(CONTROL_TEXT) * rng.randint(1, 50)
    if kind == 1:
        return "x" * rng.choice([0, 1, 10_000, 200_000])
    if kind == 2:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(1, 200)))
    if kind == 3:
        return "".join(chr(rng.randrange(0, 32)) for _ in range(rng.randint(1, 50)))
    if kind == 4:
        return "\ud800"  # a lone surrogate: encoded as the escape \ud800
    return rng.choice(PROMPTS)


def _value(rng: random.Random, depth: int = 0):
    """A hostile JSON value (NAN_LITERALS come back as markers, written raw by _dumps)."""
    kind = rng.randrange(14)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 2**31, 2**63, -(2**63), 10**30])
    if kind == 3:
        return rng.choice([0.0, -0.5, 1e-300, 1e308, -1e308, 0.7, 2.5])
    if kind == 4:
        return {"__raw__": rng.choice(NAN_LITERALS)}
    if kind == 5:
        return _text(rng)
    if kind == 6:
        return []
    if kind == 7:
        return {}
    if kind == 8 and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.randint(1, 5))]
    if kind == 9 and depth < 3:
        return {_text(rng)[:20]: _value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    if kind == 10:
        return [rng.choice(PROMPTS) for _ in range(rng.choice([2, 300]))]
    if kind == 11:
        return {"type": rng.choice(["json_schema", "json_object", "text", "function", "regex", "x"])}
    if kind == 12:
        return [{"type": "function", "function": {"name": _text(rng)[:40], "parameters": _value(rng, depth + 1)}}]
    return rng.randint(1, SMALL_MAX_TOKENS)


def _dumps(body) -> bytes:
    """JSON with {"__raw__": "NaN"} markers written as the bare literal (not JSON, as some clients send)."""
    text = json.dumps(body, ensure_ascii=True, allow_nan=True)
    for lit in NAN_LITERALS:
        text = text.replace(json.dumps({"__raw__": lit}), lit)
    return text.encode()


def _base(path: str, rng: random.Random, model: str) -> tuple[dict, int]:
    k = rng.randint(1, SMALL_MAX_TOKENS)
    prompt = rng.choice(PROMPTS)
    if path == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": k}, k
    if path == "/v1/completions":
        return {"model": model, "prompt": prompt, "max_tokens": k}, k
    if path == "/v1/responses":
        return {"model": model, "input": prompt, "max_output_tokens": k, "store": False}, k
    return {"model": model, "max_tokens": k, "messages": [{"role": "user", "content": prompt}]}, k


def _message(rng: random.Random):
    role = rng.choice(["system", "user", "assistant", "tool", "developer", "function", "", "x" * 300, None, 3])
    kind = rng.randrange(5)
    if kind == 0:
        content = [{"type": rng.choice(["text", "image_url", "input_text", "x"]), "text": _text(rng)}]
    elif kind == 1:
        content = _value(rng)
    else:
        content = _text(rng)
    message = {"role": role, "content": content}
    if rng.random() < 0.3:
        message["tool_calls"] = [{"id": _text(rng)[:20], "type": "function", "function": _value(rng)}]
    if rng.random() < 0.2:
        message["name"] = _text(rng)[:50]
    return message


def build_http_case(seed: int, index: int, model: str, max_body_bytes: int) -> HttpCase:
    """Request `index` of the run seeded `seed` (see the module docstring)."""
    rng = random.Random(seed * 1_000_003 + index)
    path = rng.choice(list(ENDPOINTS))
    body, k = _base(path, rng, model)
    headers: dict[str, str | bytes] = {"content-type": "application/json"}
    cases = rng.choices(list(HTTP_CASES), weights=list(HTTP_CASES.values()), k=rng.choice([1, 1, 1, 2, 3]))
    raw: bytes | None = None
    stream, leave, small = False, False, True
    for case in cases:
        if case == "field":
            field = rng.choice(ENDPOINTS[path])
            body[field] = _value(rng)
            small = small and field not in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n")
            small = small and field not in ("ignore_eos", "min_tokens", "best_of", "messages", "input", "prompt")
        elif case == "unknown_field":
            body[_text(rng)[:30] or "x"] = _value(rng)
        elif case == "messages":
            key = "input" if path == "/v1/responses" else "prompt" if path == "/v1/completions" else "messages"
            body[key] = [_message(rng) for _ in range(rng.choice([0, 1, 2, 40]))]
            small = False
        elif case == "headers":
            name = rng.choice(["authorization", "x-session-id", "x-slo-ttft-ms", "x-slo-tpot-ms", "content-type"])
            value = rng.choice(["", "Bearer ", "Bearer " + "k" * 5000, "-1", "1e309", "abc", "\u00e9t\u00e9", "0"])
            headers[name] = value.encode("utf-8")
        elif case == "body":
            kind = rng.randrange(5)
            raw = [
                b"{",
                b"[" * 100_000 + b"]" * 100_000,
                b"[1, 2, 3]",
                b"\xef\xbb\xbf" + _dumps(body),
                b'{"model": "x", "messages": "\\ud800"}',
            ][kind]
        elif case == "leave":
            stream, leave = True, True
    if stream or rng.random() < 0.25:
        stream = True
        body["stream"] = True
    content = raw if raw is not None else _dumps(body)
    if len(content) > max_body_bytes:
        small = False
    return HttpCase(
        "+".join(sorted(set(cases))), path, headers, content, stream, small and k <= SMALL_MAX_TOKENS, leave
    )


async def send_http(client: httpx.AsyncClient, c: HttpCase, deadline_s: float) -> tuple[str, str]:
    """(status, details): "http_<code>", "OK_MALFORMED" for a 200 that is not the API's shape,
    "left" for a stream the client left, "timeout" for no answer within deadline_s,
    "transport_error" for a connection the server broke, "client_refused" for one httpx would not
    send."""
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", c.path, content=c.body, headers=c.headers) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")
                    return f"http_{r.status_code}", text[:300]
                if c.leave_after_first_chunk:
                    async for _ in r.aiter_bytes():
                        return "left", ""
                text = (await r.aread()).decode("utf-8", "replace")
                streamed = r.headers.get("content-type", "").startswith("text/event-stream")
    except TimeoutError:
        return "timeout", f"no answer within {deadline_s} s"
    except httpx.LocalProtocolError as exc:  # httpx would not send it (a header value h11 refuses)
        return "client_refused", repr(exc)[:300]
    except httpx.HTTPError as exc:
        return "transport_error", repr(exc)[:300]
    except Exception as exc:  # the client library refused it otherwise: not the server's doing
        return "client_refused", repr(exc)[:300]
    return ("OK_MALFORMED", text[:300]) if _malformed(c, text, streamed) else ("http_200", "")


def _malformed(c: HttpCase, text: str, streamed: bool) -> bool:
    """Whether a 200's body is not its API's shape: JSON, or an SSE stream (the response's
    content type says which: a hostile `stream` field may ask for one the case did not mean)."""
    if not streamed:
        try:
            json.loads(text)
        except ValueError:
            return True
        return False
    if c.path in ("/v1/chat/completions", "/v1/completions"):
        return not text.rstrip().endswith("data: [DONE]")
    return "event:" not in text and "data:" not in text


def is_http_failure(r: Result) -> bool:
    """A 5xx, a malformed 200, a transport error, or a small request past its deadline."""
    return (
        r.status.startswith("http_5")
        or r.status in ("OK_MALFORMED", "transport_error")
        or (r.status == "timeout" and r.small)
    )


async def fuzz_http(
    base_url: str,
    model: str,
    seed: int,
    indices: list[int],
    concurrency: int,
    deadline_s: float,
    max_body_bytes: int,
    say: Callable[..., None],
) -> list[Result]:
    """Send case i for each i in indices, `concurrency` at a time; one Result each, in order."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=deadline_s + 5, limits=limits) as client:

        async def one(i: int) -> Result:
            c = build_http_case(seed, i, model, max_body_bytes)
            t0 = time.perf_counter()
            status, details = await send_http(client, c, deadline_s)
            return Result(i, c.case, status, details, c.small, time.perf_counter() - t0, c.describe())

        return await send_all(indices, concurrency, one, say)
