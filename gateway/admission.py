"""The gateway's admission queue: a burst beyond the decode pools waits its turn.

Requests are admitted in arrival order while the routable decode instances have free
slots (each reports how many requests it takes at once); the rest wait here, bounded
by count, by prompt tokens and by time, as SGLang's and vLLM's schedulers queue a
burst instead of refusing it. Only a request past a bound is refused (OverloadedError,
which the request path maps to RESOURCE_EXHAUSTED, HTTP 429, with a retry hint).

Each API key has its own bounds as well: the requests it has in flight (waiting here or
running) and its prompt tokens not yet prefilled (waiting here or computing on a prefill
instance). A key past either is refused at once, before it queues: one client's burst
waits on the client, never on prefill, and never ahead of the other keys' requests.
In total, the mesh holds at most its decode slots plus max_queued_requests requests, and
max_queued_tokens prompt tokens wait here.

Keys have a class from the operator's key file (kvmesh.gateway.auth): a priority and a weight. Waiting
requests are granted by strict priority bands (the highest band with a waiter first) and, within
a band, by weighted fair queueing between its keys (each waiter's virtual finish tag is
max(the band's virtual time, its key's last tag) + 1 / weight, the smallest tag goes first, as
in start-time fair queueing, Goyal et al. 1996): two busy keys of one band share it in the ratio
of their weights, and a key that was idle gets no stored-up credit. When the queue is full, a
request of a higher band takes the place of the newest waiter of the lowest band below it (that
one is shed: 429 with a retry hint); a request no waiter ranks below is refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class OverloadedError(Exception):
    """The queue is full, or the request waited longer than the queue allows."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class KeyLoad:
    """What one API key holds in the mesh now."""

    requests: int = 0
    """Requests in flight: waiting for admission or running."""
    queued_tokens: int = 0
    """Prompt tokens of those requests not yet prefilled."""


