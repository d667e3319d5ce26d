"""BlockPool: exact block ids, LRU eviction order, references, all-or-nothing allocation, KV events."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.kvstore.block_pool import Allocation, BlockPool, NoFreeBlocksError, PrefixMatch
from kvmesh.kvstore.kv_events import BlockRemoved, BlockStored

BS = 4  # tokens per block


def make_pool(num_blocks: int = 6, caching: bool = True):
    events: list = []
    pool = BlockPool(num_blocks, BS, enable_prefix_caching=caching, on_events=events.extend)
    return pool, events


def prompt_hashes(first_token: int, num_blocks: int):
    """Hashes of a prompt of num_blocks full blocks: tokens first_token, first_token+1, ..."""
    return hash_blocks(list(range(first_token, first_token + num_blocks * BS)), BS)


def test_fresh_pool_hands_out_lowest_ids_first():
    pool, events = make_pool(6)
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 0 and pool.num_referenced_blocks == 0
    assert pool.allocate(2) == Allocation((0, 1))
    assert pool.allocate(3) == Allocation((2, 3, 4))
    assert pool.allocate(0) == Allocation(())
    assert pool.num_free_blocks == 1 and pool.num_referenced_blocks == 5
    assert events == []  # nothing cached, nothing evicted
    pool.check_integrity()


def test_cache_match_and_lru_eviction_order():
    pool, events = make_pool(6)
    a = prompt_hashes(0, 3)  # request A: 3 full blocks
    b = prompt_hashes(100, 2)  # request B: 2 full blocks

    # A gets blocks 0, 1, 2 and caches them
    ids_a = pool.allocate(3).block_ids
    assert ids_a == (0, 1, 2)
    pool.cache_blocks(ids_a, a)
    assert events == [BlockStored(tuple(a))]
    # B gets blocks 3, 4 and caches them
    ids_b = pool.allocate(2).block_ids
    assert ids_b == (3, 4)
    pool.cache_blocks(ids_b, b)
    assert events[-1] == BlockStored(tuple(b))
    assert pool.num_cached_blocks == 5 and pool.cached_hashes() == set(a) | set(b)

    # A finishes, last block first (as callers should): eviction queue = [2, 1, 0]
    pool.free(reversed(ids_a))
    # then B finishes: queue = [2, 1, 0, 4, 3] (least recently used first)
    pool.free(reversed(ids_b))
    assert pool.num_free_blocks == 6 and pool.num_referenced_blocks == 0 and pool.num_cached_blocks == 5
    pool.check_integrity()

    # request C shares A's first two blocks: they are referenced and leave the queue -> [2, 4, 3]
    match = pool.match_prefix(a[:2] + prompt_hashes(500, 1))
    assert match == PrefixMatch(num_cached_tokens=2 * BS, block_ids=(0, 1))
    assert pool.num_referenced_blocks == 2 and pool.num_free_blocks == 4

    # C needs 3 more: block 5 was never cached and goes first, then LRU evicts 2 and 4
    events.clear()
    assert pool.allocate(3) == Allocation((5, 2, 4))
    assert events == [BlockRemoved((a[2], b[1]))]  # ONE event for the whole allocation
    assert pool.cached_hashes() == {a[0], a[1], b[0]}
    # block 3 (B's first block) is the only evictable one left
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_match_prefix_takes_references_and_stops_at_first_miss():
    pool, events = make_pool(4)
    h = prompt_hashes(0, 3)
    ids = pool.allocate(3).block_ids  # (0, 1, 2)
    pool.cache_blocks(ids, h)
    pool.free(ids)  # all three evictable, refcount 0

    # a gap in the middle: only the leading run counts (block 0)
    assert pool.match_prefix([h[0], prompt_hashes(99, 1)[0], h[2]]) == PrefixMatch(BS, (0,))
    # two requests share the full prefix: block 0 now has refcount 2, blocks 1, 2 refcount 1
    assert pool.match_prefix(h) == PrefixMatch(3 * BS, (0, 1, 2))
    assert pool.num_referenced_blocks == 3 and pool.num_free_blocks == 1
    # nothing cached matches an unrelated prompt
    assert pool.match_prefix(prompt_hashes(1000, 2)) == PrefixMatch(0, ())
    # freeing once leaves block 0 referenced by the other request
    pool.free([0])
    assert pool.num_referenced_blocks == 3
    pool.free([2, 1, 0])
    assert pool.num_referenced_blocks == 0 and pool.num_free_blocks == 4
    assert events == [BlockStored(tuple(h))]  # matching emits nothing
    pool.check_integrity()


def test_allocate_is_all_or_nothing():
    pool, events = make_pool(4)
    h = prompt_hashes(0, 2)
    ids = pool.allocate(2).block_ids  # (0, 1)
    pool.cache_blocks(ids, h)
    pool.free(ids)  # evictable: [0, 1]
    pool.allocate(1)  # block 2 (never cached), refcount 1
    # 3 allocatable (block 3 free, blocks 0, 1 evictable); asking for 4 changes nothing
    with pytest.raises(NoFreeBlocksError, match=r"asked for 4 KV blocks, only 3 free"):
        pool.allocate(4)
    assert pool.num_free_blocks == 3 and pool.cached_hashes() == set(h)
    assert events == [BlockStored(tuple(h))]  # no BlockRemoved from the failed call
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_no_free_blocks_when_everything_is_referenced():
    pool, _ = make_pool(2)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError) as err:
        pool.allocate(1)
    assert "asked for 1" in str(err.value) and "only 0 free" in str(err.value)
    assert isinstance(err.value, RuntimeError)
    pool.check_integrity()


def test_double_free_asserts_and_changes_nothing():
    pool, _ = make_pool(3)
    ids = pool.allocate(2).block_ids  # (0, 1)
    pool.free([ids[0]])
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([0])
    # a list freeing block 1 twice fails before touching block 1 at all
    with pytest.raises(AssertionError, match="double free of block 1"):
        pool.free([1, 1])
    assert pool.num_referenced_blocks == 1
    with pytest.raises(ValueError, match="block id"):
        pool.free([7])
    pool.free([1])
    pool.check_integrity()


def test_freed_uncached_blocks_return_to_the_free_list_tail():
    pool, _ = make_pool(4)
    pool.allocate(4)  # 0, 1, 2, 3
    pool.free([2, 0])  # free list: [2, 0]
    assert pool.allocate(2) == Allocation((2, 0))
    pool.check_integrity()


def test_cache_blocks_skips_cached_ids_and_duplicate_hashes():
    pool, events = make_pool(6)
    h = prompt_hashes(0, 2)
    first = pool.allocate(2).block_ids  # (0, 1)
    pool.cache_blocks(first, h)
    # another request computed the same prefix in blocks 2, 3 (it raced the first one):
    # the hashes stay with blocks 0, 1; blocks 2, 3 stay uncached
    second = pool.allocate(2).block_ids  # (2, 3)
    events.clear()
    pool.cache_blocks(second, h)
    assert events == []  # nothing new was cached
    # re-caching already cached ids is a no-op too (prefill passes matched + new blocks)
    pool.cache_blocks(first, h)
    assert events == []
    assert pool.num_cached_blocks == 2
    # freeing: 2 and 3 go back to the free list, 0 and 1 become evictable
    pool.free(second)
    pool.free(first)
    assert pool.allocate(3) == Allocation((4, 5, 2))  # never-cached/free first: 4, 5, then 2
    pool.check_integrity()
    with pytest.raises(ValueError, match="hashes"):
        pool.cache_blocks([3], [])
    with pytest.raises(ValueError, match="not allocated"):
        pool.cache_blocks([3], h[:1])  # block 3 is free: nobody computed KV into it


def test_prefix_caching_off_never_caches_or_emits():
    pool, events = make_pool(3, caching=False)
    h = prompt_hashes(0, 2)
    ids = pool.allocate(2).block_ids
    pool.cache_blocks(ids, h)
    assert pool.num_cached_blocks == 0
    pool.free(ids)
    assert pool.match_prefix(h) == PrefixMatch(0, ())
    assert events == []
    assert pool.allocate(3) == Allocation((2, 0, 1))
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool, _ = make_pool(3)
    pool.allocate(1)
    pool._free.append(0)  # block 0 is referenced AND on the free list
    with pytest.raises(AssertionError, match="both free and referenced"):
        pool.check_integrity()


def test_constructor_validates():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
