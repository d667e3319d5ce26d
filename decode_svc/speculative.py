"""Draft tokens for speculative decoding on decode: n-gram prompt lookup.

Prompt lookup decoding (Saxena 2023; vLLM's `ngram` speculator, SGLang's lookahead): the last
n tokens of a sequence (n from `max_ngram` down to `min_ngram`) are looked up in its earlier
tokens, prompt included, and the k tokens that followed their latest earlier occurrence are the
drafts. Text that quotes its input (summaries, rewrites, code edits) repeats long runs, which
the target then accepts several at a time in one batched forward; other text mostly finds no
match (no drafts, no cost) or a wrong one, which `SpeculationGovernor` backs off from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPECULATIVE_METHODS = ("off", "ngram")
"""--speculative choices. MTP (DeepSeek-V4's own draft head) is not built yet."""


def propose_ngram(
    tokens: Sequence[int], k: int, min_ngram: int = 1, max_ngram: int = 4, window: int = 4096
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


@dataclass
class SpeculationGovernor:
    """Per-sequence back-off: after a step whose drafts were all rejected, draft again only
    after 1, 2, 4, ... up to `max_skip` steps; a step with any accepted draft resets it. Text
    that does not repeat itself thus pays for few wasted verification rows."""

    max_skip: int = 16
    skip: int = 0
    wait: int = 0

    def should_draft(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        if accepted:
            self.skip = 0
        else:
            self.skip = min(self.max_skip, max(1, 2 * self.skip))
            self.wait = self.skip


@dataclass
class DraftCounts:
    """One request's speculation so far: drafts proposed and drafts the target kept (each kept
    draft is a token that cost no step of its own). Updated by the engine thread between steps;
    read by whoever receives the request's last tokens."""

    drafted: int = 0
    accepted: int = 0
