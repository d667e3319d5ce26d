"""OpenAI Completions (POST /v1/completions, https://platform.openai.com/docs/api-reference/completions):
the body's own fields (the prompt, echo, best_of, completions' logprobs) and its translation,
`parse_completion`. The prompt is sent as it is, text or token ids (no chat template)."""

from __future__ import annotations

from typing import Any

from kvmesh.engine.sampling_params import MAX_CHOICES
from kvmesh.gateway.http.fields import BadField, get_field, refuses_out_of_range
from kvmesh.gateway.http.grammar import read_grammar
from kvmesh.gateway.http.openai_request import OpenAIRequest, generate_options, new_request, read_shared

MAX_COMPLETION_LOGPROBS = 5
"""Most top alternatives /v1/completions' `logprobs` may ask for (OpenAI's bound)."""


@refuses_out_of_range
def parse_completion(body: Any, request_id: str = "") -> OpenAIRequest:
    """Translate the JSON body of /v1/completions: the prompt as it is, text or token ids.

    `request_id` (from an X-Request-Id header) names the request; empty: a new uuid.
    Raises BadField for a body that is not an object, a missing or mistyped field, n outside
    [1, 128], best_of outside [n, 128] (or streamed), a batch of prompts, a field of
    /v1/chat/completions, or an UNSUPPORTED field that is not off.
    """
    shared = read_shared(body)
    logprobs = read_logprobs(body)
    if body.get("tool_choice") not in (None, "none"):
        raise BadField("tool_choice is for /v1/chat/completions", "tool_choice")
    echo = get_field(body, "echo", (bool,), "a boolean") or False
    best_of = read_best_of(body, shared.n or 1, shared.stream)
    sampling = generate_options(shared, logprobs, echo, best_of)
    grammar_field, grammar = read_grammar(body)
    if body.get("tools"):
        raise BadField("tools are for /v1/chat/completions", "tools")
    request = new_request(request_id, shared.model, sampling, grammar)
    text, ids = read_prompt(body)
    if ids:
        request.prompt_token_ids.extend(ids)
    else:
        request.prompt = text.encode("utf-8", "surrogatepass")
    return OpenAIRequest(
        request=request,
        chat=False,
        stream=shared.stream,
        include_usage=shared.include_usage,
        echo=echo,
        grammar_field=grammar_field,
        best_of=best_of or 0,
        n=shared.n or 1,
        logprobs=logprobs is not None,
    )


def read_logprobs(body: dict) -> int | None:
    """How many top alternatives each token's logprobs list: `logprobs` (0..5; None: no logprobs)."""
    wanted = get_field(body, "logprobs", (int,), "an integer")
    if wanted is not None and not 0 <= wanted <= MAX_COMPLETION_LOGPROBS:
        raise BadField(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {wanted}", "logprobs")
    return wanted


def read_best_of(body: dict, n: int, stream: bool) -> int | None:
    """best_of: choices generated, of which the n best are returned (None: none, or n itself,
    which leaves nothing to pick from). Raises BadField outside [n, MAX_CHOICES], or above n
    when streamed (the best choices are known only at the end)."""
    best_of = get_field(body, "best_of", (int,), "an integer")
    if best_of is None:
        return None
    if not n <= best_of <= MAX_CHOICES:
        raise BadField(f"best_of must be in [n, {MAX_CHOICES}] (n = {n}), got {best_of}", "best_of")
    if stream and best_of > n:
        raise BadField("best_of cannot be streamed (the best choices are known only at the end)", "best_of")
    return None if best_of == n else best_of


def read_prompt(body: dict) -> tuple[str, list[int]]:
    """The completion prompt, (text, []) or ("", token ids): a string or token ids, alone or as a
    batch of one. Raises BadField for anything else, a batch of more, or ids beyond 32 bits."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(-(2**31) <= t < 2**31 for t in prompt):
            raise BadField("prompt token ids must be 32-bit integers", "prompt")
        return "", prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise BadField("send one prompt per request (this gateway answers no batch of prompts)", "prompt")
    raise BadField("prompt must be a string or a non-empty list of token ids", "prompt")
