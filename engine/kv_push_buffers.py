# P=pages, R=state slots
"""The buffers a KV push moves over a runner's pages: `KVPushBuffers`, the base of
kvmesh.engine.kv_cache.KVCacheManager that owns the push path (kvmesh.kvstore.staging: straight
into the pages, or staged through host buffers) and the staged landings of pushes in flight.

Prefill sends `outbound(...)`; decode lands a push in `inbound(key, ...)` and calls
`landed(key)` once it is complete. Not thread-safe, as the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.kvstore.staging import StagedLanding, choose_push_path, stage_out

if TYPE_CHECKING:
    from kvmesh.engine.forward import Runner


class KVPushBuffers:
    """The buffers KV pushes send from (prefill) and land in (decode), over `runner`'s memory.

    Args:
        runner: the model runner whose pages and state slots pushes move (its page_buffer,
            state_buffers, page_nbytes and page_layout.device).
        push_path: how KV pushes reach the pages (kvmesh.kvstore.staging: auto, direct, staged); the
            choice made, and why, are `push_path` and `push_path_reason`.

    Raises ValueError for a push path UCX cannot serve (direct without a CUDA transport).
    """

    def __init__(self, runner: Runner, push_path: str = "auto") -> None:
        self.runner = runner
        self.push_path, self.push_path_reason = choose_push_path(runner.page_layout.device, push_path)
        self._landings: dict[int, StagedLanding] = {}

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page, the unit a KV push moves."""
        return self.runner.page_nbytes

    def push_buffers(self, block_ids: Sequence[int], state_slot: int | None = None, with_state: bool = True) -> list:
        """The buffers a KV push sends (prefill) or lands in (decode), in order: each page's
        (page_nbytes bytes), then, with_state, the state slot's (DeepSeek-V4)."""
        buffers = [self.runner.page_buffer(b) for b in block_ids]
        return buffers + (self.runner.state_buffers(state_slot) if with_state else [])

    def outbound(self, block_ids: Sequence[int], state_slot: int | None = None, with_state: bool = True) -> list:
        """What a push sends for these pages (prefill): their buffers as push_buffers gives them,
        or on the `staged` path host copies of them, made before this returns."""
        buffers = self.push_buffers(block_ids, state_slot, with_state)
        return stage_out(buffers) if self.push_path == "staged" else buffers

    def inbound(self, key: int, block_ids: Sequence[int], state_slot: int | None = None) -> list:
        """What a push for transfer `key` lands in (decode): the pages' buffers, or on the
        `staged` path host buffers (the same ones on every call) that `landed(key)` copies into
        the pages once the push is complete."""
        buffers = self.push_buffers(block_ids, state_slot)
        if self.push_path != "staged":
            return buffers
        if key not in self._landings:
            self._landings[key] = StagedLanding(buffers)
        return self._landings[key].host

    def landed(self, key: int) -> None:
        """The push for `key` is complete: on the `staged` path, copy its host buffers into the
        pages (and drop them); otherwise the bytes are in place already."""
        landing = self._landings.pop(key, None)
        if landing is not None:
            landing.land()

    def forget_landing(self, key: int) -> None:
        """Drop `key`'s host buffers (the request ended before or after its push landed)."""
        self._landings.pop(key, None)
