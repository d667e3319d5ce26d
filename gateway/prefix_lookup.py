"""The gateway's questions to the prefix index: which prefill instance holds how much of a
prompt's leading blocks, asked in stages so a prompt nobody holds costs one short lookup.

If Redis is unreachable the lookup answers {} (routing goes by load alone), logs it once,
and answers again when Redis does; no request fails because of the index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvmesh.gateway import metrics
from kvmesh.kvstore.block_hash import BlockHash
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader

logger = logging.getLogger(__name__)


FIRST_LOOKUP_BLOCKS = 8
"""Blocks of a prompt asked of the prefix index first (128 tokens at 16 a block); see
PrefixLookup._leading_blocks."""


class PrefixLookup:
    """The prefix index as routing reads it, and whether it answers (`index_ok`).

    Args:
        index: the Redis prefix index, or None (routing by load alone).
    """

    def __init__(self, index: AsyncRedisKVIndexReader | None) -> None:
        self.index = index
        self.index_ok = True
        """False from a lookup that failed until one succeeds again."""
        metrics.PREFIX_INDEX_UP.set(1 if index is not None else 0)

    @property
    def informed(self) -> bool:
        """Whether routing now has the index's answers (there is one and it answers)."""
        return self.index is not None and self.index_ok

    async def leading_blocks_tiered(
        self, block_hashes: Sequence[BlockHash], instance_ids: list[str], tiered: bool = True
    ) -> tuple[dict[str, int], dict[str, int]]:
        """(instance_id -> leading blocks in its page pool, instance_id -> leading blocks in its
        pool or its second tier); with tiered=False the second is {} and the index is asked
        of the pools alone. ({}, {}) without an index or while it is unreachable (never raises;
        one lookup is bounded by 1 s)."""
        if self.index is None or not instance_ids:
            return {}, {}
        cached_blocks: tuple[dict[str, int], dict[str, int]] = ({}, {})
        try:
            async with asyncio.timeout(1.0):  # a scope, not wait_for: no task per request
                cached_blocks = await self._leading_blocks(block_hashes, instance_ids, tiered)
            if not self.index_ok:
                logger.info("prefix index reachable again; routing by cached prefix")
            self.index_ok = True
        except Exception as exc:
            if self.index_ok:
                logger.warning("prefix index unreachable (%s); routing by load alone", exc)
            self.index_ok = False
        metrics.PREFIX_INDEX_UP.set(1 if self.index_ok else 0)
        return cached_blocks

    async def _leading_blocks(
        self, block_hashes: Sequence[BlockHash], instance_ids: list[str], tiered: bool
    ) -> tuple[dict[str, int], dict[str, int]]:
        """The index's longest_prefix (longest_prefix_tiered when `tiered`), asked in stages of 8,
        32, 128, ... blocks, each stage only of the instances that held every block before it.
        The index spends one Redis command per block asked (~25 us of this loop's time each: 3.6
        ms for a 2K-token prompt), so a prompt no instance holds past its first blocks costs one
        short lookup; a prompt held whole costs a round trip (~0.2 ms) per stage more than one
        lookup of every block. A pool run counts on only while every earlier block was in the pool."""
        assert self.index is not None
        pool = dict.fromkeys(instance_ids, 0)
        total = dict.fromkeys(instance_ids, 0)
        in_pool = set(instance_ids)  # the pool's run has not ended yet
        start, size, asking = 0, FIRST_LOOKUP_BLOCKS, instance_ids
        while asking and start < len(block_hashes):
            end = min(len(block_hashes), start + size)
            if tiered:
                held = await self.index.longest_prefix_tiered(block_hashes[start:end], asking)
            else:
                held = {
                    i: (n, n) for i, n in (await self.index.longest_prefix(block_hashes[start:end], asking)).items()
                }
            for instance_id in asking:
                on_device, either = held[instance_id]
                total[instance_id] += either
                if instance_id in in_pool:
                    pool[instance_id] += on_device
                    if on_device < end - start:
                        in_pool.discard(instance_id)
            asking = [i for i in asking if held[i][1] == end - start]
            start, size = end, size * 4
        return pool, total if tiered else {}

    async def reap(self) -> None:
        """Drop the index entries of prefill instances whose lease lapsed (any gateway may)."""
        if self.index is None:
            return
        try:
            dead = await asyncio.wait_for(self.index.reap_expired(), timeout=2.0)
        except Exception as exc:  # the index is down: the lookups say so
            logger.debug("index reap skipped: %s", exc)
            return
        for instance_id in dead:
            logger.warning("%s stopped renewing its lease; its registry and index entries are removed", instance_id)

    async def close(self) -> None:
        if self.index is not None:
            await self.index.close()
