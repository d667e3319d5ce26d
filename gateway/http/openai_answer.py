"""The gateway's answer -> OpenAI's objects: a whole chat.completion or text_completion, the
chunks of a stream (chat.completion.chunk or text_completion), the tool calls found in a chat
answer (kvmesh.gateway.tools.tool_calls), usage and finish reasons. Pure translation, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.tools import tool_calls
from kvmesh.protos.v1 import common_pb2, gateway_pb2
from kvmesh.runtime.wire import FINISH_FROM_PB


def usage(final: gateway_pb2.Final) -> dict:
    """OpenAI's `usage` object (tokens) from the gateway's Final message."""
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.generated_tokens,
        "total_tokens": final.prompt_tokens + final.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def finish_reasons(final: gateway_pb2.Final) -> list[str]:
    """Each choice's finish reason ("stop" or "length"), in choice order."""
    if not final.choice_finish:
        return [final.finish_reason]
    return [FINISH_FROM_PB[f].value for f in final.choice_finish]


def best_choices(ask: OpenAIRequest, logprobs: Sequence[Sequence[common_pb2.TokenLogprobs]]) -> list[int]:
    """The choices the client gets, in order: all of them, or with best_of the n whose tokens'
    logprobs sum highest (ties: the lower index), best first (OpenAI's best_of; vLLM ranked
    by the same cumulative logprob)."""
    if not ask.best_of:
        return list(range(len(logprobs)))
    scores = [sum(lp.logprob for lp in entries) for entries in logprobs]
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: ask.n]


def _envelope(ask: OpenAIRequest, model: str, created: int, stream: bool) -> dict[str, Any]:
    """The fields every answer object opens with: id, object, created, model."""
    if ask.chat:
        kind = "chat.completion.chunk" if stream else "chat.completion"
    else:
        kind = "text_completion"
    return {"id": ask.response_id, "object": kind, "created": created, "model": model}


def response(
    ask: OpenAIRequest,
    model: str,
    created: int,
    texts: Sequence[str],
    final: gateway_pb2.Final,
    logprobs: Sequence[dict | None] = (),
    order: Sequence[int] | None = None,
) -> dict:
    """The whole (non-streaming) answer: a chat.completion or a text_completion object with a
    choice per text (choice i's text, and LogprobsShaper's object of its tokens when asked for);
    order: which choices, in what order (best_choices; None: all). usage counts every choice's
    tokens, the ones not returned too (OpenAI bills best_of so)."""
    finishes = finish_reasons(final)
    choices = []
    for i, k in enumerate(range(len(texts)) if order is None else order):
        lp = logprobs[k] if k < len(logprobs) else None
        choices.append(_choice(ask, i, texts[k], finishes[k], lp))
    return {**_envelope(ask, model, created, stream=False), "choices": choices, "usage": usage(final)}


def _choice(ask: OpenAIRequest, index: int, text: str, finish: str, lp: dict | None) -> dict:
    """One choice of a whole answer: chat's message (with the tool calls found in it, finish
    reason "tool_calls") or completions' text."""
    if not ask.chat:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    message: dict = {"role": "assistant", "content": text}
    if ask.tools is not None:
        content, calls = tool_calls(ask.tools, text)
        if calls:
            message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}


def chunk(
    ask: OpenAIRequest,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """One streamed chunk (chat.completion.chunk or text_completion) of choice `index`: `text`
    (None: no text, as in the chunk that carries the finish reason); a choice's first chat
    chunk names the role; logprobs: LogprobsShaper's object of the chunk's tokens."""
    if ask.chat:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    out = {**_envelope(ask, model, created, stream=True), "choices": [choice]}
    if ask.include_usage:
        out["usage"] = None  # every chunk but the last, as OpenAI sends them
    return out


def tool_chunks(ask: OpenAIRequest, model: str, created: int, index: int, text: str, finish: str) -> list[dict]:
    """The end of a streamed chat choice whose text was held back for tool calls: its calls as
    one tool_calls delta each (id, name and whole arguments: deltas the openai client
    assembles) or its text, then the finish reason ("tool_calls" when there are calls)."""
    assert ask.tools is not None
    content, calls = tool_calls(ask.tools, text)
    out = []
    if calls:
        for k, call in enumerate(calls):
            part = chunk(ask, model, created, None, index=index)
            part["choices"][0]["delta"]["tool_calls"] = [{"index": k, **call}]
            out.append(part)
        finish = "tool_calls"
    if content:
        out.append(chunk(ask, model, created, content, index=index))
    out.append(chunk(ask, model, created, None, finish, index=index))
    return out


def usage_chunk(ask: OpenAIRequest, model: str, created: int, final: gateway_pb2.Final) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    return {**_envelope(ask, model, created, stream=True), "choices": [], "usage": usage(final)}
