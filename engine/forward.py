# T=tokens, B=sequences, V=vocab
"""What every runner offers and takes: the `Runner` protocol and one `ForwardItem` type for every
architecture (the page layouts: engine/kv_layout.py; the state-slot free list:
engine/kv_cache.py). Runners live in `kvmesh.engine.llama.runner` and `kvmesh.engine.deepseek_v4.runner`;
`kvmesh.engine.runners` maps a checkpoint's architecture to one of them.

The protocol follows vLLM's model-runner split (the scheduler describes each sequence of a step;
the runner owns weights and KV memory): a step may mix prefill items (many new tokens, maybe
after a cached prefix) and decode items (one new token). `chunk_ends` is how chunked prefill
splits a prompt's computed range into forwards (the prefill service and `kvmesh.bench.prefill`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvmesh.engine.config import ModelConfig
    from kvmesh.engine.kv_layout import PageLayout


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's share of a model step."""

    token_ids: Sequence[int]
    """New tokens to compute, len >= 1; the logits returned are those after the last one."""
    num_computed_tokens: int
    """Tokens of this sequence already in its KV pages; the new tokens' positions start here."""
    block_ids: Sequence[int]
    """Page ids covering num_computed_tokens + len(token_ids) tokens, in order."""
    state_slot: int | None = None
    """The sequence's state slot, for models with per-request state beyond pages (DeepSeek-V4)."""
    state_from: int | None = None
    """Speculative verification (DeepSeek-V4): the slot this row's state continues from, the
    previous row's; the row leaves its state in `state_slot` (a scratch slot) and the others'
    untouched, so decode keeps the state after the last accepted row. None: `state_slot` itself."""


@dataclass(frozen=True)
class DraftItem:
    """One sequence's share of a drafting pass of a model's own draft module (DeepSeek-V4's MTP).

    The pending pairs are the positions first_position .. first_position + len(tokens) - 1 the
    target computed since the module last ran for this sequence: at each, the target's streams
    after that position's token (`hidden`) and the token that followed it (`tokens`).
    """

    first_position: int
    tokens: Sequence[int]
    """The token after each pending position, len >= 1 (the last: the token the step verifies from)."""
    hidden: torch.Tensor
    """[len(tokens), N, H] fp32 the target's hyper-connection streams at each pending position."""
    block_ids: Sequence[int]
    """The sequence's pages (the module's K=V sits at the same positions)."""
    window_start: int
    """First position whose draft-module K=V is valid for this sequence (earlier ones are masked)."""
    k: int
    """Drafts wanted, >= 1."""


class Runner(Protocol):
    """A model's weights, its paged KV memory and the batched forward step."""

    config: ModelConfig
    """The shape and special tokens the services share."""
    page_size: int
    """Token slots per page."""
    num_pages: int
    """Pages in the KV memory; page ids are [0, num_pages)."""
    page_nbytes: int
    """Bytes of one page (every layer's KV of page_size tokens), the unit a KV push moves."""
    page_layout: PageLayout
    """How pages and slots sit in memory, and on which device (kvmesh.engine.kv_layout)."""
    num_state_slots: int
    """Per-request state slots beyond pages (0 when pages hold all of a request's state)."""
    dtype: torch.dtype
    """What the model computes in and its pages hold (`--dtype`, kvmesh.engine.precision); logits are fp32 whatever it is."""

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One step; fp32 logits [B, V], row b after the last new token of items[b]. Raises
        ValueError for an empty batch, bad token ids, too few pages or too long a sequence."""
        ...

    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
        """Zero-copy writable uint8 view of one page (page_nbytes bytes; kvmesh.engine.kv_layout.KVMemory
        defines it: numpy on the CPU, a device tensor on a GPU); ValueError out of range."""
        ...

    def state_buffers(self, slot: int | None) -> list[np.ndarray | torch.Tensor]:
        """The uint8 buffers a KV push sends after the pages (a slot's state; [] without slots)."""
        ...

    def resume_state_slot(self, slot: int, last_cached_page: int) -> None:
        """A prefix-cache hit: start `slot` from the end of the last cached page."""
        ...

    def copy_state_slot(self, src: int, dst: int) -> None:
        """Make slot `dst` a copy of slot `src` (speculative verification keeps the state of the
        last accepted row); ValueError for a slot out of range or a runner without slots."""
        ...

    def expert_token_counts(self) -> np.ndarray | None:
        """[L, E] int64 tokens routed to each expert of each MoE layer since load (a copy);
        None for a dense model."""
        ...

    def warmup(self) -> None:
        """Run a tiny step so the first request pays no one-time costs (page 0 left garbage)."""
        ...


class DraftingRunner(Runner, Protocol):
    """A runner whose checkpoint carries its own draft module (DeepSeek-V4's MTP)."""

    has_mtp: bool
    draft_window: int
    """Positions the draft module's attention looks back over (its sliding window), tokens."""

    def last_hidden(self) -> torch.Tensor:
        """[B, N, H] fp32 streams after each item's last token in the last forward (overwritten by the next)."""
        ...

    def slot_hidden(self, slot: int) -> torch.Tensor:
        """[N, H] a copy of the streams the slot's last forward ended on."""
        ...

    def propose_drafts(self, items: Sequence[DraftItem]) -> list[list[int]]:
        """items[b].k draft tokens for each item."""
        ...


def chunk_ends(start: int, end: int, chunk_tokens: int, page_size: int, short_last: bool = True) -> list[int]:
    """Where each chunk of a prompt's computed range [start, end) ends (token positions).

    Chunks are `chunk_tokens` long (rounded down to whole pages, at least one page). With
    `short_last`, the last is at most a quarter of a chunk (whole pages, at least one): a
    chunk's pages are pushed while the next one computes, so only the last chunk's push is left
    in TTFT, for one forward more (`last_chunk_tokens`); without, the last is what is left.
    `start` must be page-aligned (a cached prefix is whole pages); every end but the last is
    too. chunk_tokens <= 0, or a range no longer than one chunk: [end].

    >>> chunk_ends(0, 2048, 512, 16)
    [512, 1024, 1536, 1920, 2048]
    >>> chunk_ends(0, 2048, 512, 16, short_last=False)
    [512, 1024, 1536, 2048]
    """
    if chunk_tokens <= 0 or end - start <= chunk_tokens:
        return [end]
    chunk = whole_pages(chunk_tokens, page_size)
    if not short_last:
        return [*range(start + chunk, end, chunk), end]
    tail = last_chunk_tokens(chunk, page_size)
    tail_start = (end - tail) // page_size * page_size
    ends = list(range(start + chunk, tail_start, chunk))
    if tail_start > start:
        ends.append(tail_start)
    ends.append(end)
    return ends


def last_chunk_tokens(chunk_tokens: int, page_size: int) -> int:
    """The short last chunk of `chunk_ends` (tokens): a quarter of a chunk, whole pages, at least one."""
    return whole_pages(chunk_tokens // 4, page_size)


def whole_pages(tokens: int, page_size: int) -> int:
    """`tokens` rounded down to whole pages of `page_size` tokens, at least one page."""
    return max(page_size, tokens // page_size * page_size)
