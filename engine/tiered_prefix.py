# P=pages
"""The prefix cache over two tiers, as kvmesh.engine.kv_cache's KVCacheManager uses it: the page
pool (kvmesh.kvstore.block_pool) and an optional second tier (kvmesh.kvstore.kv_tier) that keeps
the pages the pool evicts. A prefix match takes the pool's hits, then loads the tier's hits back
into new pages; an eviction spills its pages to the tier first.

A tier that fails costs a recompute or a lost copy, never a failed request: its errors are
logged and taken as misses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.kvstore.block_hash import BlockHash
from kvmesh.kvstore.block_pool import BlockPool
from kvmesh.kvstore.kv_tier import KVTier

logger = logging.getLogger(__name__)

PageBuffer = Callable[[int], Any]
"""A runner's page_buffer: page id -> its writable bytes."""


def match_and_allocate(
    pool: BlockPool,
    tier: KVTier | None,
    hashes: Sequence[BlockHash],
    num_pages: int,
    error: type[Exception],
    page_buffer: PageBuffer,
) -> tuple[list[int], int, int]:
    """num_pages pages whose leading ones hold the longest cached run of `hashes`: pool hits
    referenced, then second-tier hits copied into new pages (which rejoin the pool's cache),
    then fresh pages. Returns (block ids, leading pages that hold cached KV, how many of those
    came from the tier). All or nothing: raises `error` when the pool lacks the pages."""
    match = pool.match_prefix(hashes)
    on_device = len(match.block_ids)
    in_tier = _run_in_tier(tier, hashes, on_device) if tier is not None else 0
    need = num_pages - on_device
    if need > pool.num_free_blocks:
        pool.free(match.block_ids)
        raise error(
            f"request needs {num_pages} KV pages, {pool.num_free_blocks} of "
            f"{pool.num_blocks} are free; lower max_tokens or retry later"
        )
    new = pool.allocate(need).block_ids  # may evict (and spill) blocks; never the matched ones
    loaded = 0
    if tier is not None and in_tier:
        loaded = _load_from_tier(tier, hashes[on_device : on_device + in_tier], new, page_buffer)
    if loaded:
        pool.cache_blocks(new[:loaded], hashes[on_device : on_device + loaded])
    return [*match.block_ids, *new], on_device + loaded, loaded


def _run_in_tier(tier: KVTier, hashes: Sequence[BlockHash], start: int) -> int:
    """How many of hashes[start:], in a row from `start`, the tier holds."""
    n = 0
    while start + n < len(hashes) and hashes[start + n] in tier:
        n += 1
    return n


def _load_from_tier(tier: KVTier, hashes: Sequence[BlockHash], pages: Sequence[int], page_buffer: PageBuffer) -> int:
    """Copy the tier's blocks `hashes` into `pages`, in order, until one fails; returns how many
    were loaded."""
    loaded = 0
    while loaded < len(hashes):
        try:
            got = tier.get(hashes[loaded], page_buffer(pages[loaded]))
        except Exception:  # a tier that fails is a miss: it must never fail the request
            logger.exception("KV tier load failed; recomputing from there")
            got = False
        if not got:
            break  # its bytes are gone: the run stops there and the rest is recomputed
        loaded += 1
    return loaded


def spill_to_tier(tier: KVTier, evicted: list[tuple[int, BlockHash]], page_buffer: PageBuffer) -> None:
    """The pool evicted these (page id, block hash) blocks: their pages go to the tier before reuse."""
    for block_id, block_hash in evicted:
        try:
            tier.put(block_hash, page_buffer(block_id))
        except Exception:  # inside the pool's allocation: losing the copy is all a tier may cost
            logger.exception("KV tier could not keep an evicted block; it is dropped")


def tier_figures(tier: KVTier | None) -> dict[str, int | str]:
    """The tier's figures for GetStats ({} without a tier)."""
    if tier is None:
        return {}
    return {
        "kv_tier_medium": tier.medium,
        "num_tier_blocks": len(tier),
        "num_tier_loads": tier.num_loads,
        "num_tier_failed_loads": tier.num_failed_loads,
    }
