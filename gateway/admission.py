"""The gateway's admission queue: a burst beyond the decode pools waits its turn.

Requests are admitted in arrival order while the routable decode instances have free
slots (each reports how many requests it takes at once); the rest wait here, bounded
by count, by prompt tokens and by time, as SGLang's and vLLM's schedulers queue a
burst instead of refusing it. Only a request past a bound is refused (OverloadedError,
which the servicer maps to RESOURCE_EXHAUSTED with a retry hint).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class OverloadedError(Exception):
    """The queue is full, or the request waited longer than the queue allows."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Waiter:
    num_tokens: int
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    """FIFO admission against a capacity the pool computes (event-loop thread only).

    Args:
        capacity: requests the mesh can take now (free decode slots of routable instances
            plus those this queue already admitted); read on every grant.
        max_queued_requests: requests that may wait at once; more are refused at once.
        max_queued_tokens: prompt tokens that may wait at once; more are refused at once.
        max_queue_time_s: seconds a request may wait before it is refused.
    """

    def __init__(
        self, capacity: Callable[[], int], max_queued_requests: int, max_queued_tokens: int, max_queue_time_s: float
    ) -> None:
        if max_queued_requests < 0 or max_queued_tokens < 0 or not max_queue_time_s >= 0:
            raise ValueError(
                "admission queue bounds must be >= 0, got "
                f"{max_queued_requests} requests, {max_queued_tokens} tokens, {max_queue_time_s} s"
            )
        self._capacity = capacity
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.max_queue_time_s = max_queue_time_s
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self.num_admitted = 0
        """Requests admitted and not yet done (they hold a decode slot or are about to)."""
        self.queued_tokens = 0

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    async def admit(self, num_tokens: int) -> float:
        """Wait for a turn; return the seconds waited. The caller must call `done()` once after.

        Raises OverloadedError when the queue is full or the wait passes max_queue_time_s.
        """
        if not self._waiters and self.num_admitted < self._capacity():
            self.num_admitted += 1
            return 0.0
        if len(self._waiters) >= self.max_queued_requests:
            raise OverloadedError(
                f"the gateway's admission queue is full ({self.max_queued_requests} requests waiting); retry later",
                self._retry_hint(),
            )
        if self.queued_tokens + num_tokens > self.max_queued_tokens:
            raise OverloadedError(
                f"the gateway's admission queue holds {self.queued_tokens} prompt tokens; "
                f"{num_tokens} more would pass its bound of {self.max_queued_tokens}; retry later",
                self._retry_hint(),
            )
        waiter = _Waiter(num_tokens)
        self._waiters.append(waiter)
        self.queued_tokens += num_tokens
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.max_queue_time_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.done()  # granted in the same moment: hand the slot on
            else:
                waiter.granted.cancel()
                self._remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise OverloadedError(
                f"waited {self.max_queue_time_s:.0f} s in the gateway's admission queue for a decode slot; retry later",
                self._retry_hint(),
            ) from None
        return loop.time() - started

    def done(self) -> None:
        """An admitted request left the mesh: its slot goes to the next in line."""
        self.num_admitted -= 1
        assert self.num_admitted >= 0, self.num_admitted
        self.pump()

    def pump(self) -> None:
        """Grant waiting requests, in order, while there is capacity (also call it when
        capacity grows: an instance appeared or reported more room)."""
        while self._waiters and self.num_admitted < self._capacity():
            waiter = self._waiters.popleft()
            self.queued_tokens -= waiter.num_tokens
            if waiter.granted.done():  # gave up in the meantime
                continue
            self.num_admitted += 1
            waiter.granted.set_result(None)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
            self.queued_tokens -= waiter.num_tokens
        except ValueError:
            pass  # already popped by pump()

    def _retry_hint(self) -> float:
        """Seconds after which a retry may find room: grows with the queue, 1 s at least."""
        return max(1.0, min(30.0, len(self._waiters) / max(1, self._capacity())))
