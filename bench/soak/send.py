"""How the soak sends each kind of request (bench/soak/workload.py) through the real clients, the
openai client over the gateways' HTTP API and kvmesh's GatewayClient over gRPC, and judges it:
`run_one` sends one within its bound and checks it against the reference, `reference_answers`
is the quiet reference run, `drive` the seeded load.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable

from kvmesh.bench.soak.clients import Clients, status_of
from kvmesh.bench.soak.workload import (
    CHECKED,
    DEADLINE_S,
    DOC_QUESTIONS,
    DOCS,
    HANG_SLACK_S,
    KINDS,
    MAX_TOKENS,
    MODEL,
    QUESTIONS,
    SCHEMA,
    TOOLS,
    TOP_LOGPROBS,
    Answer,
    Outcome,
    Spec,
    draw,
    pool_size,
    token_logprobs,
)
from kvmesh.client import make_request

PLAIN = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
CHAT = {**PLAIN, "logprobs": True, "top_logprobs": TOP_LOGPROBS}


def _chat_messages(spec: Spec) -> list[dict]:
    if spec.kind == "long":
        doc, question = divmod(spec.prompt, len(DOC_QUESTIONS))
        return [{"role": "user", "content": f"{DOCS[doc]}\n\n{DOC_QUESTIONS[question]}"}]
    if spec.kind == "json":
        return [{"role": "user", "content": f"Answer as JSON with a city and its country. {QUESTIONS[spec.prompt]}"}]
    return [{"role": "user", "content": QUESTIONS[spec.prompt]}]


def _chat_answer(r, text: str | None = None, tool_calls: list[str] | None = None) -> Answer:
    """A whole chat completion's Answer: its first choice's text, tool calls and token logprobs."""
    choice = r.choices[0]
    lps, tokens, tops = token_logprobs(choice.logprobs.content if choice.logprobs else None)
    text = choice.message.content or "" if text is None else text
    return Answer([text], tool_calls=tool_calls or [], logprobs=lps, tokens=tokens, tops=tops, request_ids=[r.id])


Sent = tuple[Answer | None, float | None]
"""A sent request's answer (None for the unchecked kinds: n2, cancel) and TTFT (s, None when not
measured)."""


class _Send:
    """One request of `spec` on its gateway and key, sent at `sent` (seconds into the run): a
    method for each kind of workload.KINDS."""

    def __init__(self, clients: Clients, spec: Spec, clock: Callable[[], float], session: str) -> None:
        self.clients, self.spec, self.clock, self.session_id = clients, spec, clock, session
        self.http = clients.http[spec.gateway][spec.key]
        self.sent = clock()

    async def chat(self) -> Sent:
        r = await self.http.chat.completions.create(messages=_chat_messages(self.spec), **CHAT)
        return _chat_answer(r), None

    async def chat_stream(self) -> Sent:
        stream = await self.http.chat.completions.create(stream=True, messages=_chat_messages(self.spec), **CHAT)
        answer, ttft = Answer([""]), None
        async for chunk in stream:
            answer.request_ids[:] = [chunk.id]
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                ttft = ttft if ttft is not None else self.clock() - self.sent
                answer.text[0] += choice.delta.content
            if choice.logprobs is not None:
                _, tokens, tops = token_logprobs(choice.logprobs.content)
                answer.tokens += tokens
                answer.tops += tops
        return answer, ttft if ttft is not None else self.clock() - self.sent

    long = chat_stream

    async def completion(self) -> Sent:
        prompt = f"Q: {QUESTIONS[self.spec.prompt]}\nA:"
        r = await self.http.completions.create(prompt=prompt, **PLAIN)
        return Answer([r.choices[0].text], request_ids=[r.id]), None

    async def grpc(self) -> Sent:
        request_id = f"soak-grpc-{uuid.uuid4().hex}"
        request = make_request(QUESTIONS[self.spec.prompt], chat=True, max_tokens=MAX_TOKENS, request_id=request_id)
        ids, ttft = [], None
        client = self.clients.grpc[self.spec.gateway][self.spec.key]
        async for msg in client.stream(request, timeout_s=DEADLINE_S):
            if msg.HasField("delta"):
                ttft = ttft if ttft is not None else self.clock() - self.sent
                ids.extend(msg.delta.token_ids)
        return Answer([" ".join(map(str, ids))], request_ids=[request_id]), ttft

    async def session(self) -> Sent:
        """Two turns in one session; turn 2 is only compared once turn 1 agreed token for token."""
        headers = {"x-session-id": self.session_id}
        messages = [{"role": "user", "content": QUESTIONS[self.spec.prompt]}]
        first = await self.http.chat.completions.create(messages=messages, extra_headers=headers, **CHAT)
        said = first.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "Say it in other words."}]
        second = await self.http.chat.completions.create(messages=messages, extra_headers=headers, **CHAT)
        a, b = _chat_answer(first), _chat_answer(second)
        return (
            Answer(
                a.text + b.text,
                tokens=a.tokens + b.tokens,
                tops=a.tops + b.tops,
                request_ids=a.request_ids + b.request_ids,
            ),
            None,
        )

    async def json(self) -> Sent:
        schema = {"type": "json_schema", "json_schema": SCHEMA}
        r = await self.http.chat.completions.create(messages=_chat_messages(self.spec), response_format=schema, **CHAT)
        a = _chat_answer(r)
        return Answer(a.text, tokens=a.tokens, tops=a.tops, request_ids=a.request_ids), None

    async def tools(self) -> Sent:
        r = await self.http.chat.completions.create(messages=_chat_messages(self.spec), tools=TOOLS, **CHAT)
        calls = [f"{c.function.name}({c.function.arguments})" for c in r.choices[0].message.tool_calls or []]
        a = _chat_answer(r, tool_calls=calls)
        return Answer(a.text, tool_calls=calls, tokens=a.tokens, tops=a.tops, request_ids=a.request_ids), None

    async def responses(self) -> Sent:
        """Two turns of the Responses API, the second through `previous_response_id` (the first
        is stored in Redis, which any gateway reads)."""
        first = await self.http.responses.create(
            model=MODEL, input=QUESTIONS[self.spec.prompt], max_output_tokens=MAX_TOKENS, temperature=0.0
        )
        second = await self.http.responses.create(
            model=MODEL,
            input="Say it in other words.",
            previous_response_id=first.id,
            max_output_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        return Answer([first.output_text, second.output_text], request_ids=[first.id, second.id]), None

    async def messages(self) -> Sent:
        """Anthropic's Messages API through the anthropic client."""
        claude = self.clients.anthropic[self.spec.gateway][self.spec.key]
        r = await claude.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": QUESTIONS[self.spec.prompt]}],
            extra_body={"temperature": 0.0},  # this client version takes sampling fields only here
        )
        return Answer(["".join(b.text for b in r.content if b.type == "text")], request_ids=[r.id]), None

    async def n2(self) -> Sent:
        sampled = {**PLAIN, "temperature": 0.8}
        r = await self.http.chat.completions.create(
            messages=_chat_messages(self.spec), n=2, seed=self.spec.seed, **sampled
        )
        if len(r.choices) != 2:
            raise ValueError(f"n = 2 answered {len(r.choices)} choices")
        return None, None

    async def cancel(self) -> Sent:
        """A stream the client leaves after its second chunk."""
        stream = await self.http.chat.completions.create(stream=True, messages=_chat_messages(self.spec), **CHAT)
        ttft, chunks = None, 0
        async for _chunk in stream:
            ttft = ttft if ttft is not None else self.clock() - self.sent
            chunks += 1
            if chunks == 2:
                break
        await stream.close()
        return None, ttft


