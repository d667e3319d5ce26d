"""OpenAI's request bodies -> the gateway's GenerateRequest: the fields Chat Completions
(POST /v1/chat/completions, https://platform.openai.com/docs/api-reference/chat) and Completions
(POST /v1/completions, .../api-reference/completions) share, and the translated request both
give (`OpenAIRequest`). Each endpoint's own fields are its module's (chat_completions.py,
completions.py), structured output grammar.py's.

Pure translation, no I/O. Only the shapes are checked here (a wrong type is a BadField, HTTP 400,
naming the field); every limit and range (max_tokens, temperature, top_p, the context) is the
request path's own check (kvmesh.gateway.requests.PromptBuilder), so HTTP and gRPC refuse the
same requests with the same words. OpenAI's own fields that kvmesh does not implement yet
(UNSUPPORTED) are refused with HTTP 400 naming the field, unless they hold the value that turns
them off, so a client never gets something other than what it asked for; other unknown fields
(another vendor's extensions) are ignored, as OpenAI does. vLLM's extensions `top_k` and
`ignore_eos` are honoured.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.sampling_params import MAX_CHOICES
from kvmesh.gateway.http.fields import BadField, get_field, off, refuse_unsupported
from kvmesh.gateway.tools import ToolRequest
from kvmesh.protos.v1 import gateway_pb2

UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "audio": off(),
    "modalities": off(["text"]),
    "prediction": off(),
    "web_search_options": off(),
    "frequency_penalty": off(0, 0.0),
    "presence_penalty": off(0, 0.0),
    "logit_bias": off({}),
    "functions": off([]),
    "function_call": off("none"),
    "reasoning_effort": off(),
    "verbosity": off(),
    "store": off(False),
    "service_tier": off("auto", "default"),
    "suffix": off(""),
    # vLLM's extensions of the same kinds: refused too, never silently dropped
    "guided_grammar": off(),
    "prompt_logprobs": off(),
    "min_tokens": off(0),
    "repetition_penalty": off(1, 1.0),
    "min_p": off(0, 0.0),
}
"""OpenAI's request fields (and vLLM's extensions of them) that kvmesh does not implement yet,
each with the test for the value that turns it off: any other value is a 400 naming the field.
Accepted with no effect: `user`, `metadata`, `safety_identifier`, `prompt_cache_key`.
`tools`, `tool_choice` and `parallel_tool_calls` are gateway/tools.py's (chat only)."""


@dataclass(frozen=True)
class OpenAIRequest:
    """One OpenAI request, translated."""

    request: gateway_pb2.GenerateRequest
    chat: bool
    """/v1/chat/completions (else /v1/completions)."""
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk carries `usage`."""
    echo: bool = False
    """Completions' `echo`: the answer's text starts with the prompt's."""
    grammar_field: str = ""
    """The field that asked for structured output (grammar.GRAMMAR_FIELDS, or "tools"; "" for
    free text): the `param` of an error about the grammar."""
    tools: ToolRequest | None = None
    """The request's tools (chat), whose calls are parsed from the answer."""
    best_of: int = 0
    """Completions' best_of (> n; 0: none): that many choices are generated and the n whose
    tokens have the highest summed logprob are returned (openai_answer.best_choices)."""
    n: int = 1
    """Choices the client gets."""
    logprobs: bool = False
    """The client asked for logprobs (best_of asks for them itself, to score the choices)."""

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request.request_id


@dataclass(frozen=True)
class SharedFields:
    """The fields both endpoints read, their types checked (None: absent or null)."""

    model: str
    n: int | None
    max_tokens: int | None
    """max_completion_tokens when given (the newer name wins, as OpenAI documents), else max_tokens."""
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | list[str] | None
    stream: bool
    include_usage: bool
    ignore_eos: bool


def read_shared(body: Any) -> SharedFields:
    """The fields both endpoints share, in the order they are checked. Raises BadField for a
    body that is not an object, an UNSUPPORTED field that is not off, a mistyped field, n
    outside [1, MAX_CHOICES] or a seed outside [0, 2**64)."""
    if not isinstance(body, dict):
        raise BadField("the body must be a JSON object", None)
    refuse_unsupported(body, UNSUPPORTED)
    model = get_field(body, "model", (str,), "a string") or ""
    n = get_field(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise BadField(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    max_tokens = get_field(body, "max_tokens", (int,), "an integer")
    max_completion_tokens = get_field(body, "max_completion_tokens", (int,), "an integer")
    temperature = get_field(body, "temperature", (int, float), "a number")
    top_p = get_field(body, "top_p", (int, float), "a number")
    top_k = get_field(body, "top_k", (int,), "an integer")
    seed = get_field(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise BadField(f"seed must be in [0, 2**64), got {seed}", "seed")
    stop = get_field(body, "stop", (str, list), "a string or a list of strings")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise BadField("stop must be a string or a list of strings", "stop")
    stream = get_field(body, "stream", (bool,), "a boolean") or False
    options = get_field(body, "stream_options", (dict,), "an object") or {}
    include_usage = get_field(options, "include_usage", (bool,), "a boolean") or False
    ignore_eos = get_field(body, "ignore_eos", (bool,), "a boolean") or False
    get_field(body, "user", (str,), "a string")  # accepted and unused, as OpenAI's abuse-tracking field
    return SharedFields(
        model=model,
        n=n,
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
    )


def generate_options(
    shared: SharedFields, logprobs: int | None, echo: bool = False, best_of: int | None = None
) -> gateway_pb2.GenerateOptions:
    """The GenerateOptions of the shared fields and the endpoint's logprobs (top alternatives
    per token; None: none), echo (the prompt's tokens get logprobs too) and best_of (choices
    generated, each scored by its tokens' logprobs; None: n). Raises BadField for a max_tokens
    that is no 32-bit integer."""
    sampling = gateway_pb2.GenerateOptions(
        temperature=float(shared.temperature) if shared.temperature is not None else 1.0,  # OpenAI's default
        top_k=shared.top_k or 0,
        stop=[shared.stop] if isinstance(shared.stop, str) else (shared.stop or []),
        ignore_eos=shared.ignore_eos,
    )
    if shared.top_p is not None:
        sampling.top_p = float(shared.top_p)
    if shared.max_tokens is not None:
        if not -(2**31) <= shared.max_tokens < 2**31:
            raise BadField(f"max_tokens must be a 32-bit integer, got {shared.max_tokens}", "max_tokens")
        sampling.max_tokens = shared.max_tokens
    if shared.seed is not None:
        sampling.seed = shared.seed
    if logprobs is not None:
        sampling.logprobs = logprobs
        if echo:  # the echoed prompt's tokens get their logprobs too
            sampling.prompt_logprobs = logprobs
    if best_of is not None:
        # best_of choices, each scored by its tokens' logprobs (asked for if the client did not)
        sampling.n = best_of
        if logprobs is None:
            sampling.logprobs = 0
    elif shared.n is not None and shared.n > 1:
        sampling.n = shared.n
    return sampling


def new_request(
    request_id: str, model: str, sampling: gateway_pb2.GenerateOptions, grammar: tuple[str, str] | None
) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest with no prompt yet, named `request_id` (empty: a new uuid); grammar:
    the (kind, spec) the answer must follow (None: free text)."""
    if grammar is not None:
        sampling.grammar.kind, sampling.grammar.spec = grammar
    return gateway_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex, model=model, sampling=sampling, chat=False
    )
