"""Draft tokens by n-gram prompt lookup (`--speculative ngram`).

Prompt lookup decoding (Saxena 2023; vLLM's `ngram` speculator, SGLang's lookahead): the last
n tokens of a sequence (n from `max_ngram` down to `min_ngram`) are looked up in its earlier
tokens, prompt included, and the k tokens that followed their latest earlier occurrence are the
drafts. Text that quotes its input (summaries, rewrites, code edits) repeats long runs, which
the target then accepts several at a time in one batched forward; other text mostly finds no
match (no drafts, no cost) or a wrong one, and `kvmesh.engine.speculative.governor.SpeculationGovernor`
turns drafting down where the acceptance does not pay for the extra rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.engine.request import Request
from kvmesh.engine.speculative.base import Drafter


def propose_ngram(
    tokens: Sequence[int], k: int, min_ngram: int = 2, max_ngram: int = 4, window: int = 4096
) -> list[int]:
    """Up to k draft tokens continuing `tokens` by prompt lookup ([] when no n-gram recurs).

    Looks back at most `window` tokens; the longest n in [min_ngram, max_ngram] whose last-n
    suffix occurred before wins, and of its occurrences the latest.
    """
    if k < 1 or len(tokens) < min_ngram + 1:
        return []
    t = np.asarray(tokens[-window:], dtype=np.int64)
    L = len(t)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = t[L - n :]
        # start positions i < L - n where t[i:i+n] == suffix, i.e. an earlier occurrence
        windows = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return t[start : start + k].tolist()
    return []


class NgramDrafter(Drafter):
    """Drafts by prompt lookup over each request's own tokens; any model."""

    name = "ngram"

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        # looked up as a module global on each call, so a test can stand an oracle in for it
        return [propose_ngram(r.token_ids, k) for r, k in zip(requests, ks)]
