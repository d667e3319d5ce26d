# S=page_size (tokens), D=head_dim, Di=index_head_dim, r=compress rate of a layer, P=pages,
# R=state slots (one per running request)
"""Where DeepSeek-V4 keeps a request's attention state: pages plus one small per-request slot.

Every layer attends to a sliding window of K=V entries, and CSA / HCA layers also to
compressed entries (one per `r` source tokens). transformers keeps these as growing tensors per
layer (`DeepseekV4HCACache`, `DeepseekV4CSACache`); kvmesh lays them out so that prefill can
push them into decode's reserved buffers with one scatter-gather send and the prefix cache can
share them by block hash:

Page (S tokens of one sequence, S a multiple of every compress rate; one contiguous fp32 row):
    per layer l, in layer order:
      swa      [S, D]      K=V of each token (post-norm, post-RoPE), every layer
      entries  [S/r, D]    compressed entries of the page's windows (CSA and HCA layers)
      ikeys    [S/4, Di]   Lightning Indexer keys of those windows (CSA layers)
      ov_kv, ov_gate [r, D]; iov_kv, iov_gate [r, Di]
                           the overlap state at the page's end (CSA layers): the last window's
                           Ca half, gate with position bias added, as
                           `DeepseekV4CSACache.update_overlap_state` keeps it
Slot (one per running request; one contiguous fp32 row), per CSA / HCA layer:
      buf_kv, buf_gate [r, W]      projections of the tokens of the window still open (fewer
                                   than r; W = 2D for CSA, D for HCA), gate without bias
      ov_kv, ov_gate   [r, D]      overlap state after the last closed window (CSA)
      ibuf_kv, ibuf_gate [r, 2Di]; iov_kv, iov_gate [r, Di]   the same for the indexer (CSA)

With a multi-token-prediction module (checkpoints with mtp.* tensors) the slot also holds
      hidden [N, H]             the hyper-connection streams after the last computed token (what
                                the model's head reads), which the MTP drafter takes as its input;
                                the push carries it, so decode drafts from its first step

Speculative verification runs k + 1 rows of one sequence in one step. Row j continues row
j-1's slot state in a scratch slot of its own (`ForwardItem.state_from`), so after the target
accepts a of the k drafts, decode keeps row a's slot and the state is that of a run that only
saw the accepted tokens. Pages need no rollback: every page field is indexed by position (the
K=V of a token, the entry of a window, the overlap at a page end), so what rejected rows wrote
lies past the accepted length, is never read (attention reads the window up to its own
position and the entries of closed windows only) and is rewritten when that position or window
is computed for real, before any query reads it.

Entry counts are not stored: after n tokens a layer of rate r has n // r entries and n % r
buffered tokens. Because pages end on window boundaries, a cached page's entries and end
overlap are exactly what a run without the cache would hold there, so a prefix-cache hit needs
no replay: the new request's slot starts from the last cached page's end overlap (`restore_slot`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class _Field:
    offset: int
    rows: int
    width: int


@dataclass
class V4StateLayout:
    """Offsets (in fp32 elements) of every field of a page and of a slot.

    Raises ValueError when page_size is not a positive multiple of every compress rate.
    """

    layer_types: list[str]
    rates: list[int]  # per layer, 0 for sliding
    head_dim: int
    index_head_dim: int
    page_size: int
    mtp_hidden: tuple[int, int] | None = None
    """(N, H) of the slot's `hidden` field, for checkpoints with an MTP module; None: no field."""
    page: dict[tuple[str, int], _Field] = field(default_factory=dict)
    slot: dict[tuple[str, int], _Field] = field(default_factory=dict)
    page_floats: int = 0
    slot_floats: int = 0

    def __post_init__(self) -> None:
        S, D, Di = self.page_size, self.head_dim, self.index_head_dim
        for r in self.rates:
            if r and (S < r or S % r):
                raise ValueError(
                    f"page_size {S} must be a positive multiple of every compress rate "
                    f"{sorted(set(x for x in self.rates if x))}"
                )
        off = 0

        def add(table: dict, name: str, layer: int, rows: int, width: int) -> None:
            nonlocal off
            table[(name, layer)] = _Field(off, rows, width)
            off += rows * width

        for l, (kind, r) in enumerate(zip(self.layer_types, self.rates)):
            add(self.page, "swa", l, S, D)
            if kind != SLIDING:
                add(self.page, "entries", l, S // r, D)
            if kind == CSA:
                add(self.page, "ikeys", l, S // r, Di)
                for name, w in (("ov_kv", D), ("ov_gate", D), ("iov_kv", Di), ("iov_gate", Di)):
                    add(self.page, name, l, r, w)
        self.page_floats = off
        off = 0
        for l, (kind, r) in enumerate(zip(self.layer_types, self.rates)):
            if kind == HCA:
                add(self.slot, "buf_kv", l, r, D)
                add(self.slot, "buf_gate", l, r, D)
            elif kind == CSA:
                for name, w in (
                    ("buf_kv", 2 * D),
                    ("buf_gate", 2 * D),
                    ("ov_kv", D),
                    ("ov_gate", D),
                    ("ibuf_kv", 2 * Di),
                    ("ibuf_gate", 2 * Di),
                    ("iov_kv", Di),
                    ("iov_gate", Di),
                ):
                    add(self.slot, name, l, r, w)
        if self.mtp_hidden is not None:
            add(self.slot, "hidden", -1, *self.mtp_hidden)
        self.slot_floats = max(off, 1)

    @classmethod
    def from_config(cls, config, page_size: int, mtp: bool = False) -> V4StateLayout:
        """Layout for a transformers `DeepseekV4Config` and a page size in tokens; `mtp` adds
        the slot's `hidden` field (a checkpoint with an MTP module)."""
        rates = [0 if t == SLIDING else config.compress_rates[t] for t in config.layer_types]
        hidden = (config.hc_mult, config.hidden_size) if mtp else None
        return cls(list(config.layer_types), rates, config.head_dim, config.index_head_dim, page_size, hidden)

    @staticmethod
    def default_page_size(config, at_least: int = 16) -> int:
        """Smallest multiple of every compress rate that is >= at_least tokens."""
        rates = [config.compress_rates[t] for t in config.layer_types if t != SLIDING] or [1]
        lcm = math.lcm(*rates)
        return lcm * max(1, -(-at_least // lcm))

    def page_view(self, pages: torch.Tensor, name: str, layer: int) -> torch.Tensor:
        """pages [P, page_floats] -> the field's view [P, rows, width] (shares storage)."""
        f = self.page[(name, layer)]
        return pages[:, f.offset : f.offset + f.rows * f.width].view(-1, f.rows, f.width)

    def slot_view(self, slots: torch.Tensor, slot: int, name: str, layer: int) -> torch.Tensor:
        """slots [R, slot_floats] -> one slot's field [rows, width] (shares storage)."""
        f = self.slot[(name, layer)]
        return slots[slot, f.offset : f.offset + f.rows * f.width].view(f.rows, f.width)

    def restore_slot(self, pages: torch.Tensor, last_page: int, slots: torch.Tensor, slot: int) -> None:
        """Start `slot` as it stood at the end of page `last_page` (a prefix-cache hit).

        The open windows are empty there; the CSA overlap comes from the page's end overlap.
        """
        for (name, layer), _ in self.page.items():
            if name in ("ov_kv", "ov_gate", "iov_kv", "iov_gate"):
                self.slot_view(slots, slot, name, layer).copy_(self.page_view(pages, name, layer)[last_page])

    def bytes_per_token(self, dtype_bytes: int = 4) -> float:
        """Average state bytes a token occupies in pages (the per-request slot excluded)."""
        return self.page_floats * dtype_bytes / self.page_size
