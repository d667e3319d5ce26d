# n=new tokens of one sequence, T=tokens (new, all sequences), H=hidden, D=head_dim,
# Di=indexer head dim, Wd=a compressor's projection width (2D or D; 2Di for the indexer),
# r=compress rate, w=windows closed by this step, d=an entry's width, P=pages, S=page_size
"""DeepSeek-V4's KV compressors over kvmesh's pages and slots (transformers'
`DeepseekV4CSACompressor`, `DeepseekV4HCACompressor` and the Lightning Indexer's own; paper
§2.3.1-2.3.2): every r tokens of a sequence pool, softmax-gated, into one compressed entry.

A sequence's open window (fewer than r tokens' projections) waits in its state slot; each
window that closes becomes an entry in the pages, normed and rotated at its first position. CSA
windows overlap: window w pools window w-1's Ca half with its own Cb half, so the last closed
window's Ca half (the overlap state) stays in the slot, and at a page's end in the page too, for
prefix-cache hits (engine/deepseek_v4/state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.deepseek_v4.ops import RopeTable, apply_rope, rms_norm
from kvmesh.engine.deepseek_v4.plan import ForwardPlan
from kvmesh.engine.deepseek_v4.state import CSA, V4StateLayout
from kvmesh.engine.forward import ForwardItem
from kvmesh.kernels.ops import to_device


@dataclass(frozen=True)
class Series:
    """One compressor of a layer: its weights' prefix and the layout fields it keeps."""

    prefix: str
    """Its weights' names under the layer's `self_attn.` (`compressor.`, `compressor.indexer.`)."""
    overlap: bool
    """CSA's overlapping windows (HCA's do not overlap)."""
    entries: str
    """The page field its entries go to."""
    buf_kv: str
    buf_gate: str
    """The slot fields of the open window: its tokens' kv and gate projections."""
    ov_kv: str
    ov_gate: str
    """The overlap state's fields, in the slot and at a page's end (CSA)."""


HCA_MAIN = Series("compressor.", False, "entries", "buf_kv", "buf_gate", "ov_kv", "ov_gate")
CSA_MAIN = Series("compressor.", True, "entries", "buf_kv", "buf_gate", "ov_kv", "ov_gate")
INDEXER = Series("compressor.indexer.", True, "ikeys", "ibuf_kv", "ibuf_gate", "iov_kv", "iov_gate")