def send(clients: Clients, spec: Spec, clock: Callable[[], float], session: str) -> Awaitable[Sent]:
    """Send `spec`: its answer and TTFT (Sent). Raises what the client raises (openai.APIError,
    grpc.aio.AioRpcError), ValueError for an unknown kind."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown kind {spec.kind!r}")
    return getattr(_Send(clients, spec, clock, session), spec.kind)()


async def run_one(
    clients: Clients, spec: Spec, clock: Callable[[], float], session: str, reference: dict | None
) -> tuple[Outcome, Answer | None]:
    """Send `spec` within DEADLINE_S + HANG_SLACK_S and judge it against `reference` (None: no check)."""
    sent = clock()
    try:
        answer, ttft = await asyncio.wait_for(send(clients, spec, clock, session), DEADLINE_S + HANG_SLACK_S)
    except Exception as exc:  # every failure is an outcome; the soak goes on
        return Outcome(spec.kind, spec.gateway, spec.key, sent, clock(), status_of(exc), detail=str(exc)[:300]), None
    status = "cancelled" if spec.kind == "cancel" else "ok"
    out = Outcome(spec.kind, spec.gateway, spec.key, sent, clock(), status, ttft)
    if answer is not None and reference is not None and spec.ref_key in reference:
        ref = reference[spec.ref_key]
        differs = answer.differs(ref)
        tie = answer.near_tie(ref) if differs.startswith("text") else ""
        out.near_tie, out.wrong = (tie, "") if tie else ("", differs)
        if out.wrong:
            out.detail = f"request ids {' '.join(answer.request_ids)}"
    return out, answer


async def reference_answers(clients: Clients, clock: Callable[[], float]) -> dict[tuple[str, int], Answer]:
    """Every checked request's answer on the quiet mesh, one at a time through the first gateway
    and key. Raises RuntimeError when one fails: a soak needs every reference."""
    reference = {}
    for kind in sorted(CHECKED):
        for prompt in range(pool_size(kind)):
            spec = Spec(kind, prompt)
            out, answer = await run_one(clients, spec, clock, f"soak-reference-{kind}-{prompt}", None)
            if out.status != "ok" or answer is None:
                raise RuntimeError(f"the quiet reference run failed {kind} #{prompt}: {out.status} {out.detail}")
            reference[spec.ref_key] = answer
    return reference


async def drive(
    clients: Clients,
    reference: dict,
    seed: int,
    concurrency: int,
    until: float,
    clock: Callable[[], float],
    num_gateways: int,
    num_keys: int,
) -> list[Outcome]:
    """`concurrency` workers send seeded requests until `clock()` passes `until`; every outcome."""
    outcomes: list[Outcome] = []

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        n = 0
        while clock() < until:
            spec = draw(rng, num_gateways, num_keys)
            out, _ = await run_one(clients, spec, clock, f"soak-{seed}-{w}-{n}", reference)
            outcomes.append(out)
            n += 1
            if out.status not in ("ok", "cancelled"):
                await asyncio.sleep(0.2)  # a failed request is not retried at once in a tight loop

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return outcomes
