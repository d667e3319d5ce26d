"""KV events to the Redis index off the model thread.

The prefix cache emits KV events (blocks stored / removed / cleared) on prefill's worker
thread, in the middle of compute. Writing them to Redis there would let a slow or stopped
Redis stall the forward pass, so `KVEventPublisher.publish` only appends to a bounded
buffer and one background thread writes batches in order, each write bounded by the Redis
client's socket timeout. When Redis fails or the buffer overflows, events are dropped and
the index is marked stale: `needs_resync` tells the heartbeat to replace this instance's
entries with what the cache holds (`resync`) once Redis answers again. Routing
meanwhile reads a stale index, which costs cache hits, never correctness.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence

from kvmesh.kvstore.kv_events import AllBlocksCleared, BlockStored, KVEvent

logger = logging.getLogger(__name__)


class KVEventPublisher:
    """Buffers KV events and writes them with `write(events)` on a thread of its own.

    Args:
        write: publishes one batch (e.g. `lambda ev: index.publish(instance_id, ev)`); may raise.
        max_buffered_events: events held while Redis is slow; past it the oldest are dropped.
    """

    def __init__(self, write: Callable[[Sequence[KVEvent]], None], max_buffered_events: int = 100_000) -> None:
        if max_buffered_events < 1:
            raise ValueError(f"max_buffered_events must be >= 1, got {max_buffered_events}")
        self._write = write
        self._max = max_buffered_events
        self._buffer: collections.deque[KVEvent] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._down = False
        self.needs_resync = False
        """Events were dropped: the index no longer mirrors the cache (the heartbeat resyncs)."""
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue events (never blocks on Redis; call from the worker thread)."""
        with self._cond:
            self._buffer.extend(events)
            overflow = len(self._buffer) - self._max
            if overflow > 0:
                for _ in range(overflow):
                    self._buffer.popleft()
                self._dropped(overflow)
            self._cond.notify()

    def resync(self, stored: Sequence[BlockStored]) -> None:
        """Replace the instance's index entries with `stored` (what the cache holds now, one
        BlockStored a medium: KVCacheManager.snapshot()).

        Call where the cache emits its events, with a snapshot taken there: the events still
        buffered are older than the snapshot and are dropped, and the snapshot (cleared +
        stored) goes out in their place, in order with every later event.
        """
        with self._cond:
            self._buffer.clear()
            self._buffer.append(AllBlocksCleared())
            self._buffer.extend(s for s in stored if s.block_hashes)
            self.needs_resync = False
            self._cond.notify()

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is buffered (for at most timeout_s seconds), then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _dropped(self, n: int) -> None:
        self.num_dropped += n
        if not self.needs_resync:
            logger.warning("dropped %d KV events (Redis slow or down); the index will be resynced", n)
        self.needs_resync = True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._buffer and not self._closed:
                    self._cond.wait()
                if not self._buffer:
                    return
                batch = list(self._buffer)
                self._buffer.clear()
            try:
                self._write(batch)
                if self._down:
                    logger.info("KV events reach the index again")
                self._down = False
            except Exception as exc:  # the index lags; serving goes on
                if not self._down:
                    logger.warning("could not publish %d KV events: %s", len(batch), exc)
                self._down = True
                with self._cond:
                    self._dropped(len(batch))
                    if self._closed:
                        return
