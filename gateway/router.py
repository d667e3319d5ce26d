"""Choosing instances: prefill by cached prefix weighed against load, decode by least load.

The prefill policy follows SGLang's cache-aware router: a cached prefix counts only
when it covers at least `cache_threshold` of the prompt (so prompts that merely share a
system-prompt block do not all pile onto one instance); then each instance costs the
prefill tokens it would compute (prompt minus its cached prefix) plus the prefill
tokens already in flight on it, times `load_weight`. Ties go to the instance that has
been sent the fewest prefill tokens so far, so idle instances share the work.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class InstanceLoad:
    """What the gateway knows about one instance; counts are its own in-flight accounting
    plus what the instance last reported."""

    address: str
    instance_id: str = ""
    healthy: bool = True
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    reported_queued_tokens: int = 0
    reported_active_requests: int = 0
    total_routed_tokens: int = 0
    total_routed_requests: int = 0


@dataclass(frozen=True)
class RouteDecision:
    """The chosen prefill instance and how many prompt tokens it holds (as the index says)."""

    address: str
    cached_tokens: int
    cost_tokens: float


@dataclass
class PrefillRouter:
    """Prefix-aware prefill choice with a load guard (see the module docstring)."""

    instances: list[InstanceLoad]
    cache_threshold: float = 0.5
    load_weight: float = 1.0
    _rr: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")

    def choose(self, num_prompt_tokens: int, cached_blocks: Mapping[str, int], page_size: int) -> RouteDecision:
        """Pick a healthy prefill instance.

        cached_blocks maps instance_id -> leading prompt blocks it holds (from the index;
        empty when the index is down). Raises LookupError when no instance is healthy.
        """
        healthy = [i for i in self.instances if i.healthy]
        if not healthy:
            raise LookupError("no healthy prefill instance")
        best: tuple[float, int, int] | None = None
        choice: RouteDecision | None = None
        self._rr += 1
        for pos, inst in enumerate(healthy):
            cached = min(cached_blocks.get(inst.instance_id, 0) * page_size, num_prompt_tokens - 1)
            counted = cached if cached >= self.cache_threshold * num_prompt_tokens and cached > 0 else 0
            load = max(inst.in_flight_tokens, inst.reported_queued_tokens)
            cost = (num_prompt_tokens - counted) + self.load_weight * load
            key = (cost, inst.total_routed_tokens, (pos - self._rr) % len(healthy))
            if best is None or key < best:
                best, choice = key, RouteDecision(inst.address, cached, cost)
        assert choice is not None
        return choice


def pick_decode(instances: Sequence[InstanceLoad], rr: int) -> InstanceLoad:
    """Least active requests among healthy decode instances (ties rotate with rr).

    Decode step time barely depends on context length here, so request count is the load.
    Raises LookupError when none is healthy.
    """
    healthy = [i for i in instances if i.healthy]
    if not healthy:
        raise LookupError("no healthy decode instance")
    n = len(healthy)
    return min(enumerate(healthy),
               key=lambda p: (max(p[1].in_flight_requests, p[1].reported_active_requests), (p[0] - rr) % n))[1]
