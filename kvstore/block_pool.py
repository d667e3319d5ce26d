"""Paged KV block pool with a prefix cache: which page ids are free, shared, or evictable.

A block (page) is a fixed number of token slots of KV. The pool only manages ids and
reference counts; the KV tensor itself lives in the model runner. Each block is in
exactly one of three states:

    free        never cached (or its hash was dropped), refcount 0   -> `_free` (FIFO)
    evictable   holds a block hash, refcount 0                       -> `_evictable` (LRU)
    referenced  refcount > 0 (may or may not hold a hash)

Allocation takes free blocks first and only then evicts cached ones, least recently
used first, so a prefix stays reusable for as long as the memory allows. Every change
to the set of cached hashes is reported as KV events, which the prefill service
publishes to the Redis prefix index.

Reference: vLLM v1 KV cache manager and prefix caching (`vllm/v1/core/block_pool.py`,
`kv_cache_manager.py`). Not thread-safe: use a pool from one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.kvstore.block_hash import BlockHash
from kvmesh.kvstore.kv_events import BlockRemoved, BlockStored, KVEvent


class NoFreeBlocksError(RuntimeError):
    """Not enough allocatable blocks (free + evictable) for a request.

    Capacity, not a caller bug: servicers map it to gRPC RESOURCE_EXHAUSTED.
    """


@dataclass(frozen=True)
class PrefixMatch:
    """The cached prefix found for a request.

    Attributes:
        num_cached_tokens: tokens whose KV is already in `block_ids` (len(block_ids) * block_size).
        block_ids: the matched blocks, in prefix order; the caller now holds one reference on each.
    """

    num_cached_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Allocation:
    """Newly allocated blocks; the caller holds one reference on each."""

    block_ids: tuple[int, ...]


class BlockPool:
    """Reference-counted pool of `num_blocks` KV pages of `block_size` tokens each.

    Args:
        num_blocks: number of pages, >= 1.
        block_size: token slots per page, >= 1.
        enable_prefix_caching: when False, nothing is ever cached, matched or reported
            (decode pools run this way).
        on_events: called synchronously with each batch of KV events (stored, removed),
            in the order the changes happened.
        on_evict: called with the (block id, hash) pairs `allocate` evicts, after their
            BlockRemoved and before the ids are handed out (a second tier copies the pages
            out then: kvmesh.kvstore.kv_tier).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        on_evict: Callable[[list[tuple[int, BlockHash]]], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._on_events = on_events
        self._on_evict = on_evict
        self._refcount = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # handed out from the left
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self._num_referenced = 0

    # --- counters -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` could hand out now: free + evictable (cached, refcount 0)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a block hash (referenced or evictable)."""
        return len(self._by_hash)

    @property
    def num_referenced_blocks(self) -> int:
        """Blocks with refcount > 0."""
        return self._num_referenced

    def cached_hashes(self) -> set[BlockHash]:
        """Every block hash this pool holds now (what the prefix index should say about it)."""
        return set(self._by_hash)

    # --- operations ---------------------------------------------------------------

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """Find the longest run of leading `block_hashes` that is cached and take a reference on each.

        Matched blocks leave the eviction queue until their last reference is freed. A
        caller that needs logits for the last prompt token must not pass the hash of a
        block holding that token (recompute it instead), as vLLM does.

        Returns:
            PrefixMatch(num_cached_tokens=len(block_ids) * block_size, block_ids); empty
            when prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return PrefixMatch(0, ())
        matched: list[int] = []
        for block_hash in block_hashes:
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            self._ref(block_id)
            matched.append(block_id)
        return PrefixMatch(len(matched) * self.block_size, tuple(matched))

    def allocate(self, num_blocks: int) -> Allocation:
        """Hand out `num_blocks` blocks with refcount 1, all or nothing.

        Never-cached free blocks go first (lowest ids first on a fresh pool, then in the
        order they were freed); then the least recently used evictable blocks, whose
        hashes are dropped and reported in ONE BlockRemoved event.

        Raises:
            ValueError: num_blocks < 0.
            NoFreeBlocksError: fewer than num_blocks allocatable blocks; nothing changes.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} KV blocks, only {self.num_free_blocks} free "
                f"(of {self.num_blocks}, {self._num_referenced} in use)"
            )
        block_ids: list[int] = []
        evicted: list[tuple[int, BlockHash]] = []
        while len(block_ids) < num_blocks and self._free:
            block_ids.append(self._free.popleft())
        while len(block_ids) < num_blocks:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of[block_id]
            assert block_hash is not None, f"evictable block {block_id} holds no hash"
            del self._by_hash[block_hash]
            self._hash_of[block_id] = None
            evicted.append((block_id, block_hash))
            block_ids.append(block_id)
        for block_id in block_ids:
            self._refcount[block_id] = 1
        self._num_referenced += len(block_ids)
        if evicted:
            self._emit([BlockRemoved(tuple(h for _, h in evicted))])
            if self._on_evict is not None:
                self._on_evict(evicted)
        return Allocation(tuple(block_ids))

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Mark full, computed blocks as holding these hashes so later requests can reuse them.

        Blocks already holding a hash are skipped. When another block already holds a
        hash, that block stays the cached copy and this one stays uncached (it returns
        to the free list when freed). Emits one BlockStored with the newly cached hashes.
        No-op when prefix caching is off.

        Raises:
            ValueError: lengths differ, or a block is not referenced (only blocks the
                caller holds can be filled with KV).
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"got {len(block_ids)} block ids but {len(block_hashes)} hashes")
        if not self.enable_prefix_caching:
            return
        for block_id in block_ids:
            self._check_id(block_id)
            if self._refcount[block_id] == 0:
                raise ValueError(f"block {block_id} is not allocated; only referenced blocks can be cached")
        stored: list[BlockHash] = []
        for block_id, block_hash in zip(block_ids, block_hashes):
            if self._hash_of[block_id] is not None or block_hash in self._by_hash:
                continue
            self._hash_of[block_id] = block_hash
            self._by_hash[block_hash] = block_id
            stored.append(block_hash)
        if stored:
            self._emit([BlockStored(tuple(stored))])

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each of these blocks, which the caller holds already
        (sequences sharing a prompt's pages: n > 1 choices); each is freed once per reference.

        Raises:
            ValueError: an id is out of range or not referenced (nothing changes then).
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._refcount[block_id] == 0:
                raise ValueError(f"block {block_id} is not allocated; only referenced blocks can be shared")
        for block_id in block_ids:
            self._ref(block_id)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in the given order.

        A block reaching refcount 0 joins the eviction queue's tail (most recently used)
        if it holds a hash, else the free list's tail. Free a request's blocks last
        block first so its tail is evicted before the prefix others share (vLLM does).

        Raises:
            ValueError: an id is out of range.
            AssertionError: a block would be freed more often than it is referenced
                (double free); nothing changes then.
        """
        block_ids = list(block_ids)  # walked twice: check everything, then apply
        drops: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, n in drops.items():
            assert self._refcount[block_id] >= n, (
                f"double free of block {block_id}: refcount {self._refcount[block_id]}, freed {n} times"
            )
        for block_id in block_ids:
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                self._num_referenced -= 1
                if self._hash_of[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def check_integrity(self) -> None:
        """Assert the pool's invariants (tests call it after every scenario).

        Free + evictable + referenced == num_blocks, no block in two states, refcounts
        >= 0, the hash map and the per-block hashes agree.
        """
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b, r in enumerate(self._refcount) if r > 0}
        assert len(free) == len(self._free), f"duplicate ids in the free list: {list(self._free)}"
        assert all(r >= 0 for r in self._refcount), f"negative refcount: {self._refcount}"
        assert not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)}"
        assert not free & referenced, f"blocks both free and referenced: {sorted(free & referenced)}"
        assert not evictable & referenced, f"blocks both evictable and referenced: {sorted(evictable & referenced)}"
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, (
            len(free),
            len(evictable),
            len(referenced),
            self.num_blocks,
        )
        assert self._num_referenced == len(referenced), (self._num_referenced, len(referenced))
        for block_hash, block_id in self._by_hash.items():
            assert self._hash_of[block_id] == block_hash, (
                f"hash map says block {block_id} holds {block_hash.hex()}, block says {self._hash_of[block_id]!r}"
            )
        cached = {b for b, h in enumerate(self._hash_of) if h is not None}
        assert len(cached) == len(self._by_hash), f"{len(cached)} blocks hold hashes, hash map has {len(self._by_hash)}"
        assert evictable <= cached, f"evictable blocks without a hash: {sorted(evictable - cached)}"
        assert not free & cached, f"free blocks holding a hash: {sorted(free & cached)}"
        if not self.enable_prefix_caching:
            assert not cached, f"prefix caching is off but blocks hold hashes: {sorted(cached)}"

    # --- helpers ------------------------------------------------------------------

    def _ref(self, block_id: int) -> None:
        if self._refcount[block_id] == 0:
            self._evictable.pop(block_id)  # in use again: not a candidate for eviction
            self._num_referenced += 1
        self._refcount[block_id] += 1

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id}")

    def _emit(self, events: list[KVEvent]) -> None:
        if self._on_events is not None:
            self._on_events(events)
