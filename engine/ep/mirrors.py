"""Rank 0's record of the pool mirrors that ranks on other hosts keep: which pages and state
slots each remote rank holds a current copy of, so a step sends a rank only what it lacks.

Rank 0's pool is the home copy (KV pushes land there; decode's prefix cache reads it). A remote
rank's copy of a page or slot is current from when rank 0 sent it, or the rank wrote it and
sent it back, until another rank writes it (`moved`) or rank 0 changes it outside a step
(`stale`: a KV push lands, a slot is resumed or copied). On this host every rank maps rank 0's
pool, so nothing moves and nothing goes stale.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvmesh.engine.ep.plan import Moves
from kvmesh.engine.forward import ForwardItem


class Mirrors:
    """The remote ranks' current pages and slots (ranks 1..num_ranks-1; none when not
    `remote`). Thread-safe: rank 0's pages are handed out (`stale`) while it steps."""

    def __init__(self, num_ranks: int, page_size: int, remote: bool) -> None:
        self.num_ranks, self.page_size, self.remote = num_ranks, page_size, remote
        # a remote rank's copy of each page and slot is valid until another rank writes it
        self._valid_pages: list[set[int]] = [set() for _ in range(num_ranks)]
        self._valid_slots: list[set[int]] = [set() for _ in range(num_ranks)]
        self._lock = threading.Lock()

    def moves(self, rank: int, items: list[ForwardItem]) -> Moves:
        """(pages to send `rank` before the step, slots to send, pages it writes, slots it
        writes) for its rows `items`; nothing moves on this host (the pages are shared)."""
        if not self.remote or not items:
            return Moves([], [], [], [])
        reads, writes, read_slots, write_slots = _touched(items, self.page_size)
        if rank == 0:
            return Moves([], [], writes, write_slots)  # rank 0 holds the home copy: only the others go stale
        with self._lock:
            send = [p for p in reads if p not in self._valid_pages[rank]]
            send_slots = [s for s in read_slots if s not in self._valid_slots[rank]]
        return Moves(send, send_slots, writes, write_slots)

    def moved(self, moves: Sequence[Moves]) -> None:
        """After a step: what each rank wrote is stale on every other rank; a remote rank holds
        what it was sent and what it wrote (rank 0 has it back too)."""
        if not self.remote:
            return
        with self._lock:
            for r, (sent, sent_slots, wrote, wrote_slots) in enumerate(moves):
                for u in range(1, self.num_ranks):
                    if u != r:
                        self._valid_pages[u].difference_update(wrote)
                        self._valid_slots[u].difference_update(wrote_slots)
                if r:
                    self._valid_pages[r].update(sent, wrote)
                    self._valid_slots[r].update(sent_slots, wrote_slots)

    def stale(self, pages: Sequence[int] = (), slots: Sequence[int] = ()) -> None:
        """Rank 0 changed these pages or slots outside a step (a KV push lands, a slot is
        resumed or copied): no remote rank's copy of them is current any more."""
        if not self.remote:
            return
        with self._lock:
            for r in range(1, self.num_ranks):
                self._valid_pages[r].difference_update(pages)
                self._valid_slots[r].difference_update(slots)


def _touched(items: list[ForwardItem], page_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(pages the rows read, pages they write, slots they read, slots they write), each in
    first-use order without repeats: a row reads every page of its sequence and its state slot
    (and the one it continues from), and writes the pages its new tokens land in and its slot."""
    reads = list(dict.fromkeys(p for it in items for p in it.block_ids))
    writes = list(
        dict.fromkeys(
            it.block_ids[p]
            for it in items
            for p in range(
                it.num_computed_tokens // page_size, (it.num_computed_tokens + len(it.token_ids) - 1) // page_size + 1
            )
        )
    )
    read_slots = list(dict.fromkeys(s for it in items for s in (it.state_slot, it.state_from) if s is not None))
    write_slots = list(dict.fromkeys(it.state_slot for it in items if it.state_slot is not None))
    return reads, writes, read_slots, write_slots
