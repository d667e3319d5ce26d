"""One request as both roles see it, torch-free so the gateway shares it.

For now it holds the one finish rule (EOS / stop ids / max_tokens) that the gateway's answer
stream and decode's step both apply.
"""

from __future__ import annotations

from collections.abc import Container

from engine.outcomes import FinishReason


def finish_reason(
    token: int, num_generated: int, max_tokens: int, stop_token_ids: Container[int]
) -> FinishReason | None:
    """Why an answer ends at `token`, or None while it goes on.

    num_generated: tokens generated so far, `token` included (the first token counts 1).
    stop_token_ids: the ids that end the answer (the model's EOS ids, none with ignore_eos).
    A stop id wins over the length: an answer whose last allowed token is EOS stopped.
    """
    if token in stop_token_ids:
        return FinishReason.STOP
    if num_generated >= max_tokens:
        return FinishReason.LENGTH
    return None
