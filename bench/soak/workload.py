"""The soak's requests: a mixed, seeded workload through the real clients (the openai client over
the gateways' HTTP API, kvmesh's GatewayClient over gRPC), and each greedy answer's check against
the answer a quiet reference run gave to the same request.

Kinds (`KINDS`, with their weights): chat with logprobs, streamed chat, completions, gRPC
Generate, long prompts sharing a document (decode-side reuse, peer pulls, the tier), two-turn
conversations in a session, n = 2 sampled with a seed, json_schema, tools, and streams the
client cancels after two chunks. Every request goes to either gateway with either API key (two
tenants; the second in a higher priority band). Every greedy kind is checked: its text (and tool
calls) equal the reference's, its logprobs within LOGPROB_TOLERANCE. A request that ends with a
status is failed, not wrong; one that has not ended DEADLINE_S + HANG_SLACK_S after it was sent
is hung.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import openai

from kvmesh.client import GatewayClient, make_request

DEADLINE_S = 60.0
"""Each request's deadline: the gRPC deadline; over HTTP the gateway's own bounds (its queue
time, token timeout) end a request before it."""
HANG_SLACK_S = 10.0
"""A request that has not ended this long after its deadline is hung."""
LOGPROB_TOLERANCE = 1e-4
NEAR_TIE_NATS = 1e-3
"""Two tokens whose logprobs lie this close are a near tie: the mesh's fp32 answers are equal to
transformers' in the tests, but not bit for bit across every path (a prefix hit, decode-side
reuse, another batch give logprobs ~1e-5 apart), so greedy decoding may take either."""
TOP_LOGPROBS = 5
MAX_TOKENS = 16
MODEL = "SmolLM2-135M-Instruct"
"""The default model, which the soak's mesh serves."""

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Which planet is closest to the sun?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What do bees make?",
]
_DOC_SENTENCES = [
    "The harbour town kept its lighthouse lit every night for two hundred years.",
    "Fishing boats left before dawn and came back with herring, cod and mackerel.",
    "In winter the storms closed the harbour for weeks at a time.",
    "The school by the church taught the children to read, count and mend nets.",
    "Every summer a fair filled the square with music, bread and painted boats.",
    "The old keeper wrote the weather in a book that is now in the town museum.",
]
DOCS = [" ".join(_DOC_SENTENCES[(d + i) % len(_DOC_SENTENCES)] for i in range(24)) for d in range(3)]
"""Three long documents (~400 tokens each) that many prompts share: prefix hits, pulls, the tier."""
DOC_QUESTIONS = ["What did the fishing boats bring back?", "What closed the harbour?", "Who wrote the weather down?"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SCHEMA = {
    "name": "place",
    "schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    },
}

KINDS = {
    "chat": 3,
    "chat_stream": 3,
    "completion": 2,
    "grpc": 2,
    "long": 3,
    "session": 2,
    "n2": 1,
    "json": 1,
    "tools": 1,
    "cancel": 1,
}
CHECKED = {"chat", "chat_stream", "completion", "grpc", "long", "session", "json", "tools"}


@dataclass(frozen=True)
class Spec:
    """One request to send: its kind, which prompt of the kind's pool, gateway and key (indexes)."""

    kind: str
    prompt: int
    gateway: int = 0
    key: int = 0
    seed: int = 0

    @property
    def ref_key(self) -> tuple[str, int]:
        return (self.kind, self.prompt)


def pool_size(kind: str) -> int:
    if kind == "long":
        return len(DOCS) * len(DOC_QUESTIONS)
    return len(QUESTIONS)


def draw(rng: random.Random, num_gateways: int, num_keys: int) -> Spec:
    """The next request of the seeded workload."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    return Spec(
        kind, rng.randrange(pool_size(kind)), rng.randrange(num_gateways), rng.randrange(num_keys), rng.getrandbits(31)
    )


@dataclass
class Answer:
    """What a greedy request answered: text (every turn's, for a session), tool calls, logprobs,
    and, where the API gives them, each answer token and its TOP_LOGPROBS alternatives (all turns
    in a row): what tells a near tie from a wrong answer."""

    text: list[str]
    tool_calls: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    tops: list[dict[str, float]] = field(default_factory=list)

    def differs(self, ref: Answer) -> str:
        """Why this answer is not the reference's ("" when it is)."""
        if self.text != ref.text:
            return f"text {self.text!r} != {ref.text!r}"
        if self.tool_calls != ref.tool_calls:
            return f"tool calls {self.tool_calls!r} != {ref.tool_calls!r}"
        if len(self.logprobs) != len(ref.logprobs):
            return f"{len(self.logprobs)} logprobs != {len(ref.logprobs)}"
        worst = max((abs(a - b) for a, b in zip(self.logprobs, ref.logprobs, strict=True)), default=0.0)
        return f"a logprob differs by {worst:.2e}" if worst > LOGPROB_TOLERANCE else ""

    def near_tie(self, ref: Answer) -> str:
        """Where this answer first takes another token than the reference did, when that token was
        within NEAR_TIE_NATS of the reference's own there (by the reference's logprobs): a greedy
        step between two near-equal logits, which rounding decides; "" otherwise (or when either
        side has no token logprobs)."""
        if not self.tokens or not ref.tokens or len(ref.tops) != len(ref.tokens):
            return ""
        for i, (ours, theirs) in enumerate(zip(self.tokens, ref.tokens, strict=False)):
            if ours != theirs:
                top = ref.tops[i]
                if ours in top and theirs in top and abs(top[theirs] - top[ours]) <= NEAR_TIE_NATS:
                    return f"token {i}: {ours!r} for {theirs!r}, {abs(top[theirs] - top[ours]):.1e} nats apart"
                return ""
        return ""


def _token_logprobs(entries) -> tuple[list[float], list[str], list[dict[str, float]]]:
    """OpenAI chat logprobs entries as (logprobs, tokens, top alternatives)."""
    entries = entries or []
    return (
        [t.logprob for t in entries],
        [t.token for t in entries],
        [{a.token: a.logprob for a in t.top_logprobs or []} for t in entries],
    )


@dataclass
class Outcome:
    """How one request ended: status "ok", "cancelled" (by the client), a gRPC status name, "http_<code>",
    "connect_error" (the gateway was down), "stream_error" (an error event in an SSE stream), or
    "hung"; seconds into the run; wrong: why its answer differs from the reference ("" when not)."""

    kind: str
    gateway: int
    key: int
    sent: float
    ended: float
    status: str
    ttft_s: float | None = None
    wrong: str = ""
    near_tie: str = ""
    """Where a greedy answer that differs from the reference took a near-tied token (not wrong)."""
    detail: str = ""


class Clients:
    """An openai client and a GatewayClient per (gateway, key): `http_urls` the gateways' /v1 URLs,
    `grpc_addresses` their gRPC addresses, `keys` the API keys."""

    def __init__(self, http_urls: list[str], grpc_addresses: list[str], keys: list[str]) -> None:
        self.http = [
            [openai.AsyncOpenAI(base_url=u, api_key=k, timeout=DEADLINE_S + HANG_SLACK_S, max_retries=0) for k in keys]
            for u in http_urls
        ]
        self.grpc = [[GatewayClient(a, api_key=k) for k in keys] for a in grpc_addresses]

    async def __aenter__(self) -> Clients:
        for row in self.grpc:
            for c in row:
                await c.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for row in self.grpc:
            for c in row:
                await c.__aexit__(None, None, None)
        for row in self.http:
            for c in row:
                await c.close()


def _chat_messages(spec: Spec) -> list[dict]:
    if spec.kind == "long":
        doc, question = divmod(spec.prompt, len(DOC_QUESTIONS))
        return [{"role": "user", "content": f"{DOCS[doc]}\n\n{DOC_QUESTIONS[question]}"}]
    if spec.kind == "json":
        return [{"role": "user", "content": f"Answer as JSON with a city and its country. {QUESTIONS[spec.prompt]}"}]
    return [{"role": "user", "content": QUESTIONS[spec.prompt]}]


async def _stream_chat(
    client: openai.AsyncOpenAI, clock: Callable[[], float], sent: float, **kw
) -> tuple[Answer, float]:
    """A streamed chat's answer (text, token logprobs) and its TTFT (s)."""
    stream = await client.chat.completions.create(stream=True, **kw)
    answer, ttft = Answer([""]), None
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            ttft = ttft if ttft is not None else clock() - sent
            answer.text[0] += choice.delta.content
        if choice.logprobs is not None:
            lps, tokens, tops = _token_logprobs(choice.logprobs.content)
            answer.tokens += tokens
            answer.tops += tops
    return answer, ttft if ttft is not None else clock() - sent


async def send(
    clients: Clients, spec: Spec, clock: Callable[[], float], session: str
) -> tuple[Answer | None, float | None]:
    """Send `spec`; (its answer, TTFT s) (answer None for the unchecked kinds: n2, cancel).
    Raises what the client raises (openai.APIError, grpc.aio.AioRpcError)."""
    http = clients.http[spec.gateway][spec.key]
    sent = clock()
    plain = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    chat = {**plain, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    if spec.kind == "chat":
        r = await http.chat.completions.create(messages=_chat_messages(spec), **chat)
        lps, tokens, tops = _token_logprobs(r.choices[0].logprobs.content if r.choices[0].logprobs else None)
        return Answer([r.choices[0].message.content or ""], logprobs=lps, tokens=tokens, tops=tops), None
    if spec.kind in ("chat_stream", "long"):
        return await _stream_chat(http, clock, sent, messages=_chat_messages(spec), **chat)
    if spec.kind == "completion":
        r = await http.completions.create(
            model=MODEL, prompt=f"Q: {QUESTIONS[spec.prompt]}\nA:", max_tokens=MAX_TOKENS, temperature=0.0
        )
        return Answer([r.choices[0].text]), None
    if spec.kind == "grpc":
        request = make_request(QUESTIONS[spec.prompt], chat=True, max_tokens=MAX_TOKENS)
        ids, ttft = [], None
        async for msg in clients.grpc[spec.gateway][spec.key].stream(request, timeout_s=DEADLINE_S):
            if msg.HasField("delta"):
                ttft = ttft if ttft is not None else clock() - sent
                ids.extend(msg.delta.token_ids)
        return Answer([" ".join(map(str, ids))]), ttft
    if spec.kind == "session":
        headers = {"x-session-id": session}
        messages = [{"role": "user", "content": QUESTIONS[spec.prompt]}]
        first = await http.chat.completions.create(messages=messages, extra_headers=headers, **chat)
        said = first.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "Say it in other words."}]
        second = await http.chat.completions.create(messages=messages, extra_headers=headers, **chat)
        answer = Answer([said, second.choices[0].message.content or ""])
        for r in (first, second):  # turn 2 is only compared once turn 1 agreed token for token
            _, tokens, tops = _token_logprobs(r.choices[0].logprobs.content if r.choices[0].logprobs else None)
            answer.tokens += tokens
            answer.tops += tops
        return answer, None
    if spec.kind == "json":
        r = await http.chat.completions.create(
            messages=_chat_messages(spec), response_format={"type": "json_schema", "json_schema": SCHEMA}, **chat
        )
        _, tokens, tops = _token_logprobs(r.choices[0].logprobs.content if r.choices[0].logprobs else None)
        return Answer([r.choices[0].message.content or ""], tokens=tokens, tops=tops), None
    if spec.kind == "tools":
        r = await http.chat.completions.create(messages=_chat_messages(spec), tools=TOOLS, **chat)
        message = r.choices[0].message
        calls = [f"{c.function.name}({c.function.arguments})" for c in message.tool_calls or []]
        _, tokens, tops = _token_logprobs(r.choices[0].logprobs.content if r.choices[0].logprobs else None)
        return Answer([message.content or ""], tool_calls=calls, tokens=tokens, tops=tops), None
    if spec.kind == "n2":
        r = await http.chat.completions.create(
            messages=_chat_messages(spec), n=2, seed=spec.seed, **{**plain, "temperature": 0.8}
        )
        if len(r.choices) != 2:
            raise ValueError(f"n = 2 answered {len(r.choices)} choices")
        return None, None
    if spec.kind == "cancel":
        stream = await http.chat.completions.create(stream=True, messages=_chat_messages(spec), **chat)
        ttft, chunks = None, 0
        async for _chunk in stream:
            ttft = ttft if ttft is not None else clock() - sent
            chunks += 1
            if chunks == 2:
                break
        await stream.close()
        return None, ttft
    raise ValueError(f"unknown kind {spec.kind!r}")


def status_of(exc: BaseException) -> str:
    """The status a client error names (see Outcome)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    if isinstance(exc, openai.APITimeoutError | TimeoutError):
        return "hung"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, openai.APIConnectionError):
        return "connect_error"
    if isinstance(exc, openai.APIError):
        return "stream_error"
    return type(exc).__name__


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


def wall_clock(t0: float) -> Callable[[], float]:
    """Seconds since t0 (time.monotonic())."""
    return lambda: time.monotonic() - t0


def outcome_json(o: Outcome) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in o.__dict__.items()}


def answers_json(reference: dict) -> dict:
    return {f"{k}#{p}": json.loads(json.dumps(a.__dict__)) for (k, p), a in reference.items()}
