"""The requests a prefill engine has taken and not finished computing: the queue its worker
thread takes batches from, in arrival order, and the counts other threads read (the metrics'
queue depth, the stats). One lock guards the queue, the counts and each request's move from
WAITING (to RUNNING, or ABORTED by a cancel)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Iterable

from kvmesh.engine.request import Request, RequestStatus


class PendingRequests:
    """A prefill engine's queue of waiting requests and its counts."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._lock = threading.Lock()
        self.num_queued_tokens = 0
        """Prompt tokens of the requests taken and not yet computed (or failed)."""
        self.num_active = 0
        """Requests taken and not yet computed (or failed)."""

    def __bool__(self) -> bool:
        """Whether a request waits in the queue."""
        return bool(self._queue)

    def add(self, request: Request) -> concurrent.futures.Future:
        """Queue `request` as WAITING, with a new future (request.future, returned), in its
        place by arrival_time: behind those that reached the engine before it, ahead of those
        queued meanwhile that came after it (a request back from a pull, kvmesh.prefill_svc.kv_pull,
        keeps its place, as vLLM's waiting queue keeps one whose KV is loading)."""
        request.future = concurrent.futures.Future()
        request.status = RequestStatus.WAITING
        with self._lock:
            self.num_queued_tokens += request.num_prompt_tokens
            self.num_active += 1
            place = len(self._queue)
            while place > 0 and self._queue[place - 1].arrival_time > request.arrival_time:
                place -= 1
            self._queue.insert(place, request)
        return request.future

    def cancel(self, request: Request) -> None:
        """Mark a request ABORTED if it is still WAITING (its compute has not started)."""
        with self._lock:
            if request.status is RequestStatus.WAITING:
                request.status = RequestStatus.ABORTED

    def take(self, max_tokens: int) -> list[Request]:
        """The requests at the head of the queue whose prompts fit `max_tokens` together (the first
        one always, however long), taken out of it."""
        with self._lock:
            batch: list[Request] = []
            tokens = 0
            while self._queue and (not batch or tokens + self._queue[0].num_prompt_tokens <= max_tokens):
                request = self._queue.popleft()
                batch.append(request)
                tokens += request.num_prompt_tokens
            return batch

    def start(self, ready: Iterable[Request]) -> None:
        """Mark requests RUNNING: their compute starts (a cancel no longer stops them)."""
        with self._lock:
            for r in ready:
                r.status = RequestStatus.RUNNING

    def settle(self, batch: list[Request], waiting: list[Request]) -> None:
        """After a batch taken by `take`: requests of `waiting` go back to the head of the queue,
        in order; the others (computed, failed or cancelled) leave the counts."""
        with self._lock:
            for r in batch:
                if r not in waiting:
                    self.num_queued_tokens -= r.num_prompt_tokens
                    self.num_active -= 1
            self._queue.extendleft(reversed(waiting))
