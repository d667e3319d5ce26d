# N=new tokens of one sequence
"""The acceptance rule for a reduced precision (docs/precision.md): vLLM's `check_logprobs_close`
(tests/models/utils.py in vLLM), which judges a bf16 or 8-bit run against a reference.

Greedy tokens are compared position by position; at the first position where they differ,
each side's token must be among the other side's top-k logprobs (k = 5 in vLLM's tests and
ours), and the rest of that sequence is not compared: once the texts differ they condition
different continuations. A sequence equal throughout passes trivially.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    """Where two greedy sequences first differ, and whether the rule lets it pass."""

    position: int
    """Index into the new tokens of the first difference; -1 when there is none."""
    ok: bool
    """True when equal throughout, or each side's token is in the other's top-k there."""
    detail: str
    """'' when equal; else both tokens and whether each is in the other's top k."""


def top_logprobs(logits: torch.Tensor, k: int = 5) -> list[dict[int, float]]:
    """logits [N, V] (any float dtype) -> for each row, its k most likely token ids -> fp32
    log-softmax values, as a server reports top logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = lp.topk(k, dim=-1)
    return [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)]


def compare_greedy(
    tokens_a: list[int], top_a: list[dict[int, float]], tokens_b: list[int], top_b: list[dict[int, float]]
) -> Divergence:
    """vLLM's rule on one pair of greedy sequences with their top-k logprobs at each position
    (`top_logprobs`). Raises ValueError when a side has fewer top-k rows than tokens."""
    if len(top_a) < len(tokens_a) or len(top_b) < len(tokens_b):
        raise ValueError("each token needs its row of top logprobs")
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=False)):
        if a == b:
            continue
        a_in_b, b_in_a = a in top_b[i], b in top_a[i]
        return Divergence(
            i, a_in_b and b_in_a, f"at {i}: {a} (in other's top: {a_in_b}) vs {b} (in other's top: {b_in_a})"
        )
    return Divergence(-1, True, "")
