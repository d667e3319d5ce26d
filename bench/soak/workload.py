"""The soak's requests: a mixed, seeded workload (sent through the real clients by
bench/soak/send.py: the openai client over the gateways' HTTP API, kvmesh's GatewayClient over
gRPC), and each greedy answer's check against the answer a quiet reference run gave to the same
request.

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

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    "responses": 2,
    "messages": 1,
}
CHECKED = {"chat", "chat_stream", "completion", "grpc", "long", "session", "json", "tools", "responses", "messages"}


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
    request_ids: list[str] = field(default_factory=list)
    """The ids the gateway answered under (each turn's; not compared): what finds a wrong answer
    in the services' logs."""

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


def token_logprobs(entries) -> tuple[list[float], list[str], list[dict[str, float]]]:
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


def wall_clock(t0: float) -> Callable[[], float]:
    """Seconds since t0 (time.monotonic())."""
    return lambda: time.monotonic() - t0


def outcome_json(o: Outcome) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in o.__dict__.items()}


def answers_json(reference: dict) -> dict:
    return {f"{k}#{p}": json.loads(json.dumps(a.__dict__)) for (k, p), a in reference.items()}
