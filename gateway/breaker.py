"""A circuit breaker per instance: repeated request failures take it out of rotation.

Closed: requests flow; `failure_threshold` failures in a row open it. Open: no request is
routed there for `cooldown_s` (doubling on each failed probe, up to `max_cooldown_s`).
Half-open: exactly one request goes through as a probe; its success closes the breaker,
its failure opens it again. (The pattern of Nygard, "Release It!", as Envoy's outlier
detection and SGLang's router use it.) Health polls say whether an instance answers at
all; the breaker says whether requests routed to it succeed (a decode whose KV listener
cannot be reached answers its polls and still fails every push).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Failure counting for one instance (event-loop thread only; times in seconds)."""

    failure_threshold: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    _opened_at: float = field(default=0.0, repr=False)
    _cooldown: float = field(default=0.0, repr=False)
    _probe_out: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError(
                f"need failure_threshold >= 1 and 0 < cooldown_s <= max_cooldown_s, got "
                f"{self.failure_threshold}, {self.cooldown_s}, {self.max_cooldown_s}"
            )
        self._cooldown = self.cooldown_s

    def allows(self) -> bool:
        """May a request be routed here now? (No side effect; call `on_routed` when one is.)"""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN:
            return self.clock() >= self._opened_at + self._cooldown
        return not self._probe_out

    def on_routed(self) -> None:
        """A request was routed here: past an open breaker's cool-down it is the half-open probe."""
        if self.state == BreakerState.OPEN and self.clock() >= self._opened_at + self._cooldown:
            self.state = BreakerState.HALF_OPEN
        if self.state == BreakerState.HALF_OPEN:
            self._probe_out = True

    def record_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._cooldown = self.cooldown_s
        self._probe_out = False

    def record_neutral(self) -> None:
        """A request routed here ended for a reason that says nothing about the instance
        (the client cancelled, bad input): a half-open probe may go out again."""
        self._probe_out = False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self.state == BreakerState.HALF_OPEN:
            self._cooldown = min(self._cooldown * 2, self.max_cooldown_s)
            self._open()
        elif self.state == BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = self.clock()
        self._probe_out = False
