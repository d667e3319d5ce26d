"""What a speculative drafter offers decode (`Drafter`); the registry is kvmesh.engine.speculative."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.request import Request


class Drafter(ABC):
    """Proposes draft tokens for decode's running requests; the target verifies them in one
    batched step (kvmesh.engine.speculative.verify.Speculator). Runs on the engine thread."""

    name: str = ""
    batched: bool = False
    """propose() runs once a step for every request that drafts (else once per request, in
    order, so each request's room for rows counts the drafts found before it)."""
    needs_hidden: bool = False
    """The drafter reads the target's hidden streams after each step (`after_step`)."""

    def start(self, request: Request) -> None:  # noqa: B027 (most drafters keep nothing)
        """A request joins decode (its prompt's KV landed): set up what the drafter keeps for it."""

    @abstractmethod
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[b] draft tokens continuing requests[b] (fewer, or [], when it has none)."""

    def after_step(self, request: Request, hidden: torch.Tensor) -> None:  # noqa: B027
        """After a step kept len(hidden) tokens of `request`: the target's streams at the
        positions it computed ([n, N, H]); only called when needs_hidden."""

    def pass_seconds(self) -> float:
        """Seconds one drafting pass takes on top of a step (measured at start; 0: free)."""
        return 0.0
