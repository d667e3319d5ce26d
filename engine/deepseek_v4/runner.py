# P=pages, R=state slots, V=vocab, B=sequences
"""The model step for DeepSeek-V4 checkpoints: the `Runner` protocol (engine/forward.py) over V4's paged state.

Pages hold each token's sliding-window K=V and each window's compressed entries, indexer keys
and (at a page's end) the CSA overlap (engine/deepseek_v4/state.py); a request also
holds one state slot for its open windows. The KV push sends a request's pages and then its
slot buffer, so decode continues exactly where prefill stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvmesh.engine.checkpoint import ModelFiles, load_checkpoint_tensors
from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
from kvmesh.engine.deepseek_v4.mtp import DeepseekV4MTP
from kvmesh.engine.deepseek_v4.state import V4StateLayout
from kvmesh.engine.deepseek_v4.weights import has_mtp
from kvmesh.engine.forward import DraftItem, ForwardItem
from kvmesh.engine.kv_layout import flat_layout
from kvmesh.engine.loader import load_config
from kvmesh.engine.loader import load_deepseek_v4_config as load_v4_config
from kvmesh.kernels.backend import KernelBackend

logger = logging.getLogger(__name__)


class DeepseekV4Runner:
    """Weights, pages [P, page_floats] and slots [R, slot_floats] (fp32), and the batched step.

    `page_nbytes` is one page's bytes; `state_buffers(slot)` the slot's buffer for the push.
    """

    def __init__(
        self,
        files: ModelFiles,
        num_pages: int,
        page_size: int = 16,
        num_state_slots: int = 64,
        kernels: KernelBackend | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Weights (the checkpoint's dtype), pages and slots (fp32) on `device`.

        Raises ValueError for a bad config or checkpoint (naming the field or tensor), a
        page_size that is not a multiple of every compress rate, or num_pages / slots < 1."""
        self.device = torch.device(device)
        self.dtype = torch.float32  # its pages and state rows are fp32 (kvmesh.engine.runners.DTYPES)
        if num_pages < 1 or num_state_slots < 1:
            raise ValueError(f"num_pages and num_state_slots must be >= 1, got {num_pages} and {num_state_slots}")
        start = time.monotonic()
        self.hf_config = load_v4_config(files.checkpoint_dir, files.name)
        self.config = load_config(files)
        tensors = load_checkpoint_tensors(files.checkpoint_dir)
        self.has_mtp = has_mtp(tensors)
        """The checkpoint carries the multi-token-prediction module (`--speculative mtp`)."""
        self.layout = V4StateLayout.from_config(self.hf_config, page_size, mtp=self.has_mtp)
        self.model = DeepseekV4Model(self.hf_config, tensors, self.layout, files.name, kernels, device=self.device)
        del tensors
        self._mtp: DeepseekV4MTP | None = None  # built on first use: only decode drafts
        self.draft_window = self.hf_config.sliding_window
        """Positions the MTP module's sliding-window attention looks back over."""
        self.page_size, self.num_pages, self.num_state_slots = page_size, num_pages, num_state_slots
        # pages, then slots, in one shared-memory region (kvmesh.engine.kv_layout.DEEPSEEK_V4_PAGE)
        self.page_layout = flat_layout(self.layout.page_floats, self.layout.slot_floats, str(self.device))
        self.memory = self.page_layout.allocate(num_pages, num_state_slots)
        self.pages, self.slots = self.memory.pages, self.memory.slots  # [P, page_floats], [R, slot_floats]
        self.page_nbytes, self.state_nbytes = self.page_layout.page_nbytes, self.page_layout.slot_nbytes
        logger.info(
            "loaded %s (DeepSeek-V4) in %.1f s on %s: %d pages x %d tokens, %d bytes a page, %d slots of %d bytes",
            files.name,
            time.monotonic() - start,
            self.device,
            num_pages,
            page_size,
            self.page_nbytes,
            num_state_slots,
            self.state_nbytes,
        )

    def expert_token_counts(self) -> np.ndarray:
        """[L, E] int64 tokens routed to each expert of each layer since load (a copy)."""
        return self.model.expert_counts.cpu().numpy().copy()

    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
        """Zero-copy writable uint8 view of page `page_id` (ValueError when out of range)."""
        return self.memory.page_buffer(page_id)

    def state_buffers(self, slot: int | None) -> list[np.ndarray | torch.Tensor]:
        """The buffers a push sends after the pages: the slot's row (ValueError when out of range)."""
        return self.memory.state_buffers(slot)

    def resume_state_slot(self, slot: int, last_cached_page: int) -> None:
        """A prefix-cache hit: start `slot` from the end of the last cached page."""
        self.layout.restore_slot(self.pages, last_cached_page, self.slots, slot)

    def copy_state_slot(self, src: int, dst: int) -> None:
        """Slot `dst` becomes a copy of slot `src` (ValueError when either is out of range)."""
        for s in (src, dst):
            if not 0 <= s < self.num_state_slots:
                raise ValueError(f"state slot must be in [0, {self.num_state_slots}), got {s}")
        self.slots[dst].copy_(self.slots[src])

    def last_hidden(self) -> torch.Tensor:
        """[B, N, H] fp32 the hyper-connection streams after each item's last token in the last
        forward (shares storage with the model's: copy what must outlive the next forward)."""
        return self.model.last_streams

    def slot_hidden(self, slot: int) -> torch.Tensor:
        """[N, H] a copy of the streams the slot's last forward ended on (the push carries them
        from prefill); ValueError without an MTP module or for a slot out of range."""
        if not self.has_mtp or not 0 <= slot < self.num_state_slots:
            raise ValueError(f"slot_hidden needs an MTP checkpoint and a slot in [0, {self.num_state_slots})")
        return self.layout.slot_view(self.slots, slot, "hidden", -1).clone()

    def propose_drafts(self, items: Sequence[DraftItem]) -> list[list[int]]:
        """Drafts from the checkpoint's MTP module (kvmesh.engine.deepseek_v4.mtp): items[b].k
        tokens for each item. Raises ValueError without an MTP module or for a bad item."""
        if not self.has_mtp:
            raise ValueError(f"{self.config.name!r} has no multi-token-prediction module (mtp.* tensors)")
        if self._mtp is None:
            self._mtp = DeepseekV4MTP(self.model, self.num_pages)
        return self._mtp.propose(items)

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One step over the batch; returns fp32 logits [B, V]. Every item needs a state_slot.

        Raises ValueError as `check_items` does.
        """
        check_items(items, self.config, self.page_size, self.num_state_slots)
        return self.model.forward(items, self.pages, self.slots)

    def warmup(self) -> None:
        """A tiny prefill and decode on page 0 and slot 0 (left as garbage, written before read)."""
        logger.info("warmup took %.2f s", warm_up(self.forward, self.page_size, self.config.bos_token_id))


def warm_up(
    forward: Callable[[Sequence[ForwardItem]], torch.Tensor], page_size: int, bos_token_id: int | None
) -> float:
    """A V4 runner's warm-up through `forward` (this runner's, or the expert-parallel one's): a
    tiny prefill and a decode step on page 0 and state slot 0, which stay garbage until a
    request writes them. Returns the seconds it took."""
    start = time.monotonic()
    tok = bos_token_id or 0
    n = min(page_size - 1, 5)
    forward([ForwardItem([tok] * n, 0, [0], 0)])
    forward([ForwardItem([tok], n, [0], 0)])
    return time.monotonic() - start


def check_items(items: Sequence[ForwardItem], config, page_size: int, num_state_slots: int) -> None:
    """A V4 forward's checks of its batch (this runner's, and the expert-parallel one's before
    any rank hears of it). Raises ValueError for an empty batch, or naming the first item with
    a missing or out-of-range state slot (or state_from), positions past
    max_position_embeddings, token ids outside the vocabulary, no new tokens or too few pages."""
    if not items:
        raise ValueError("forward needs at least one item")
    for b, it in enumerate(items):
        n, nc = len(it.token_ids), it.num_computed_tokens
        if it.state_slot is None or not 0 <= it.state_slot < num_state_slots:
            raise ValueError(f"item {b}: DeepSeek-V4 needs a state slot in [0, {num_state_slots}), got {it.state_slot}")
        if it.state_from is not None and not 0 <= it.state_from < num_state_slots:
            raise ValueError(f"item {b}: state_from must be in [0, {num_state_slots}), got {it.state_from}")
        if nc + n > config.max_position_embeddings:
            raise ValueError(
                f"item {b}: {nc + n} tokens exceed max_position_embeddings ({config.max_position_embeddings})"
            )
        if any(not 0 <= t < config.vocab_size for t in it.token_ids):
            raise ValueError(f"item {b}: token ids must be in [0, {config.vocab_size})")
        if n < 1 or len(it.block_ids) * page_size < nc + n:
            raise ValueError(
                f"item {b}: needs >= 1 new token and pages for {nc + n} tokens, "
                f"got {n} new and {len(it.block_ids)} pages of {page_size}"
            )
