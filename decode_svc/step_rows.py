"""What a decode step does with its logits' rows besides sampling them: structured output's
grammar masks before, the kept tokens' logprobs after.

A step's forward gives one row of logits a request, or k + 1 rows for a request with k
speculative drafts (kvmesh.engine.speculative: `starts[i]` is request i's first row, `drafts[i]`
its drafts); V is the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.grammar import fill_draft_masks
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import token_logprobs
from kvmesh.engine.sampling_params import SamplingParams, TokenLogprobs


def mask_grammars(
    batch: Sequence[Request], starts: Sequence[int], drafts: Sequence[list[int]], logits: torch.Tensor
) -> None:
    """Structured output: the rows of each request with a grammar keep only the tokens its
    grammar allows there, in place (logits [rows, V]); a verification row's mask assumes the
    drafts before it kept (kvmesh.engine.grammar.fill_draft_masks), so drafts are checked against it."""
    masked = [i for i, r in enumerate(batch) if r.grammar is not None]
    if not masked:
        return
    grammars = batch[masked[0]].grammar.grammars
    rows: list[int] = []
    for i in masked:
        rows += range(starts[i], starts[i] + len(drafts[i]) + 1)
    bitmask = grammars.new_bitmask(len(rows))
    at = 0
    for i in masked:
        fill_draft_masks(batch[i].grammar.matcher, drafts[i], bitmask, at)
        at += len(drafts[i]) + 1
    grammars.apply(logits, bitmask, rows)


def kept_logprobs(
    batch: Sequence[Request], starts: Sequence[int], logits: torch.Tensor, kept: Sequence[list[int]]
) -> list[list[TokenLogprobs] | None]:
    """The logprobs of each request's kept tokens, for those whose sampling asks for them (None
    for the others): kept token j of request i was drawn from logits row starts[i] + j (its own
    row without drafts, the verification row after draft j - 1 with them), so a token accepted
    from a draft gets the target's logprob at its position. logits [rows, V]."""
    out: list[list[TokenLogprobs] | None] = [None] * len(batch)
    rows: list[int] = []
    tokens: list[int] = []
    params: list[SamplingParams] = []
    for i, r in enumerate(batch):
        if r.sampling.logprobs is None:
            continue
        rows += range(starts[i], starts[i] + len(kept[i]))
        tokens += kept[i]
        params += [r.sampling] * len(kept[i])
    if not rows:
        return out
    found = iter(token_logprobs(logits[rows], tokens, params))
    for i, r in enumerate(batch):
        if r.sampling.logprobs is not None:
            out[i] = [next(found) for _ in kept[i]]
    return out