class Compressors:
    """Every layer's compressors: `extend` runs a layer's over one forward's new tokens."""

    def __init__(
        self, layout: V4StateLayout, w: dict[str, torch.Tensor], rope: RopeTable, eps: float, device: torch.device
    ) -> None:
        """rope: the "compress" rope table (entries rotate at their window's first position)."""
        self.layout, self.w, self.rope, self.eps, self.device = layout, w, rope, eps, device

    def extend(self, i: int, x: torch.Tensor, plan: ForwardPlan, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """Run layer i's compressors (CSA: its own and the indexer's; HCA: its own) over every
        sequence's new tokens x [T, H] (the attention input): their kv_proj and gate_proj for
        the whole batch at once, then each sequence's windows in turn."""
        p = f"model.layers.{i}.self_attn."
        series = (CSA_MAIN, INDEXER) if self.layout.layer_types[i] == CSA else (HCA_MAIN,)
        projected = [
            (
                s,
                F.linear(x, self.w[p + s.prefix + "kv_proj.weight"]),
                F.linear(x, self.w[p + s.prefix + "gate_proj.weight"]),
            )
            for s in series
        ]  # kv [T, Wd], gate [T, Wd]
        for b, item in enumerate(plan.items):
            lo, hi = plan.starts[b], plan.starts[b + 1]
            for s, kv, gate in projected:
                self.compress(i, s, kv[lo:hi], gate[lo:hi], item, plan.tables[b], pages, slots)

    def compress(
        self,
        i: int,
        s: Series,
        kv: torch.Tensor,
        gate: torch.Tensor,
        item: ForwardItem,
        table: torch.Tensor,
        pages: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Run compressor s of layer i over one sequence's new tokens' projections kv, gate
        [n, Wd]: extend the open window in the slot, emit an entry per closed window into the
        pages, keep the CSA overlap state. table is the item's block table (int64 page ids)."""
        slot = item.state_slot
        assert slot is not None, "the runner checked every item's state slot"
        if item.state_from is not None and item.state_from != slot:
            self._continue_state(i, s, item.state_from, slot, slots)
        windows = self._close_windows(i, s, kv, gate, item.num_computed_tokens, slot, slots)
        if windows is None:
            return
        ck, cg = windows
        e0 = item.num_computed_tokens // self.layout.rates[i]  # the first window this step closes
        if s.overlap:
            pooled = self._pool_overlapping(i, s, ck, cg, e0, slot, slots)
        else:
            pooled = (ck * cg.softmax(dim=1)).sum(dim=1)
        self._store(i, s, pooled, ck, cg, e0, table, pages)

    def _continue_state(self, i: int, s: Series, src: int, slot: int, slots: torch.Tensor) -> None:
        # a verification row continues the previous row's state in a slot of its own, so
        # the rows after the last accepted one leave the sequence's state as they found it
        lay = self.layout
        for name in (s.buf_kv, s.buf_gate, s.ov_kv, s.ov_gate) if s.overlap else (s.buf_kv, s.buf_gate):
            lay.slot_view(slots, slot, name, i).copy_(lay.slot_view(slots, src, name, i))

    def _close_windows(
        self, i: int, s: Series, kv: torch.Tensor, gate: torch.Tensor, nc: int, slot: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The open window's tokens then the new ones: those of the windows that close, as kv
        [w, r, Wd] and gate [w, r, Wd] (position bias added), or None when none closes; the
        rest stays open in the slot. nc: tokens the sequence had before this step."""
        lay, r = self.layout, self.layout.rates[i]
        nb = nc % r  # tokens already in the open window
        buf_kv, buf_gate = lay.slot_view(slots, slot, s.buf_kv, i), lay.slot_view(slots, slot, s.buf_gate, i)
        kv = torch.cat([buf_kv[:nb], kv])
        gate = torch.cat([buf_gate[:nb], gate])
        usable = kv.shape[0] // r * r
        rest = kv.shape[0] - usable
        buf_kv[:rest] = kv[usable:]
        buf_gate[:rest] = gate[usable:]
        n_win = usable // r
        if not n_win:
            return None
        ck = kv[:usable].view(n_win, r, -1)
        cg = gate[:usable].view(n_win, r, -1) + self.w[f"model.layers.{i}.self_attn.{s.prefix}position_bias"]
        return ck, cg

    def _pool_overlapping(
        self, i: int, s: Series, ck: torch.Tensor, cg: torch.Tensor, e0: int, slot: int, slots: torch.Tensor
    ) -> torch.Tensor:
        """CSA: window w pools window w-1's Ca half with its own Cb half: ck, cg [w, r, 2d] ->
        [w, d]; the first takes the slot's overlap state (none before window 0), and the last
        closed window's Ca half becomes it."""
        lay, r = self.layout, self.layout.rates[i]
        n_win, d = ck.shape[0], ck.shape[-1] // 2
        new_kv = ck.new_zeros(n_win, 2 * r, d)
        new_gate = cg.new_full((n_win, 2 * r, d), float("-inf"))
        new_kv[:, r:], new_gate[:, r:] = ck[..., d:], cg[..., d:]
        new_kv[1:, :r], new_gate[1:, :r] = ck[:-1, :, :d], cg[:-1, :, :d]
        ov_kv, ov_gate = lay.slot_view(slots, slot, s.ov_kv, i), lay.slot_view(slots, slot, s.ov_gate, i)
        if e0 > 0:
            new_kv[0, :r], new_gate[0, :r] = ov_kv, ov_gate
        ov_kv.copy_(ck[-1, :, :d])
        ov_gate.copy_(cg[-1, :, :d])
        return (new_kv * new_gate.softmax(dim=1)).sum(dim=1)  # [w, d]

    def _store(
        self,
        i: int,
        s: Series,
        pooled: torch.Tensor,
        ck: torch.Tensor,
        cg: torch.Tensor,
        e0: int,
        table: torch.Tensor,
        pages: torch.Tensor,
    ) -> None:
        """Windows e0 .. e0+w-1's entries pooled [w, d], normed and rotated, into the pages; for
        CSA, the Ca half of each window that ends a page into that page's end overlap."""
        lay, S, r = self.layout, self.layout.page_size, self.layout.rates[i]
        pooled = rms_norm(pooled, self.w[f"model.layers.{i}.self_attn.{s.prefix}kv_norm.weight"], self.eps)
        n_win = pooled.shape[0]
        wins = torch.arange(e0, e0 + n_win, device=self.device)
        cos, sin = self.rope(wins * r)
        pooled = apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)  # [w, d]
        per_page = S // r
        lay.page_view(pages, s.entries, i)[table[wins // per_page], wins % per_page] = pooled
        if s.overlap:  # windows that end a page leave their Ca half there for prefix-cache hits
            d = ck.shape[-1] // 2
            # [k] rows of wins, found on the host (nonzero on a GPU reads its count back)
            ends = torch.tensor([w - e0 for w in range(e0, e0 + n_win) if (w + 1) % per_page == 0], dtype=torch.long)
            ends = to_device(ends, self.device)
            page_ends = table[wins[ends] // per_page]
            lay.page_view(pages, s.ov_kv, i)[page_ends] = ck[ends, :, :d]
            lay.page_view(pages, s.ov_gate, i)[page_ends] = cg[ends, :, :d]
