# P=pages, R=state slots, L=layers, S=page_size (tokens), K=kv heads, D=head_dim
"""The KV cache both roles share: the page layout of each architecture, the memory it lives in,
and `KVCacheManager`, which hands a request its pages and state slot (vLLM v1's KVCacheManager).

Layouts (the one place they are defined; kernels and models take the tensors and name these):
- `LLAMA_PAGE` `[P, L, 2, S, K, D]`: page-major, so one page (every layer's K and V of S tokens)
  is one contiguous buffer, the unit a KV push sends (`llama_layout`).
- `DEEPSEEK_V4_PAGE` `[P, page_floats]` fp32 pages and `[R, slot_floats]` fp32 state slots, the
  fields inside each row as `engine.models.deepseek_v4_state.V4StateLayout` lays them out
  (`flat_layout`).
Pages (then slots) are allocated in one shared-memory region (kvstore.shared_memory), so a
decode process on the same host can pull a request's pages with one copy, and expert-parallel
ranks map the same memory.

`KVCacheManager` wraps kvstore.block_pool.BlockPool (page ids, reference counts, the prefix
cache and its KV events) and the state slots; both engines go through it, and it owns the
figures GetStats reports, the page gauges and check_integrity(). Not thread-safe: each engine
calls it under its lock or on its one worker thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.request import Request
from kvstore.block_hash import hash_blocks
from kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvstore.shared_memory import shared_zeros

if TYPE_CHECKING:
    from engine.forward import Runner
    from kvstore.kv_events import KVEvent

LLAMA_PAGE = "[P, L, 2, S, K, D]"
DEEPSEEK_V4_PAGE = "[P, page_floats] + [R, slot_floats]"


@dataclass(frozen=True)
class PageLayout:
    """How one architecture's KV sits in memory: one page's shape, one state slot's, the dtype
    and the device. A page is a contiguous buffer of page_nbytes bytes, a slot of slot_nbytes."""

    name: str
    """The layout's name (LLAMA_PAGE, DEEPSEEK_V4_PAGE), for logs and docstrings."""
    page_shape: tuple[int, ...]
    """One page's shape (the pages tensor is [P, *page_shape])."""
    dtype: torch.dtype
    slot_shape: tuple[int, ...] = ()
    """One state slot's shape; () for architectures whose pages hold all of a request's state."""
    device: str = "cpu"
    """Where pages and slots live (CPU only for now: the transport reads shared memory)."""

    @property
    def page_nbytes(self) -> int:
        return math.prod(self.page_shape) * self.dtype.itemsize

    @property
    def slot_nbytes(self) -> int:
        return math.prod(self.slot_shape) * self.dtype.itemsize if self.slot_shape else 0

    def allocate(self, num_pages: int, num_slots: int = 0) -> KVMemory:
        """Zeroed pages [num_pages, *page_shape], then slots [num_slots, *slot_shape], in one
        shared-memory region. Raises ValueError for num_pages < 1 or a device other than cpu."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if self.device != "cpu":
            raise ValueError(f"KV pages live on the CPU for now, not {self.device!r}")
        page_numel, slot_numel = math.prod(self.page_shape), math.prod(self.slot_shape) if self.slot_shape else 0
        flat, _ = shared_zeros((num_pages * page_numel + num_slots * slot_numel,), self.dtype)
        return self.split(flat, num_pages, num_slots)

    def split(self, flat: torch.Tensor, num_pages: int, num_slots: int) -> KVMemory:
        """The pages and slots inside a flat buffer laid out as allocate() lays it (views)."""
        page_numel = math.prod(self.page_shape)
        pages = flat[: num_pages * page_numel].view(num_pages, *self.page_shape)
        slots = flat[num_pages * page_numel :].view(num_slots, *self.slot_shape) if self.slot_shape else flat[:0]
        return KVMemory(self, pages, slots)


def llama_layout(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> PageLayout:
    """LLAMA_PAGE: [P, L, 2, S, K, D] (K at index 0 of the third dim, V at 1), no state slots."""
    return PageLayout(LLAMA_PAGE, (num_layers, 2, page_size, num_kv_heads, head_dim), dtype)


def flat_layout(page_floats: int, slot_floats: int) -> PageLayout:
    """DEEPSEEK_V4_PAGE: fp32 rows of page_floats a page and slot_floats a slot (the fields of
    each row: engine.models.deepseek_v4_state.V4StateLayout)."""
    return PageLayout(DEEPSEEK_V4_PAGE, (page_floats,), torch.float32, (slot_floats,))


@dataclass(frozen=True)
class KVMemory:
    """A runner's pages [P, *page_shape] and state slots [R, *slot_shape] (views of one region)."""

    layout: PageLayout
    pages: torch.Tensor
    slots: torch.Tensor

    def page_buffer(self, page_id: int) -> np.ndarray:
        """Zero-copy writable 1-D uint8 view of one page (page_nbytes bytes): what a KV push
        sends and lands in. Raises ValueError out of range."""
        if not 0 <= page_id < self.pages.shape[0]:
            raise ValueError(f"page_id must be in [0, {self.pages.shape[0]}), got {page_id}")
        return self.pages[page_id].view(-1).view(torch.uint8).numpy()

    def state_buffers(self, slot: int | None) -> list[np.ndarray]:
        """The buffers a push sends after the pages: the slot's row ([] for a layout without
        slots). Raises ValueError for a slot out of range (None included) when there are slots."""
        if not self.layout.slot_shape:
            return []
        if slot is None or not 0 <= slot < self.slots.shape[0]:
            raise ValueError(f"state slot must be in [0, {self.slots.shape[0]}), got {slot}")
        return [self.slots[slot].view(-1).view(torch.uint8).numpy()]


