"""Instances found in the registry, not listed: the gateway reads the instance registry
(kvstore/registry.py) every `interval_s` seconds and makes the pool's instances follow it.

Each read (`refresh`) compares the live registry records with the instances this gateway
discovered before:
- a record for an address the pool lacks adds that instance (polled at once, routed to once
  it answers);
- a discovered instance without a live record (it drained, or its lease lapsed: dead or
  frozen) is retired: no new request goes there, the ones it serves run on;
- a record of an instance the gateway was given on its command line (same address, or same
  instance id as a static instance reports) is that instance, not a second one.

While Redis does not answer, the instances stay as they are (logged once): an outage of the
registry neither adds nor removes any. The static `--prefill` / `--decode` lists work with
no registry at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvmesh.gateway.pool import InstancePool
from kvmesh.kvstore.registry import InstanceRecord

logger = logging.getLogger(__name__)

RETIRED_LINGER_S = 30.0
"""Seconds a retired instance's channel stays open after its last request (a late Release)."""


class Discovery:
    """Keeps `pool` in step with the registry.

    Args:
        live: returns the registry's live records (kvmesh.kvstore.registry.AsyncRegistryReader.live);
            may raise (Redis down): the pool is then left as it is.
        pool: the gateway's instances.
        interval_s: seconds between reads (each read is bounded by timeout_s).
        timeout_s: bound on one read of the registry, seconds.
    """

    def __init__(
        self,
        live: Callable[[], Awaitable[list[InstanceRecord]]],
        pool: InstancePool,
        interval_s: float,
        timeout_s: float = 2.0,
    ) -> None:
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s}, {timeout_s}")
        self._live = live
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.discovered: dict[str, str] = {}
        """address -> role of the instances the registry brought (static ones excluded)."""
        self.registry_ok = True
        self._mismatched: set[str] = set()
        """Addresses whose page size differs (logged once each)."""
        self._task: asyncio.Task | None = None

    async def refresh(self) -> bool:
        """One read of the registry and the pool made to follow it; False when the registry
        did not answer within timeout_s (nothing changed then). Never raises."""
        try:
            records = await asyncio.wait_for(self._live(), timeout=self.timeout_s)
        except Exception as exc:
            if self.registry_ok:
                logger.warning("instance registry unreachable (%s); keeping the instances known", exc)
            self.registry_ok = False
            return False
        if not self.registry_ok:
            logger.info("instance registry reachable again")
        self.registry_ok = True
        added = self._apply(records)
        if added:
            await self.pool.poll(added)  # learn id, load and health now, not at the next stats poll
        await self.pool.close_retired(RETIRED_LINGER_S)
        return True

    def _apply(self, records: list[InstanceRecord]) -> list:
        pool = self.pool
        static_ids = {
            i.instance_id
            for i in (*pool.prefills, *pool.decodes)
            if i.address in pool.static_addresses and i.instance_id
        }
        wanted: dict[str, InstanceRecord] = {}
        for r in records:
            if r.address in pool.static_addresses or r.instance_id in static_ids:
                continue  # given on the command line: already routed to
            if r.page_size and r.page_size != pool.page_size:
                # its stats would say so too; a foreign instance must not make the pool unusable
                if r.address not in self._mismatched:
                    self._mismatched.add(r.address)
                    logger.error(
                        "registry lists %s %s with page_size %d, the gateway %d; not routing to it",
                        r.role,
                        r.instance_id,
                        r.page_size,
                        pool.page_size,
                    )
                continue
            wanted[r.address] = r
        for address, role in list(self.discovered.items()):
            if address not in wanted or wanted[address].role != role:
                del self.discovered[address]
                if pool.retire_instance(address) is not None:
                    logger.info("%s %s left the registry; no new requests go there", role, address)
        added = []
        for address, r in wanted.items():
            if address in self.discovered:
                continue
            inst = pool.add_instance(r.role, address)
            self.discovered[address] = r.role
            if inst is not None:
                logger.info("%s %s (%s) joined through the registry", r.role, r.instance_id, address)
                added.append(inst)
        return added

    def start(self) -> None:
        """Refresh every interval_s seconds in the background until close()."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.refresh()
                except Exception:  # a bug must not end discovery for the gateway's life
                    logger.exception("instance discovery failed; retrying in %.1f s", self.interval_s)

        self._task = asyncio.ensure_future(loop())

    async def close(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