@dataclass(eq=False)
class _Waiter:
    num_tokens: int
    key: str = ""
    priority: int = 0
    tag: float = 0.0
    """Virtual finish tag within its band: the smallest is granted first."""
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    """FIFO admission against a capacity the pool computes (event-loop thread only).

    Args:
        capacity: requests the mesh can take now (free decode slots of routable instances
            plus those this queue already admitted); read on every grant.
        max_queued_requests: requests that may wait at once; more are refused at once.
        max_queued_tokens: prompt tokens that may wait at once; more are refused at once.
        max_queue_time_s: seconds a request may wait before it is refused.
        max_requests_per_key: requests one key may have in flight (0: no bound).
        max_queued_tokens_per_key: prompt tokens one key may have waiting for prefill, here
            or on a prefill instance (0: no bound).
    """

    def __init__(
        self,
        capacity: Callable[[], int],
        max_queued_requests: int,
        max_queued_tokens: int,
        max_queue_time_s: float,
        max_requests_per_key: int = 0,
        max_queued_tokens_per_key: int = 0,
    ) -> None:
        if (
            min(max_queued_requests, max_queued_tokens, max_requests_per_key, max_queued_tokens_per_key) < 0
            or not max_queue_time_s >= 0
        ):
            raise ValueError(
                "admission queue bounds must be >= 0, got "
                f"{max_queued_requests} requests, {max_queued_tokens} tokens, {max_queue_time_s} s, "
                f"{max_requests_per_key} requests and {max_queued_tokens_per_key} tokens per key"
            )
        self.max_requests_per_key = max_requests_per_key
        self.max_queued_tokens_per_key = max_queued_tokens_per_key
        self.keys: dict[str, KeyLoad] = {}
        """Load of each key with requests in flight (a key leaves when its last one ends)."""
        self._capacity = capacity
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.max_queue_time_s = max_queue_time_s
        self._waiters: list[_Waiter] = []
        """In arrival order."""
        self._band_time: dict[int, float] = {}
        """Each band's virtual time: the tag of its last granted waiter."""
        self._key_tag: dict[tuple[int, str], float] = {}
        """(band, key) -> the tag of the key's newest waiter in the band, while it has one."""
        self.num_admitted = 0
        """Requests admitted and not yet done (they hold a decode slot or are about to)."""
        self.queued_tokens = 0

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    async def admit(self, num_tokens: int, key: str = "", priority: int = 0, weight: float = 1.0) -> float:
        """Wait for a turn; return the seconds waited. The caller must call `done(key, ...)`
        once after (and `prefilled(key, num_tokens)` once the prompt is computed). priority,
        weight: the key's class (higher priority first; a band shared by weight).

        Raises OverloadedError when `key` is past its own bounds, the queue is full (of
        requests of this priority or higher), the request is shed for a higher one, or the
        wait passes max_queue_time_s.
        """
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        self._charge(key, num_tokens)
        try:
            return await self._admit(num_tokens, key, priority, weight)
        except BaseException:
            self._discharge(key, 1, num_tokens)
            raise

    def _charge(self, key: str, num_tokens: int) -> None:
        """Count a new request on `key`, or raise OverloadedError past the key's bounds."""
        load = self.keys.get(key) or KeyLoad()
        who = f"API key {key}" if key else "this client"
        if self.max_requests_per_key and load.requests >= self.max_requests_per_key:
            raise OverloadedError(f"{who} has {load.requests} requests in flight, its limit; retry when one ends", 1.0)
        if self.max_queued_tokens_per_key and load.queued_tokens + num_tokens > self.max_queued_tokens_per_key:
            raise OverloadedError(
                f"{who} has {load.queued_tokens} prompt tokens waiting for prefill; {num_tokens} more would pass "
                f"its limit of {self.max_queued_tokens_per_key}; retry later",
                1.0,
            )
        load.requests += 1
        load.queued_tokens += num_tokens
        self.keys[key] = load

    def _discharge(self, key: str, requests: int, num_tokens: int) -> None:
        load = self.keys[key]
        load.requests -= requests
        load.queued_tokens -= num_tokens
        assert load.requests >= 0 and load.queued_tokens >= 0, (load, requests, num_tokens)
        if load.requests == 0:
            del self.keys[key]

    def prefilled(self, key: str, num_tokens: int) -> None:
        """`num_tokens` prompt tokens of an admitted request of `key` are computed: they no
        longer count against the key's queued-token bound."""
        self._discharge(key, 0, num_tokens)

    async def _admit(self, num_tokens: int, key: str, priority: int, weight: float) -> float:
        if not self._waiters and self.num_admitted < self._capacity():
            self.num_admitted += 1
            return 0.0
        while len(self._waiters) >= self.max_queued_requests or (
            self.queued_tokens + num_tokens > self.max_queued_tokens
        ):
            if not self._shed_below(priority):
                break
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
        band = (priority, key)
        tag = max(self._band_time.get(priority, 0.0), self._key_tag.get(band, 0.0)) + 1.0 / weight
        self._key_tag[band] = tag
        waiter = _Waiter(num_tokens, key, priority, tag)
        self._waiters.append(waiter)
        self.queued_tokens += num_tokens
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.max_queue_time_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            granted = waiter.granted
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.num_admitted -= 1  # granted in the same moment: hand the slot on
                self.pump()
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

    def done(self, key: str = "", unprefilled_tokens: int = 0) -> None:
        """An admitted request of `key` left the mesh (with `unprefilled_tokens` of its prompt
        never computed): its slot goes to the next in line."""
        self._discharge(key, 1, unprefilled_tokens)
        self.num_admitted -= 1
        assert self.num_admitted >= 0, self.num_admitted
        self.pump()

    def pump(self) -> None:
        """Grant waiting requests while there is capacity, the highest band first and within it
        the smallest tag (also call it when capacity grows: an instance appeared or reported
        more room)."""
        while self._waiters and self.num_admitted < self._capacity():
            waiter = min(self._waiters, key=lambda w: (-w.priority, w.tag))  # ties: arrival order
            self._remove(waiter)
            if waiter.granted.done():  # gave up in the meantime
                continue
            self._band_time[waiter.priority] = waiter.tag
            self.num_admitted += 1
            waiter.granted.set_result(None)

    def _shed_below(self, priority: int) -> bool:
        """Shed the newest waiter of the lowest band below `priority` (its admit raises
        OverloadedError); False when no waiter ranks below."""
        lower = [w for w in self._waiters if w.priority < priority and not w.granted.done()]
        if not lower:
            return False
        lowest = min(w.priority for w in lower)
        victim = [w for w in lower if w.priority == lowest][-1]
        self._remove(victim)
        victim.granted.set_exception(
            OverloadedError(
                "the gateway's admission queue is full and a higher-priority request took this one's place; "
                "retry later",
                self._retry_hint(),
            )
        )
        return True

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return  # already granted or shed
        self.queued_tokens -= waiter.num_tokens
        band = (waiter.priority, waiter.key)
        if not any((w.priority, w.key) == band for w in self._waiters):
            self._key_tag.pop(band, None)  # an idle key stores up no credit

    def _retry_hint(self) -> float:
        """Seconds after which a retry may find room: grows with the queue, 1 s at least."""
        return max(1.0, min(30.0, len(self._waiters) / max(1, self._capacity())))
