# P=pages, R=state slots
"""The KV cache both roles share: `KVCacheManager`, which hands a request its pages and state
slot (vLLM v1's KVCacheManager), over the page layout and memory of kvmesh.engine.kv_layout.

`KVCacheManager` wraps kvmesh.kvstore.block_pool.BlockPool (page ids, reference counts, the prefix
cache and its KV events), its second tier (kvmesh.engine.tiered_prefix) and the state slots
(kvmesh.engine.state_slots); both engines go through it, and it owns the figures GetStats
reports, the page gauges and check_integrity(). The buffers a KV push moves come from its base,
kvmesh.engine.kv_push_buffers.KVPushBuffers. Not thread-safe: each engine calls it under its
lock or on its one worker thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvmesh.engine.kv_push_buffers import KVPushBuffers
from kvmesh.engine.request import Request
from kvmesh.engine.state_slots import StateSlots
from kvmesh.engine.tiered_prefix import match_and_allocate, spill_to_tier, tier_figures
from kvmesh.kvstore.block_hash import BlockHash, hash_blocks
from kvmesh.kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvmesh.kvstore.kv_events import BlockStored
from kvmesh.kvstore.kv_tier import KVTier

if TYPE_CHECKING:
    from kvmesh.engine.forward import Runner
    from kvmesh.kvstore.kv_events import KVEvent


class KVCacheManager(KVPushBuffers):
    """A runner's pages and state slots as requests hold them.

    Args:
        runner: the model runner whose memory this manages (its page_buffer, state_buffers,
            resume_state_slot, num_state_slots).
        num_pages, page_size: the pool's pages and tokens a page.
        enable_prefix_caching: keep full blocks cached by block hash after their request (KV
            events go to on_events): prefill's prompt blocks (allocate_prompt, cache_prompt),
            decode's prompt and answer blocks (allocate with reuse, cache_sequence).
        on_events: called with each batch of KV events, in order (prefill publishes them).
        push_path: how KV pushes reach the pages (kvmesh.kvstore.staging: auto, direct, staged); the
            choice made, and why, are `push_path` and `push_path_reason`.
        tier: a second tier (kvmesh.kvstore.kv_tier, its events going to on_events too) that keeps the
            pages the pool evicts and gives them back on a later prefix hit; None: evicted
            blocks are gone. Only with prefix caching.

    Raises ValueError for a push path UCX cannot serve (direct without a CUDA transport).
    """

    def __init__(
        self,
        runner: Runner,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = False,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        push_path: str = "auto",
        tier: KVTier | None = None,
    ) -> None:
        super().__init__(runner, push_path)
        self.page_size = page_size
        self.tier = tier if enable_prefix_caching else None
        if self.tier is not None:
            self.tier.on_events = on_events  # its events go where the pool's go, in order with them
        self.pool = BlockPool(
            num_pages,
            page_size,
            enable_prefix_caching=enable_prefix_caching,
            on_events=on_events,
            on_evict=self._spill if self.tier is not None else None,
        )
        self.slots = StateSlots(runner.num_state_slots)
        self.scratch_slots: list[int] = []
        """Slots held for good (decode's speculative verification rows), not by a request."""
        self.num_holders = 0
        """Requests holding pages (and a slot) now: allocated and not freed."""
        self.num_block_holds = 0
        """Cached blocks held for a peer's pull while their pages are pushed (hold_blocks)."""

    def num_pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def hold_scratch_slots(self, n: int) -> list[int]:
        """Set `n` state slots aside for good ([] for a runner without slots)."""
        self.scratch_slots = [s for s in (self.slots.allocate() for _ in range(n)) if s is not None]
        return self.scratch_slots

    # --- allocation -------------------------------------------------------------

    def allocate(
        self,
        request: Request,
        num_tokens: int,
        error: type[Exception] = NoFreeBlocksError,
        reuse: Sequence[BlockHash] = (),
    ) -> None:
        """Decode: give `request` pages for num_tokens tokens and a state slot, all or nothing.

        reuse: hashes of the prompt's leading full blocks whose cached pages the request may
        reference instead of new ones (decode-side prefix reuse; `num_reused_pages` says how many
        it got, and the push skips them). Raises `error` (the caller's capacity error) when pages
        or slots are short; nothing is held then."""
        self._require_slot(error)
        num_pages = self.num_pages_for(num_tokens)
        request.block_ids, request.num_reused_pages, _ = self._match_and_allocate(reuse[:num_pages], num_pages, error)
        request.state_slot = self.slots.allocate()
        request.num_prompt_pages = self.num_pages_for(request.num_prompt_tokens)
        self.num_holders += 1

    def allocate_choice(self, request: Request, num_tokens: int, num_shared: int, error: type[Exception]) -> None:
        """Decode, n > 1: pages for one more choice of a request whose first `num_shared` pages
        (the prompt's full pages) it will share (`fork`): its own pages for the rest of
        num_tokens tokens and a state slot, all or nothing. Raises `error` when short."""
        self._require_slot(error)
        need = self.num_pages_for(num_tokens) - num_shared
        if need > self.pool.num_free_blocks:
            raise error(
                f"request needs {need} more KV pages for another choice, {self.pool.num_free_blocks} of "
                f"{self.pool.num_blocks} are free; lower n or max_tokens, or retry later"
            )
        request.block_ids = list(self.pool.allocate(need).block_ids)
        request.state_slot = self.slots.allocate()
        request.num_prompt_pages = self.num_pages_for(request.num_prompt_tokens)
        self.num_holders += 1

    def fork(self, parent: Request, child: Request, num_shared: int) -> None:
        """Decode, n > 1, once the parent's prompt KV landed: the child (allocate_choice) shares
        the parent's first num_shared pages (one more reference each, freed with the child)
        and gets a copy of what its own pages must start with: the parent's partial last prompt
        page (copy-on-write, done at the fork since every choice writes its first token there)
        and its state slot (DeepSeek-V4)."""
        shared = parent.block_ids[:num_shared]
        self.pool.share(shared)
        if parent.num_prompt_pages > num_shared:  # the prompt ends inside a page: each choice its own
            src = self.runner.page_buffer(parent.block_ids[num_shared])
            self.runner.page_buffer(child.block_ids[0])[...] = src  # type: ignore[assignment]
        child.block_ids = [*shared, *child.block_ids]
        if parent.state_slot is not None and child.state_slot is not None:
            self.runner.copy_state_slot(parent.state_slot, child.state_slot)

    def allocate_prompt(self, request: Request) -> None:
        """Prefill: reuse the longest cached prefix of the prompt's blocks and allocate pages for
        the rest, plus a state slot (resumed from the cached prefix's end). Sets block_ids,
        num_cached_tokens, num_computed_tokens (= cached), num_tier_tokens (of the cached, those
        loaded from the second tier), state_slot, block_hashes. A request
        that asks for prompt logprobs reuses nothing (every position's logits are computed).
        Raises NoFreeBlocksError when pages or slots are short; nothing is held then."""
        self._require_slot(NoFreeBlocksError)
        tokens, size = request.prompt_token_ids, self.page_size
        if request.block_hashes is None:
            request.block_hashes = hash_blocks(tokens, size)
        # recompute at least the last prompt token so its logits exist
        reusable = 0 if request.sampling.prompt_logprobs is not None else (len(tokens) - 1) // size
        request.block_ids, num_cached, from_tier = self._match_and_allocate(
            request.block_hashes[:reusable], self.num_pages_for(len(tokens)), NoFreeBlocksError
        )
        request.num_prompt_pages = len(request.block_ids)
        request.num_cached_tokens = request.num_computed_tokens = num_cached * size
        request.num_tier_tokens = from_tier * size
        request.state_slot = self.slots.allocate()
        self.num_holders += 1
        if request.state_slot is not None and num_cached:  # continue from the end of the cached prefix
            self.runner.resume_state_slot(request.state_slot, request.block_ids[num_cached - 1])

    def _match_and_allocate(
        self, hashes: Sequence[BlockHash], num_pages: int, error: type[Exception]
    ) -> tuple[list[int], int, int]:
        """kvmesh.engine.tiered_prefix.match_and_allocate over this cache's pool and tier: pages
        whose leading ones hold the longest cached run of `hashes`, how many hold it, and how many
        of those were loaded from the tier."""
        # the runner's page_buffer is looked up only on a tier hit (runners without pages have none)
        return match_and_allocate(
            self.pool, self.tier, hashes, num_pages, error, lambda page_id: self.runner.page_buffer(page_id)
        )

    def _spill(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """The pool evicted these blocks: their pages go to the second tier before reuse."""
        assert self.tier is not None
        spill_to_tier(self.tier, evicted, lambda page_id: self.runner.page_buffer(page_id))

    def snapshot(self) -> list[BlockStored]:
        """What this cache holds now, one BlockStored a medium (the index's resync)."""
        stored = [BlockStored(tuple(sorted(self.pool.cached_hashes())))]
        if self.tier is not None:
            stored.append(BlockStored(tuple(self.tier.cached_hashes()), self.tier.medium))
        return stored

    def _require_slot(self, error: type[Exception]) -> None:
        if self.slots.num_slots and not self.slots.num_free:
            raise error(f"all {self.slots.num_slots} state slots are in use; retry later")

    def cache_prompt(self, request: Request) -> None:
        """Prefill, after the compute: the prompt's full blocks join the prefix cache (KV events)."""
        hashes = request.block_hashes or ()
        self.pool.cache_blocks(request.block_ids[: len(hashes)], hashes)

    def cache_sequence(self, request: Request) -> int:
        """Decode, once a request finished: its full blocks whose KV it wrote or received (the
        prompt's, then the answer's but for its last token, which has no KV) join the prefix
        cache under the prompt's block hashes (`request.block_hashes`, from Reserve) chained on
        over the answer's tokens. Returns the blocks offered (0 without prompt hashes: the
        answer's blocks need the prompt's last hash to chain from)."""
        hashes = list(request.block_hashes or ())
        if not hashes or not self.pool.enable_prefix_caching:
            return 0
        size = self.page_size
        with_kv = request.token_ids[: request.num_computed_tokens]
        num_full = min(len(with_kv) // size, len(request.block_ids))
        if num_full > len(hashes):
            hashes += hash_blocks(with_kv[len(hashes) * size : num_full * size], size, hashes[-1])
        self.pool.cache_blocks(request.block_ids[:num_full], hashes[:num_full])
        return num_full

    def hold_blocks(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """A peer pulls these blocks: reference the leading run of them the pool holds (so no
        eviction reuses their pages while they are pushed) and return its page ids; give them
        back with release_blocks."""
        block_ids = list(self.pool.match_prefix(block_hashes).block_ids)
        self.num_block_holds += bool(block_ids)
        return block_ids

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop hold_blocks' references."""
        if block_ids:
            self.pool.free(block_ids)
            self.num_block_holds -= 1

    def mark_cached(self, request: Request, num_blocks: int) -> None:
        """The request's first num_blocks pages now hold its prompt's KV (pulled from a peer):
        they count as cached, join the prefix cache, and a state slot resumes from their end."""
        size = self.page_size
        start = request.num_cached_tokens // size
        hashes = request.block_hashes or ()
        self.pool.cache_blocks(request.block_ids[start:num_blocks], hashes[start:num_blocks])
        request.num_cached_tokens = request.num_computed_tokens = num_blocks * size
        if request.state_slot is not None and num_blocks:
            self.runner.resume_state_slot(request.state_slot, request.block_ids[num_blocks - 1])

    def free(self, block_ids: Sequence[int], state_slot: int | None) -> None:
        """Drop one request's pages (full cached blocks stay cached, evictable) and its slot."""
        self.pool.free(block_ids)
        self.slots.free(state_slot)
        self.num_holders -= 1

    def fits_ever(self, num_tokens: int) -> bool:
        """The pool, empty, would hold num_tokens tokens."""
        return self.num_pages_for(num_tokens) <= self.pool.num_blocks

    def fits_later(self) -> bool:
        """Requests in flight hold pages or slots that their release will give back."""
        return self.pool.num_referenced_blocks > 0 or self.slots.num_used > len(self.scratch_slots)

    # --- figures and checks -------------------------------------------------------

    def integrity_error(self) -> str:
        """'' when check_integrity() passes, else its message (for GetStats)."""
        try:
            self.check_integrity()
        except AssertionError as exc:
            return str(exc) or "check_integrity failed"
        return ""

    def check_integrity(self) -> None:
        """Assert the pool's invariants, and that pages and slots are held only by requests:
        one slot a holder (besides the scratch slots), no page referenced when none holds any."""
        self.pool.check_integrity()
        held = self.slots.num_used - len(self.scratch_slots)
        if self.slots.num_slots:
            assert held == self.num_holders, f"{held} state slots held, {self.num_holders} requests hold pages"
        assert self.num_holders or self.num_block_holds or not self.pool.num_referenced_blocks, (
            f"{self.pool.num_referenced_blocks} pages referenced by no request"
        )

    def stats(self, check: bool = True) -> dict[str, int | str]:
        """The page figures of GetStats; integrity_error is '' unchecked with check=False (a
        read from another thread while the owner works, which may be a step stale)."""
        return {
            "num_pages": self.pool.num_blocks,
            "num_free_pages": self.pool.num_free_blocks,
            "num_cached_pages": self.pool.num_cached_blocks,
            "num_referenced_pages": self.pool.num_referenced_blocks,
            "integrity_error": self.integrity_error() if check else "",
            **tier_figures(self.tier),
        }

    def bind_metrics(self, used, free, cached=None) -> None:
        """Read the page gauges (prometheus_client Gauges) from this cache at scrape time: pages
        referenced by requests, pages a request could get now (free or evictable), and pages
        holding a prefix-cache block."""
        used.set_function(lambda: self.pool.num_referenced_blocks)
        free.set_function(lambda: self.pool.num_free_blocks)
        if cached is not None:
            cached.set_function(lambda: self.pool.num_cached_blocks)