class StateSlots:
    """Free list of a runner's state slots; `allocate()` gives None for runners without slots."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int | None:
        """A free slot id (None when the runner has none); RuntimeError when all are taken."""
        if not self.num_slots:
            return None
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use; retry later")
        return self._free.pop()

    def free(self, slot: int | None) -> None:
        """Return `slot` to the free list (None, from a runner without slots, is ignored)."""
        if slot is not None:
            assert slot not in self._free, f"state slot {slot} freed twice"
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free) if self.num_slots else 1 << 30

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)


class KVCacheManager:
    """A runner's pages and state slots as requests hold them.

    Args:
        runner: the model runner whose memory this manages (its page_buffer, state_buffers,
            resume_state_slot, num_state_slots).
        num_pages, page_size: the pool's pages and tokens a page.
        enable_prefix_caching: prefill keeps full prompt blocks cached by block hash (KV events
            go to on_events); decode runs without.
        on_events: called with each batch of KV events, in order (prefill publishes them).
    """

    def __init__(
        self,
        runner: Runner,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = False,
        on_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        self.runner = runner
        self.page_size = page_size
        self.pool = BlockPool(num_pages, page_size, enable_prefix_caching=enable_prefix_caching, on_events=on_events)
        self.slots = StateSlots(runner.num_state_slots)
        self.scratch_slots: list[int] = []
        """Slots held for good (decode's speculative verification rows), not by a request."""
        self.num_holders = 0
        """Requests holding pages (and a slot) now: allocated and not freed."""

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page, the unit a KV push moves."""
        return self.runner.page_nbytes

    def num_pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def hold_scratch_slots(self, n: int) -> list[int]:
        """Set `n` state slots aside for good ([] for a runner without slots)."""
        self.scratch_slots = [s for s in (self.slots.allocate() for _ in range(n)) if s is not None]
        return self.scratch_slots

    # --- allocation -------------------------------------------------------------

    def allocate(self, request: Request, num_tokens: int, error: type[Exception] = NoFreeBlocksError) -> None:
        """Give `request` pages for num_tokens tokens and a state slot (decode: no prefix), all
        or nothing. Raises `error` (the caller's capacity error) when pages or slots are short."""
        num_pages = self.num_pages_for(num_tokens)
        if num_pages > self.pool.num_free_blocks:
            raise error(
                f"request needs {num_pages} KV pages, {self.pool.num_free_blocks} of "
                f"{self.pool.num_blocks} are free; lower max_tokens or retry later"
            )
        self._require_slot(error)
        request.block_ids = list(self.pool.allocate(num_pages).block_ids)
        request.state_slot = self.slots.allocate()
        request.num_prompt_pages = self.num_pages_for(request.num_prompt_tokens)
        self.num_holders += 1

    def allocate_prompt(self, request: Request) -> None:
        """Prefill: reuse the longest cached prefix of the prompt's blocks and allocate pages for
        the rest, plus a state slot (resumed from the cached prefix's end). Sets block_ids,
        num_cached_tokens, num_computed_tokens (= cached), state_slot, block_hashes.
        Raises NoFreeBlocksError when pages or slots are short; nothing is held then."""
        self._require_slot(NoFreeBlocksError)
        tokens, size = request.prompt_token_ids, self.page_size
        if request.block_hashes is None:
            request.block_hashes = hash_blocks(tokens, size)
        # recompute at least the last prompt token so its logits exist
        match = self.pool.match_prefix(request.block_hashes[: (len(tokens) - 1) // size])
        try:
            new = self.pool.allocate(self.num_pages_for(len(tokens)) - len(match.block_ids))
        except Exception:
            self.pool.free(match.block_ids)
            raise
        request.block_ids = [*match.block_ids, *new.block_ids]
        request.num_prompt_pages = len(request.block_ids)
        request.num_cached_tokens = request.num_computed_tokens = match.num_cached_tokens
        request.state_slot = self.slots.allocate()
        self.num_holders += 1
        if request.state_slot is not None and match.block_ids:  # continue from the end of the cached prefix
            self.runner.resume_state_slot(request.state_slot, match.block_ids[-1])

    def _require_slot(self, error: type[Exception]) -> None:
        if self.slots.num_slots and not self.slots.num_free:
            raise error(f"all {self.slots.num_slots} state slots are in use; retry later")

    def cache_prompt(self, request: Request) -> None:
        """Prefill, after the compute: the prompt's full blocks join the prefix cache (KV events)."""
        hashes = request.block_hashes or ()
        self.pool.cache_blocks(request.block_ids[: len(hashes)], hashes)

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

    # --- the transport's buffers --------------------------------------------------

    def push_buffers(self, block_ids: Sequence[int], state_slot: int | None = None, with_state: bool = True) -> list:
        """The buffers a KV push sends (prefill) or lands in (decode), in order: each page's
        (page_nbytes bytes), then, with_state, the state slot's (DeepSeek-V4)."""
        buffers = [self.runner.page_buffer(b) for b in block_ids]
        return buffers + (self.runner.state_buffers(state_slot) if with_state else [])

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
        assert self.num_holders or not self.pool.num_referenced_blocks, (
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
        }

    def bind_metrics(self, used, free, cached=None) -> None:
        """Read the page gauges (prometheus_client Gauges) from this cache at scrape time: pages
        referenced by requests, pages a request could get now (free or evictable), and pages
        holding a prefix-cache block."""
        used.set_function(lambda: self.pool.num_referenced_blocks)
        free.set_function(lambda: self.pool.num_free_blocks)
        if cached is not None:
            cached.set_function(lambda: self.pool.num_cached_blocks)
