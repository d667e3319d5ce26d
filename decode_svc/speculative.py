"""Draft tokens for speculative decoding on decode: n-gram prompt lookup.

Prompt lookup decoding (Saxena 2023; vLLM's `ngram` speculator, SGLang's lookahead): the last
n tokens of a sequence (n from `max_ngram` down to `min_ngram`) are looked up in its earlier
tokens, prompt included, and the k tokens that followed their latest earlier occurrence are the
drafts. Text that quotes its input (summaries, rewrites, code edits) repeats long runs, which
the target then accepts several at a time in one batched forward; other text mostly finds no
match (no drafts, no cost) or a wrong one, and `SpeculationGovernor` turns drafting down
where the acceptance does not pay for the extra rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPECULATIVE_METHODS = ("off", "ngram", "mtp")
"""--speculative choices: n-gram prompt lookup (any model) or DeepSeek-V4's multi-token-prediction
module (`engine.models.deepseek_v4_mtp`, checkpoints with mtp.* tensors)."""


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


@dataclass
class SpeculationGovernor:
    """How many drafts one sequence carries into a step: the count that maximizes the expected
    tokens per step over the step's cost, from the acceptance its drafts have had so far.

    With per-draft acceptance a (the chance a draft is kept when the ones before it were), k
    drafts yield 1 + a + a^2 + ... + a^k tokens a step; the step costs 1 + row_cost * k plain
    steps (each verification row adds the work of one row of every matmul: on a CPU that is far
    from free, `DecodeEngine.calibrate` measures it). When no k beats plain decoding the sequence
    drafts nothing, except one draft every `probe_every` steps to learn whether the text has
    started to repeat. a is estimated from decayed counts of kept and rejected drafts (a Beta
    prior of 4 kept, 1 rejected), so it follows the text as it changes.
    """

    row_cost: float = 0.35
    probe_every: int = 8
    decay: float = 0.9
    kept: float = 4.0
    rejected: float = 1.0
    idle: int = 0

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def num_drafts(self, most: int) -> int:
        """Drafts for this step, in [0, most]."""
        a, best_k, best, tokens, term = self.acceptance, 0, 1.0, 1.0, 1.0
        for k in range(1, most + 1):
            term *= a
            tokens += term
            if tokens / (1 + self.row_cost * k) > best:
                best_k, best = k, tokens / (1 + self.row_cost * k)
        if best_k == 0 and most > 0:
            self.idle += 1
            if self.idle >= self.probe_every:
                self.idle = 0
                return 1
        return best_k

    def record(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and kept the first `accepted` of them."""
        if not drafted:
            return
        self.kept = self.decay * self.kept + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)


@dataclass
class DraftCounts:
    """One request's speculation so far: drafts proposed and drafts the target kept (each kept
    draft is a token that cost no step of its own). Updated by the engine thread between steps;
    read by whoever receives the request's last tokens."""

    drafted: int = 0
    accepted: int = 0
