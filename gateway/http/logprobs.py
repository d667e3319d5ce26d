"""OpenAI's `logprobs` objects, from the answer's TokenLogprobs messages (each token's logprob
where it was sampled: kvmesh.engine.sampler.token_logprobs) and the tokens' strings and bytes
(kvmesh.gateway.detokenizer.TokenText)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.protos.v1 import common_pb2

LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (a token a grammar's mask or top-k ruled out) reads as in JSON, which
has no infinity: OpenAI's and vLLM's value for it."""


def _finite(value: float) -> float | None:
    """A logprob as JSON can hold it: -inf as LOGPROB_FLOOR, NaN (nothing predicts the token) None."""
    if math.isnan(value):
        return None
    return max(value, LOGPROB_FLOOR)


class LogprobsShaper:
    """OpenAI's `logprobs` objects from the answer's TokenLogprobs messages, chunk by chunk.

    Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}], "refusal": null}. Completions: {"tokens", "token_logprobs", "top_logprobs"
    (a {token: logprob} map of the top alternatives and the sampled token, as the legacy API
    sends up to logprobs + 1), "text_offset" (each token's character offset in the choice's
    text, counted over the tokens' own texts)}; with echo, the prompt's tokens come first (the
    very first with null logprobs: nothing predicts it). token_text: id -> (text, bytes)
    (kvmesh.gateway.detokenizer.TokenText); offset: where the first token's text starts (the echoed
    prompt's length, when its tokens are not shaped too).
    """

    def __init__(self, ask: OpenAIRequest, token_text: Callable[[int], tuple[str, bytes]], offset: int = 0) -> None:
        self.chat = ask.chat
        self.wanted = ask.logprobs
        self.token_text = token_text
        self.offset = offset

    def shape(self, entries: Sequence[common_pb2.TokenLogprobs]) -> dict | None:
        """The logprobs object of these tokens (None when the request did not ask for them)."""
        if not self.wanted:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.token_text(e.token_id)[0]
            logprob = _finite(e.logprob)
            top: dict | None = None
            if logprob is not None:  # None: an echoed prompt's first token, which nothing predicts
                top = {self.token_text(t)[0]: _finite(lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                top.setdefault(text, logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _chat_entry(self, e: common_pb2.TokenLogprobs) -> dict:
        text, raw = self.token_text(e.token_id)
        return {
            "token": text,
            "logprob": _finite(e.logprob),
            "bytes": list(raw),
            "top_logprobs": [
                {"token": t_text, "logprob": _finite(lp), "bytes": list(t_raw)}
                for (t_text, t_raw), lp in ((self.token_text(t), lp) for t, lp in zip(e.top_token_ids, e.top_logprobs))
            ],
        }
