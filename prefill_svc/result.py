"""What one prefill produces (`PrefillResult`), or `Cancelled` when it was stopped before its
compute started, and how a computed batch's requests get theirs (`resolve`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import TokenLogprobs


class Cancelled(Exception):
    """The request was cancelled before its compute started."""


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill produced; the caller must call release(block_ids, state_slot) after the push."""

    first_token: int
    block_ids: tuple[int, ...]
    state_slot: int | None
    """The request's state slot (models with state beyond pages, e.g. DeepSeek-V4), pushed after the pages."""
    num_cached_tokens: int
    num_computed_tokens: int
    queue_s: float
    compute_s: float
    first_logprobs: TokenLogprobs | None = None
    """The first token's logprobs, when the request's sampling asks for them."""
    choice_first_tokens: tuple[int, ...] = ()
    """n > 1: every choice's first token (first_token is choice 0's); () for one choice."""
    choice_first_logprobs: tuple[TokenLogprobs, ...] = ()
    """n > 1 with logprobs: every choice's first token's logprobs."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """With sampling.prompt_logprobs: each prompt token's (the first one's logprob NaN)."""
    num_tier_tokens: int = 0
    """Of num_cached_tokens, those loaded from the second tier."""


def resolve(
    ready: list[Request],
    first_tokens: list[list[int]],
    first_logprobs: list[list[TokenLogprobs] | None],
    started: float,
    done: float,
) -> None:
    """Finish each request of a computed batch: its first token (choice 0's) appended to its
    tokens, its future resolved to its PrefillResult (kvmesh.prefill_svc.chunked.prefill_batch gave
    each request's first tokens and logprobs). started, done: time.perf_counter() at the batch's
    compute start and end (seconds): its queue time runs from the request's arrival to `started`."""
    for r, choice_tokens, logprobs in zip(ready, first_tokens, first_logprobs):
        r.token_ids.append(choice_tokens[0])
        r.status = RequestStatus.FINISHED
        assert r.future is not None
        r.future.set_result(
            PrefillResult(
                choice_tokens[0],
                tuple(r.block_ids),
                r.state_slot,
                r.num_cached_tokens,
                r.num_prompt_tokens - r.num_cached_tokens,
                queue_s=started - r.arrival_time,
                compute_s=done - started,
                first_logprobs=logprobs[0] if logprobs else None,
                choice_first_tokens=tuple(choice_tokens) if len(choice_tokens) > 1 else (),
                choice_first_logprobs=tuple(logprobs) if logprobs and len(choice_tokens) > 1 else (),
                prompt_logprobs=tuple(r.prompt_logprobs or ()),
                num_tier_tokens=r.num_tier_tokens,
            )
        )
