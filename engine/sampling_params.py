"""How a request samples, as plain data: the gateway, the wire helpers and both engines share it
without loading torch (`kvmesh.engine.sampler` applies it to logits)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow
# fp32 to inf and the softmax to NaN.
MIN_TEMPERATURE = 1e-5

MAX_LOGPROBS = 20
"""Most top alternatives a token's logprobs may list (OpenAI's top_logprobs bound)."""

MAX_CHOICES = 128
"""Most choices (n) one request may ask for (OpenAI's bound)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens."""

    temperature: float = 0.0
    """Softmax temperature, >= 0; 0 (or anything below MIN_TEMPERATURE) means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps every token."""
    top_k: int = 0
    """Keep the k most likely tokens (and ties); 0 turns it off."""
    seed: int | None = None
    """Seed of the request's own generator (prefill draws the first token from seed, decode the
    rest from seed + 1); None uses torch's global RNG."""
    n: int = 1
    """Choices to generate from one prompt (1..MAX_CHOICES): prefill samples n first tokens from
    the prompt's last logits and decode continues n sequences sharing the prompt's pages;
    choice i samples as a request of its own seeded seed + i (`for_choice`)."""
    prompt_logprobs: int | None = None
    """Report each prompt token's logprob given the tokens before it, and this many top
    alternatives (0..MAX_LOGPROBS); prefill then computes the whole prompt (no prefix-cache
    hit: every position's logits are needed). None: none."""
    grammar: GrammarSpec | None = None
    """Structured output: the answer must follow this grammar (kvmesh.engine.grammar masks each
    sampled token); None: free text."""
    logprobs: int | None = None
    """Report each sampled token's logprob and this many top alternatives' (0..MAX_LOGPROBS),
    of the distribution it is drawn from (kvmesh.engine.sampler.token_logprobs); None: no logprobs."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def for_choice(self, index: int) -> SamplingParams:
        """How choice `index` of n samples: these settings, n = 1, seed + index (mod 2^63), so
        each choice is reproducible alone (vLLM's parallel sampling seeds its children so)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below MIN_TEMPERATURE, or top_k 1)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log probability (natural log, fp32) and the top tokens' at its
    position, most likely first; kvmesh.engine.sampler.token_logprobs computes them."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice")
"""json_object: any JSON object (OpenAI's response_format json_object); json_schema: a JSON
Schema (OpenAI's json_schema, strict); regex: a regular expression (vLLM's extension); choice:
one of a JSON list of strings (vLLM's extension)."""

MAX_GRAMMAR_CHARS = 64 * 1024
"""Longest grammar spec (characters) a request may send."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the answer must follow: `kind` (one of GRAMMAR_KINDS) and its `spec` text (the
    schema as JSON, the regex, the choices as a JSON list of strings; "" for json_object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {list(GRAMMAR_KINDS)}, got {self.kind[:32]!r}")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the grammar is {len(self.spec)} characters, more than {MAX_GRAMMAR_CHARS}")
        if self.kind == "json_object" and self.spec:
            raise ValueError("json_object takes no spec (send a json_schema to constrain the object)")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (ValueError, RecursionError):
                raise ValueError("the json_schema is not JSON") from None
            check_json_schema(schema)


JSON_SCHEMA_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "title", "description", "default", "examples",
        "$schema", "$id", "$comment",
    }
)  # fmt: skip
"""The JSON Schema keywords a json_schema may use: those the grammar enforces (xgrammar's, close
to OpenAI's strict structured outputs) and annotations. Any other keyword (`not`, `if`,
`contains`, `allOf`, `oneOf`, `dependentSchemas`, `uniqueItems`, ...) is refused rather than
silently not enforced."""

MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of schemas a json_schema may have."""


def check_json_schema(schema, depth: int = 0, where: str = "schema") -> None:
    """ValueError naming the first keyword outside JSON_SCHEMA_KEYWORDS (at any depth), a $ref
    that is not local ("#/..."), or nesting past MAX_SCHEMA_DEPTH. `schema`: parsed JSON."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the json_schema nests more than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema (an object or a boolean)")
    for key, value in schema.items():
        if key not in JSON_SCHEMA_KEYWORDS:
            raise ValueError(
                f"the json_schema keyword {key[:40]!r} at {where} is not supported (it would not be enforced)"
            )
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ValueError(f"{where}: only local $refs ('#/...') are supported")
        if key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise ValueError(f"{where}.{key} must be an object of schemas")
            for name, sub in value.items():
                check_json_schema(sub, depth + 1, f"{where}.{key}.{name}"[:200])
        elif key in ("items", "additionalProperties") and not isinstance(value, bool):
            check_json_schema(value, depth + 1, f"{where}.{key}"[:200])
        elif key in ("prefixItems", "anyOf"):
            if not isinstance(value, list):
                raise ValueError(f"{where}.{key} must be a list of schemas")
            for i, sub in enumerate(value):
                check_json_schema(sub, depth + 1, f"{where}.{key}[{i}]"[:200])
