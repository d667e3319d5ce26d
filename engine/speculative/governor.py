"""How many drafts one sequence carries into a speculative step (`SpeculationGovernor`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationGovernor:
    """How many drafts one sequence carries into a step: the count that maximizes the expected
    tokens per step over the step's cost, from the acceptance its drafts have had so far.

    With per-draft acceptance a (the chance a draft is kept when the ones before it were), k
    drafts yield 1 + a + a^2 + ... + a^k tokens a step; the step costs 1 + row_cost * k plain
    steps (each verification row adds the work of one row of every matmul: on a CPU that is far
    from free, `Speculator.calibrate` measures it). When no k beats plain decoding the sequence
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
