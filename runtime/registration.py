"""Keeping a prefill or decode instance in the instance registry (kvstore/registry.py) while
it serves: register once warm, renew the lease every third of its TTL, leave first thing
on SIGTERM (so gateways stop routing here before the server stops admitting), and, if the
process dies or freezes, let the lease lapse on its own.

    registration = Registration(registry, record, ttl_s=10.0)
    registration.start()          # after warm-up, before mark_serving
    ...
    await registration.leave()    # the first step of the drain
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvmesh.kvstore.registry import InstanceRecord, InstanceRegistry

logger = logging.getLogger(__name__)


class Registration:
    """This instance's registry entry, renewed by a task on the event loop.

    Args:
        registry: where the entry lives (sync client; every call runs in a worker thread).
        record: what the entry says (address, role, model, page size).
        ttl_s: lease TTL, seconds; renewed every ttl_s / 3.
        after_beat: awaited after each renewal with whether the registry had lost this
            instance (the first renewal, or Redis restarted empty): prefill re-publishes its
            prefix cache then. Its errors count as a failed renewal.
    """

    def __init__(
        self,
        registry: InstanceRegistry,
        record: InstanceRecord,
        ttl_s: float,
        after_beat: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 s, got {ttl_s}")
        self.registry = registry
        self.record = record
        self.ttl_s = ttl_s
        self.after_beat = after_beat
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.renewals = 0
        """Renewals that reached Redis (tests read it)."""

    def start(self) -> None:
        """Start renewing (the first renewal runs at once, in the background)."""
        assert self._task is None, "registration started twice"
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        down = False
        interval = self.ttl_s / 3
        while not self._stopping.is_set():
            try:
                lost = await asyncio.to_thread(
                    self.registry.heartbeat, self.record.instance_id, self.ttl_s, self.record
                )
                if self._stopping.is_set():
                    break  # leave() runs next; its delete wins
                if self.after_beat is not None:
                    await self.after_beat(lost)
                self.renewals += 1
                if down:
                    logger.info("registry reachable again; lease of %s renewed", self.record.instance_id)
                down = False
            except Exception as exc:
                if not down:
                    logger.warning("cannot renew the registry lease (%s); retrying every %.1f s", exc, interval)
                down = True
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=interval)
            except TimeoutError:
                pass

    async def leave(self, timeout_s: float = 5.0) -> None:
        """Stop renewing and delete the entry, within about timeout_s seconds (a renewal in
        flight is waited for first, so it cannot bring the entry back). Never raises: an
        entry left behind by an unreachable Redis lapses after ttl_s."""
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=timeout_s)
            except TimeoutError:
                logger.warning("lease renewal still running after %.0f s; leaving anyway", timeout_s)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.registry.leave, self.record.instance_id), timeout=timeout_s)
            logger.info("left the instance registry")
        except Exception as exc:
            logger.warning("could not leave the registry (%s); the lease lapses in %.0f s", exc, self.ttl_s)
