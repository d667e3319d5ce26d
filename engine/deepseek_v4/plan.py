# T=tokens (new, all sequences), B=sequences, Bd=sequences with one new token (decode),
# M=pages of the longest sequence, W=sliding window, Cmax=most compressed entries of a decode
# sequence, P=pages, S=page_size
"""What one DeepSeek-V4 forward's layers share (`ForwardPlan`): the batch laid out as rows of new
tokens, where each new token's K=V goes, and, for the sequences with one new token (decode),
their windows and compressed entries as batched indices. Built once a forward on the host
(`plan_forward`), then copied to the model's device: nothing is read back, so no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.deepseek_v4.state import V4StateLayout
from kvmesh.engine.forward import ForwardItem
from kvmesh.kernels.ops import to_device


@dataclass
class ForwardPlan:
    """Indices one forward's layers share, on the model's device (host values where so said)."""

    items: Sequence[ForwardItem]
    starts: list[int]  # [B + 1] host: item b's new tokens are rows starts[b] .. starts[b+1]-1
    positions: torch.Tensor  # [T] int64 each new token's position
    tables: list[torch.Tensor]  # [pages of item b] int64: each item's block table, built once a forward
    write_page: torch.Tensor  # [T] page of each new token
    write_slot: torch.Tensor  # [T] its row in the page
    dec: list[int]  # items with exactly one new token
    dec_rows: torch.Tensor  # [Bd] their token rows
    win_page: torch.Tensor  # [Bd, W] page / row of each window key (clamped where before 0)
    win_slot: torch.Tensor
    win_bias: torch.Tensor  # [Bd, W] 0 / -inf
    entries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """compress rate -> (page [Bd, Cmax], row [Bd, Cmax], count [Bd]) of each sequence's entries."""
    most_entries: dict[int, int]
    """compress rate -> the most entries a decode sequence has (a host value: no sync to branch on)."""
    count_ties: bool = False
    """Count `ties` (DeepseekV4Model.count_topk_ties: a test's counter, a host sync a layer)."""
    ties: int = 0
    """Indexer queries of this forward whose top-k set a tie decided (counted with count_ties)."""


def plan_forward(
    items: Sequence[ForwardItem],
    starts: list[int],
    positions: torch.Tensor,
    layout: V4StateLayout,
    window: int,
    device: torch.device,
    count_ties: bool = False,
) -> ForwardPlan:
    """The forward's plan, built on the host from `positions` [T] (a host tensor, each new token's
    position), the rows `starts` and the items' block tables; `window` is the sliding window W."""
    S, W = layout.page_size, window
    tables = [torch.tensor(list(it.block_ids)) for it in items]
    lengths = torch.tensor(starts[1:]) - torch.tensor(starts[:-1])
    seq_of = torch.repeat_interleave(torch.arange(len(items)), lengths, output_size=starts[-1])
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t[:1].expand(width - len(t))]) for t in tables])  # [B, M]
    write_page = padded[seq_of, positions // S]
    dec = [b for b, it in enumerate(items) if len(it.token_ids) == 1]
    dec_rows = torch.tensor([starts[b] for b in dec], dtype=torch.long)
    qpos = positions[dec_rows]  # [Bd]
    dtab = padded[dec] if dec else padded[:0]  # [Bd, M]
    wpos = qpos[:, None] + torch.arange(-W + 1, 1)  # [Bd, W]
    wc = wpos.clamp(min=0)
    entries, most = _decode_entries(items, dec, qpos, dtab, layout, device)
    on = device
    return ForwardPlan(
        items=items,
        starts=starts,
        positions=to_device(positions, on),
        tables=[to_device(t, on) for t in tables],
        write_page=to_device(write_page, on),
        write_slot=to_device(positions % S, on),
        dec=dec,
        dec_rows=to_device(dec_rows, on),
        win_page=to_device(dtab.gather(1, wc // S), on),
        win_slot=to_device(wc % S, on),
        win_bias=to_device(torch.zeros(wpos.shape).masked_fill_(wpos < 0, float("-inf")), on),
        entries=entries,
        most_entries=most,
        count_ties=count_ties,
    )


def _decode_entries(
    items: Sequence[ForwardItem],
    dec: list[int],
    qpos: torch.Tensor,
    dtab: torch.Tensor,
    layout: V4StateLayout,
    device: torch.device,
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[int, int]]:
    """For each compress rate r: the (page, row, count) of every decode sequence's compressed
    entries after this step's compress (qpos [Bd] their positions, dtab [Bd, M] their block
    tables), and the most entries one has."""
    S = layout.page_size
    entries, most = {}, {}
    for r in sorted(set(x for x in layout.rates if x)):
        count = (qpos + 1) // r  # [Bd] entries after this step's compress
        most[r] = max(((items[b].num_computed_tokens + 1) // r for b in dec), default=0)  # count's max
        cmax = max(most[r], 1)
        e = torch.arange(cmax)[None, :].expand(len(dec), cmax)
        page, row = dtab.gather(1, (e * r) // S), e % (S // r)
        entries[r] = (to_device(page, device), to_device(row, device), to_device(count, device))
    return entries, most
