# P=pages, R=state slots, L=layers, S=page_size (tokens), K=kv heads, D=head_dim
"""The KV page layout of each architecture and the memory it lives in (the one place layouts are
defined; kernels and models take the tensors and name these):
- `LLAMA_PAGE` `[P, L, 2, S, K, D]`: page-major, so one page (every layer's K and V of S tokens)
  is one contiguous buffer, the unit a KV push sends (`llama_layout`).
- `DEEPSEEK_V4_PAGE` `[P, page_floats]` fp32 pages and `[R, slot_floats]` fp32 state slots, the
  fields inside each row as `kvmesh.engine.deepseek_v4.state.V4StateLayout` lays them out
  (`flat_layout`).
On the CPU pages (then slots) are allocated in one shared-memory region (kvmesh.kvstore.shared_memory),
which expert-parallel ranks map too; on a GPU (`--device cuda`) in one device allocation, which
the KV push reads and writes where it is (kvmesh.kvstore.staging). kvmesh.engine.kv_cache.KVCacheManager hands
requests these pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.kvstore.shared_memory import shared_zeros

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
    """Where pages and slots live: "cpu" (one shared-memory region, which expert-parallel ranks
    map too) or a GPU ("cuda:N", device memory the KV transport reads and writes in place)."""

    @property
    def page_nbytes(self) -> int:
        return math.prod(self.page_shape) * self.dtype.itemsize

    @property
    def slot_nbytes(self) -> int:
        return math.prod(self.slot_shape) * self.dtype.itemsize if self.slot_shape else 0

    def allocate(self, num_pages: int, num_slots: int = 0) -> KVMemory:
        """Zeroed pages [num_pages, *page_shape], then slots [num_slots, *slot_shape], in one
        region: shared memory on the CPU, one device allocation on a GPU. Raises ValueError for
        num_pages < 1; torch's OutOfMemoryError when the device lacks the bytes."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        page_numel, slot_numel = math.prod(self.page_shape), math.prod(self.slot_shape) if self.slot_shape else 0
        numel = num_pages * page_numel + num_slots * slot_numel
        if self.device == "cpu":
            flat, _ = shared_zeros((numel,), self.dtype)
        else:
            flat = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return self.split(flat, num_pages, num_slots)

    def describe(self) -> str:
        """The bytes of a page and a slot as a Reserve names them to the other side: name, page
        shape, slot shape, dtype, e.g. '[P, L, 2, S, K, D] (30, 2, 16, 3, 64) () float32'. Not the
        device: equal layouts move between a CPU and a GPU byte for byte."""
        return f"{self.name} {self.page_shape} {self.slot_shape} {str(self.dtype).removeprefix('torch.')}"

    def split(self, flat: torch.Tensor, num_pages: int, num_slots: int) -> KVMemory:
        """The pages and slots inside a flat buffer laid out as allocate() lays it (views)."""
        page_numel = math.prod(self.page_shape)
        pages = flat[: num_pages * page_numel].view(num_pages, *self.page_shape)
        slots = flat[num_pages * page_numel :].view(num_slots, *self.slot_shape) if self.slot_shape else flat[:0]
        return KVMemory(self, pages, slots)


def llama_layout(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"
) -> PageLayout:
    """LLAMA_PAGE: [P, L, 2, S, K, D] (K at index 0 of the third dim, V at 1), no state slots."""
    return PageLayout(LLAMA_PAGE, (num_layers, 2, page_size, num_kv_heads, head_dim), dtype, device=device)


def flat_layout(page_floats: int, slot_floats: int, device: str = "cpu") -> PageLayout:
    """DEEPSEEK_V4_PAGE: fp32 rows of page_floats a page and slot_floats a slot (the fields of
    each row: kvmesh.engine.deepseek_v4.state.V4StateLayout)."""
    return PageLayout(DEEPSEEK_V4_PAGE, (page_floats,), torch.float32, (slot_floats,), device)


@dataclass(frozen=True)
class KVMemory:
    """A runner's pages [P, *page_shape] and state slots [R, *slot_shape] (views of one region)."""

    layout: PageLayout
    pages: torch.Tensor
    slots: torch.Tensor

    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
        """Zero-copy writable 1-D uint8 view of one page (page_nbytes bytes): what a KV push
        sends and lands in. A numpy array on the CPU; on a GPU a uint8 device tensor, whose
        `__cuda_array_interface__` UCX reads and writes in place. Raises ValueError out of range."""
        if not 0 <= page_id < self.pages.shape[0]:
            raise ValueError(f"page_id must be in [0, {self.pages.shape[0]}), got {page_id}")
        return _bytes(self.pages[page_id])

    def state_buffers(self, slot: int | None) -> list[np.ndarray | torch.Tensor]:
        """The buffers a push sends after the pages: the slot's row ([] for a layout without
        slots), as page_buffer gives pages. Raises ValueError for a slot out of range (None
        included) when there are slots."""
        if not self.layout.slot_shape:
            return []
        if slot is None or not 0 <= slot < self.slots.shape[0]:
            raise ValueError(f"state slot must be in [0, {self.slots.shape[0]}), got {slot}")
        return [_bytes(self.slots[slot])]


def _bytes(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A contiguous tensor's bytes, 1-D uint8: a numpy view on the CPU, a tensor view elsewhere."""
    flat = t.view(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat
