"""What every Prefill call on one instance uses (the engine, the KV sender, the puller, the
model served, the config), and the work that may outlive a call: connecting ahead to decode's
KV receiver, the last part of a push with the release of the pages after it, and the release of
an abandoned request's pages once its compute is done. kvmesh.prefill_svc.prefill_call runs the
calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass, field

from kvmesh.kvstore.transport import KVPushSender
from kvmesh.prefill_svc.config import PrefillConfig
from kvmesh.prefill_svc.engine import PrefillEngine
from kvmesh.prefill_svc.kv_pull import KVPuller
from kvmesh.prefill_svc.kv_push import KVPush, PushReport
from kvmesh.prefill_svc.result import PrefillResult
from kvmesh.runtime.served_model import ServedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillParts:
    """One prefill instance's parts, as its Prefill calls use them."""

    engine: PrefillEngine
    sender: KVPushSender
    """The process's KV push sender (to decode's KV receivers)."""
    model: ServedModel
    config: PrefillConfig
    """Its push_timeout_s bounds each part of a KV push; kv_digest hashes the pages pushed."""
    puller: KVPuller | None = None
    """Pulls a prefix a peer holds (PrefillRequest.pull_from); None: never."""
    background: set[asyncio.Task] = field(default_factory=set)
    """Connect-ahead and release tasks, kept until done (the event loop keeps only weak references)."""

    def keep(self, task: asyncio.Task) -> None:
        """Hold `task` until it is done."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def connect_ahead(self, address: str) -> None:
        """Connect to the decode's KV receiver while the prompt computes, so the push finds the
        connection made (a no-op when it is). A failure here is only logged: the push itself
        connects again and reports what it meets."""
        task = asyncio.ensure_future(self.sender.connect(address))

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                logger.debug("connecting ahead to %s failed: %r", address, t.exception())

        self.keep(task)
        task.add_done_callback(done)

    def finish_push(
        self, request_id: str, kv_push: KVPush | None, result: PrefillResult, compute_end: float
    ) -> asyncio.Future[PushReport]:
        """Start the push of what is left and the release of the pages after it, as a task of its
        own (`_push_and_release`): a push that outlives its caller (cancelled, or the caller's
        connection died while this process was stopped) finishes or fails on its own, and its
        error is retrieved so it is logged once."""
        pushing = asyncio.ensure_future(self._push_and_release(kv_push, result, compute_end))

        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                logger.info("[%s] KV push ended after its caller left: %s", request_id, f.exception())

        pushing.add_done_callback(done)
        return pushing

    async def _push_and_release(self, kv_push: KVPush | None, result: PrefillResult, compute_end: float) -> PushReport:
        """Push the pages not pushed yet (all of them without chunks) and the state, then drop our
        references. kv_push None: nothing to push (an empty report). compute_end:
        time.perf_counter() when the prompt's compute ended. Raises what KVPush.finish raises
        (TimeoutError, TransferError)."""
        try:
            if kv_push is None:
                return PushReport(0, 0.0, 0.0, 0, "")
            return await kv_push.finish(result.block_ids, result.state_slot, compute_end, self.config.kv_digest)
        finally:
            if kv_push is not None:
                await kv_push.wait_idle()
            self.engine.release(result.block_ids, result.state_slot)

    def release_when_computed(self, computing: concurrent.futures.Future, kv_push: KVPush | None) -> None:
        """The caller left: once the compute (`computing`, the engine's future) is done and no push
        part reads the pages, release them (a compute that failed or never started released them
        or held none)."""

        async def release() -> None:
            try:
                result = await asyncio.wrap_future(computing)
            except BaseException:
                return
            if kv_push is not None:
                await kv_push.wait_idle()
            self.engine.release(result.block_ids, result.state_slot)

        self.keep(asyncio.ensure_future(release()))
