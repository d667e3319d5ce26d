# B=sequences of the step (rows), V=vocab, R=ranks
"""One lockstep step of expert-parallel decode as rank 0 plans it: which rows each rank runs
(whole sequences, split over the ranks by count: `split_in_order` on this host, `split_sticky`
with ranks on other hosts; `RowSplit` adds each rank's first global token index and the rows
every rank pads to), the pages and state slots that move with them (`Moves`, worked out by
kvmesh.engine.ep.mirrors), and the plan each worker gets on its control link (`StepPlan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kvmesh.engine.ep.dispatch import split_by_requests
from kvmesh.engine.forward import ForwardItem


class Moves(NamedTuple):
    """The pages and state slots that move for one rank's rows in one step (all empty on this
    host, where every rank maps rank 0's pool); the names are StepPlan's fields."""

    install_pages: list[int]
    """Pages rank 0 sends the rank before the step (its copy is missing or stale)."""
    install_slots: list[int]
    """State slots rank 0 sends after those pages."""
    writeback_pages: list[int]
    """Pages the rank's rows write (a remote rank sends them back after the logits)."""
    writeback_slots: list[int]
    """State slots the rank's rows write (sent back after those pages)."""


@dataclass(frozen=True)
class StepPlan:
    """One step, as rank 0 tells a worker: its rows (maybe none; a sequence's speculative
    verification rows are never split between ranks), the global index of its first token, the
    rows every rank pads its logits to, a placement to load first, and whether to gather the
    rows' last hidden streams too (speculative decoding's MTP drafter, on rank 0, reads them)."""

    items: list[ForwardItem]
    token_offset: int
    max_rows: int
    placement: tuple[np.ndarray, np.ndarray] | None = field(default=None)
    streams: bool = False
    install_pages: list[int] = field(default_factory=list)
    """Remote ranks: pages whose contents rank 0 sends before the step (this order)."""
    install_slots: list[int] = field(default_factory=list)
    """Remote ranks: state slots rank 0 sends after those pages."""
    writeback_pages: list[int] = field(default_factory=list)
    """Remote ranks: pages the step writes, sent back to rank 0 after the logits."""
    writeback_slots: list[int] = field(default_factory=list)
    """Remote ranks: state slots the step writes, sent back after those pages."""


def sequence_starts(items: Sequence[ForwardItem]) -> list[int]:
    """Each sequence's first row, then len(items): an item with `state_from` continues the
    sequence before it (its speculative verification rows), so it starts none."""
    return [0] + [b for b in range(1, len(items)) if items[b].state_from is None] + [len(items)]


def split_in_order(starts: list[int], num_ranks: int) -> list[list[int]]:
    """Each rank's rows on this host (the ranks share the pages): whole sequences, split in
    order by count (`split_by_requests`)."""
    targets = [len(g) for g in split_by_requests(len(starts) - 1, num_ranks)]
    bounds = np.concatenate([[0], np.cumsum(targets)]).tolist()
    return [list(range(starts[bounds[r]], starts[bounds[r + 1]])) for r in range(num_ranks)]


def split_sticky(
    items: Sequence[ForwardItem], starts: list[int], num_ranks: int, owner: dict[int, int]
) -> tuple[list[list[int]], dict[int, int]]:
    """Each rank's rows with ranks on other hosts, and the new `owner` (a sequence's state slot,
    or -1 - its index without one, -> its rank): the same counts as on this host, but a
    sequence keeps the rank `owner` gives it where that rank is under its count (its pages are
    there), the rest fill the ranks under theirs in order."""
    n = len(starts) - 1
    targets = [len(g) for g in split_by_requests(n, num_ranks)]
    keys: list[int] = []
    for g in range(n):
        slot = items[starts[g]].state_slot
        keys.append(slot if slot is not None else -1 - g)
    count = [0] * num_ranks
    rank_of: list[int | None] = [None] * n
    for g, key in enumerate(keys):
        r = owner.get(key)
        if r is not None and count[r] < targets[r]:
            rank_of[g], count[r] = r, count[r] + 1
    for g in range(n):
        if rank_of[g] is None:
            r = next(r for r in range(num_ranks) if count[r] < targets[r])
            rank_of[g], count[r] = r, count[r] + 1
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for g, r in enumerate(rank_of):
        assert r is not None
        shares[r].extend(range(starts[g], starts[g + 1]))
    return shares, {keys[g]: r for g, r in enumerate(rank_of) if r is not None}


@dataclass(frozen=True)
class RowSplit:
    """One step's rows over the ranks: `shares[r]` are rank r's rows (indices into the step's
    items, whole sequences), `offsets[r]` the global index of its first token (the MoE
    dispatch picks replicas by it), `max_rows` what every rank pads its gathered rows to."""

    shares: list[list[int]]
    offsets: list[int]
    max_rows: int

    @classmethod
    def of(cls, items: Sequence[ForwardItem], shares: list[list[int]]) -> RowSplit:
        tokens = [sum(len(items[b].token_ids) for b in s) for s in shares]
        offsets = np.concatenate([[0], np.cumsum(tokens)[:-1]]).tolist()
        return cls(shares, offsets, max(len(s) for s in shares))

    def items_of(self, items: Sequence[ForwardItem], rank: int) -> list[ForwardItem]:
        """Rank `rank`'s rows, in the step's order."""
        return [items[b] for b in self.shares[rank]]

    def scatter(self, parts: list[torch.Tensor], num_rows: int) -> torch.Tensor:
        """Every rank's gathered rows (parts[r] [max_rows, W], padded) back in the step's order:
        [B, W] fp32 (W: V for logits)."""
        out = torch.empty(num_rows, parts[0].shape[1])
        for r, share in enumerate(self.shares):
            out[share] = parts[r][: len(share)]
        return out
