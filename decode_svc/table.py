"""The decode engine's one table of requests by transfer id: what it holds, and how a request ends.

Each request is one `kvmesh.engine.request.Request` in `RequestTable._requests`, from Reserve
until its pages are freed (decode_svc/admission.py brings it in; decode_svc/transfers.py adds
its landing and expiry on the event loop). `release` aborts a request once, from any state;
`_free` gives one choice's pages back, exactly once, and forgets the transfer when its last
choice is freed. Everything is guarded by one lock (`_cond`), shared with the engine's loop
(decode_svc/engine.py).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.delivery import DispatchFn, RequestReleased
from kvmesh.engine.forward import Runner
from kvmesh.engine.kv_cache import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.speculative import create_speculator
from kvmesh.kvstore.kv_events import KVEvent
from kvmesh.kvstore.kv_publisher import KVEventPublisher
from kvmesh.kvstore.kv_tier import KVTier

logger = logging.getLogger(__name__)


class RequestTable:
    """The decode KV cache, the speculator and the table of requests over them, under one lock.

    The arguments are DecodeEngine's (its docstring says each). Raises ValueError as
    kvmesh.engine.speculative.create_speculator does.
    """

    def __init__(
        self,
        config: DecodeConfig,
        runner: Runner,
        dispatch: DispatchFn,
        on_events: Callable[[list[KVEvent]], None] | None,
        tier: KVTier | None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.dispatch = dispatch
        self.kv_cache = KVCacheManager(
            runner,
            config.num_pages,
            config.page_size,
            config.enable_prefix_caching,
            on_events,
            push_path=config.kv_push_path,
            tier=tier,
        )
        self.speculator = create_speculator(
            config.speculative,
            runner,
            self.kv_cache,
            config.max_batch_size,
            config.num_scratch_slots,
            config.num_draft_tokens,
            config.max_verify_rows,
            config.draft_row_cost,
        )
        self._cond = threading.Condition()
        self._requests: dict[int, Request] = {}
        """Every request from its reservation until its pages are freed, by transfer id."""
        self._num_sequences = 0
        """Choices reserved, waiting or running (a request with n choices counts n)."""
        self._waiting: deque[Request] = deque()
        """Choices begun (their KV landed), waiting for admission into the running batch."""
        self._running: list[Request] = []
        """The running batch: the choices the next step computes."""

    @property
    def pool(self):
        """The page pool (kvmesh.kvstore.block_pool.BlockPool) under the KV cache."""
        return self.kv_cache.pool

    # --- looking up ------------------------------------------------------------------

    def get(self, transfer_id: int) -> Request | None:
        """The request reserved under `transfer_id`, until its pages are freed."""
        return self._requests.get(transfer_id)

    def requests(self) -> list[Request]:
        """Every request reserved and not freed yet, in any state."""
        return list(self._requests.values())

    @property
    def num_active_requests(self) -> int:
        """Requests reserved, waiting or running."""
        return len(self._requests)

    # --- the KV push -----------------------------------------------------------------

    def transfer_buffers(self, transfer_id: int, landing: bool = True) -> list:
        """The buffers a push for this transfer lands in (landing: host buffers for them on the
        staged path, KVCacheManager.inbound), or (landing=False) the pages themselves, where
        the model reads them: the prompt's pages after the reused ones, then the state slot
        (DeepSeek-V4). KeyError if unknown."""
        with self._cond:
            r = self._requests[transfer_id]
            pages = r.block_ids[r.num_reused_pages : r.num_prompt_pages]
            return (
                self.kv_cache.inbound(transfer_id, pages, r.state_slot)
                if landing
                else self.kv_cache.push_buffers(pages, r.state_slot)
            )

    def kv_landed(self, transfer_id: int) -> None:
        """The push for this transfer is complete: its bytes reach the pages (a copy from host
        buffers on the staged path; nothing to do for a transfer released meanwhile)."""
        with self._cond:
            self.kv_cache.landed(transfer_id)

    def publish_snapshot(self, publisher: KVEventPublisher) -> None:
        """Re-publish every block hash decode's prefix cache holds (publisher.resync), under the
        lock its KV events are emitted under, so none slips between the snapshot and the publish."""
        with self._cond:
            publisher.resync(self.kv_cache.snapshot())

    # --- the end ---------------------------------------------------------------------

    def release(self, transfer_id: int, keep_pages: bool = False) -> bool:
        """Abort a request once: an attached Generate call gets RequestReleased, and its pages
        are freed now, at the next step if it is running, or with keep_pages on a later call
        (once no KV push can land in them any more). Returns False when the transfer is unknown
        (finished) or was aborted already."""
        with self._cond:
            r = self._requests.get(transfer_id)
            if r is None:
                return False
            first = r.status is not RequestStatus.ABORTED
            for c in r.choices or [r]:  # every choice ends with it
                if not c.freed:
                    self._abort_choice(c, keep_pages)
            if not keep_pages:
                logger.info("[%s] released", r.request_id)
            return first

    def _abort_choice(self, c: Request, keep_pages: bool) -> None:
        """Under the lock: one unfreed choice of a released request ends (its stream hears
        RequestReleased once) and its pages go back, unless the loop or a later call frees them."""
        if c.status is not RequestStatus.ABORTED:
            was, c.status = c.status, RequestStatus.ABORTED
            if c.emit is not None:
                ended = RequestReleased(f"[{c.request_id}] released while decoding")
                self.dispatch([(c.emit, [], ended, None)])
            if was is RequestStatus.RUNNING:
                self._cond.notify_all()  # the loop drops it between steps
                return
            if was is RequestStatus.WAITING:
                self._waiting.remove(c)
        elif c in self._running:
            return  # the loop frees it
        if not keep_pages:
            self._free(c)

    def _drop_aborted(self) -> None:
        """Under the lock, between steps: running choices released meanwhile leave the batch
        and give their pages back."""
        for r in [r for r in self._running if r.status is RequestStatus.ABORTED]:
            self._running.remove(r)
            self._free(r)
            logger.info("[%s] aborted while running", r.request_id)

    def _free(self, r: Request) -> None:
        """Give back one choice's pages and slot; the transfer is forgotten once every choice of
        it is freed (its table entry lives while any choice runs, so a release finds them)."""
        assert not r.freed, r.request_id
        if r.status is not RequestStatus.ABORTED:
            r.status = RequestStatus.FINISHED
            if r.finish is not None:  # every byte landed and every step wrote: its full blocks stay
                self.kv_cache.cache_sequence(r)
        self.kv_cache.free(r.block_ids, r.state_slot)
        self.speculator.forget(r)
        r.freed = True
        self._num_sequences -= 1
        owner = self._requests.get(r.transfer_id)
        if owner is not None and all(c.freed for c in owner.choices or [owner]):
            self.kv_cache.forget_landing(r.transfer_id)
            del self._requests[r.transfer_id]
