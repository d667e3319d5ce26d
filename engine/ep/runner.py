# B=sequences of the step, V=vocab, N=hidden streams (hc_mult), H=hidden, R=ranks
"""Expert-parallel decode, rank 0: a `Runner` (engine/forward.py) over N ranks of one
DeepSeek-V4 checkpoint under torch.distributed (gloo on CPU; NCCL when every rank has a GPU).

Attention is data-parallel: each step's sequences are split over the ranks by request count
(`split_by_requests`), each rank runs attention (and the shared expert) for its own share over
the pages every rank maps; the routed experts are spread over the ranks per the EPLB placement
(kvmesh.engine.ep.eplb; experts in order, one replica each, when none is given) and every MoE layer
dispatches tokens to the ranks holding their experts and combines the results with all-to-all
(kvmesh.engine.ep.dispatch). Logits come back to rank 0, which samples. All ranks step in
lockstep: one plan a step (kvmesh.engine.ep.plan), sent by rank 0 (kvmesh.engine.ep.worker), and
a rank without sequences still joins each exchange.

A new placement (`set_placement`) is loaded by every rank before the next step: running
requests keep their pages and state, so none is dropped. This process is rank 0
(kvmesh.engine.ep.rank0): it wraps the single-process `DeepseekV4Runner` (its pages and slots
are already in shared memory) and spawns ranks 1..N-1 on this host (kvmesh.engine.ep.ranks),
or, given `init_addr`, waits for them to join from other hosts. Ranks on other hosts share no
memory with rank 0: each keeps a mirror of the pool, a sequence stays on the rank that ran it
last step while the split stays balanced (sticky DP attention), and rank 0 sends a rank the
pages and slots it lacks before a step and takes back the ones it wrote after
(kvmesh.engine.ep.mirrors says which, kvmesh.engine.ep.transfer moves them), over
torch.distributed. References: DeepSeek-V3 technical report §3.4 (EP with DP attention,
redundant experts), SGLang's DP-attention + DeepEP MoE serving design.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.engine.deepseek_v4.runner import check_items, warm_up
from kvmesh.engine.ep.eplb import Placement
from kvmesh.engine.ep.plan import Moves, RowSplit, StepPlan, sequence_starts, split_in_order, split_sticky
from kvmesh.engine.ep.rank0 import RankZeroWorld
from kvmesh.engine.ep.ranks import EPWorldError
from kvmesh.engine.ep.transfer import gather_rows, send_installs, stream_width, take_back
from kvmesh.engine.forward import DraftItem, ForwardItem

logger = logging.getLogger(__name__)


class ExpertParallelRunner(RankZeroWorld):
    """N ranks of one DeepSeek-V4 model behind the single-process runner's interface.

    runner: rank 0's `DeepseekV4Runner` (built by kvmesh.engine.runners); files: its checkpoint (the
    workers load it themselves); placement: an EPLB placement for num_ranks ranks (None:
    `default_placement`); timeout_s bounds every collective, start_timeout_s the workers' start
    (model load included); gather_streams: bring every row's last hidden streams to rank 0 each
    step, for the MTP drafter (`last_hidden`; one more collective a step, so only when drafting
    with MTP). init_addr: (host, port) where ranks 1..N-1 on other hosts join (`kvmesh serve
    ep-rank`), authenticated by `authkey`; None: spawn them on this host, mapping rank 0's pages.
    Raises ValueError for fewer than 2 ranks, a placement that does not fit the model,
    gather_streams without an MTP module or with ranks on other hosts, or init_addr without a
    key; OSError when init_addr cannot be bound; EPWorldError when a rank fails to start or
    join. (The world itself, its start, placement and loads: kvmesh.engine.ep.rank0.)
    """

    # -- the Runner interface ---------------------------------------------------------------
    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One lockstep step over every rank; fp32 logits [B, V] in items' order. Sequences are
        split over the ranks by count (on this host in order; with ranks on other hosts each
        stays where it ran while the split stays balanced); a sequence's speculative
        verification rows (an item with `state_from` continues the one before it) stay on one
        rank, which writes their K/V before any of them attends, as one process does. Raises
        ValueError as DeepseekV4Runner.forward does (nothing is sent then), EPWorldError when a
        rank is gone or a collective times out (the world stays down)."""
        check_items(items, self.config, self.page_size, self.num_state_slots)  # before any rank hears of them
        if self._broken:
            raise EPWorldError(f"the EP world is down: {self._broken}")
        started = time.perf_counter()
        split = RowSplit.of(items, self._assign(items, sequence_starts(items)))  # each rank's rows: whole sequences
        pending, self._pending = self._pending, None
        moves = [self.mirrors.moves(r, split.items_of(items, r)) for r in range(self.num_ranks)]
        try:
            logits, hidden = self._exchange(items, split, pending, moves)
        except (RuntimeError, OSError, ValueError) as exc:
            self._broken = self.ranks.why_down()
            raise EPWorldError(f"expert-parallel step failed ({exc}); {self._broken}") from exc
        self.mirrors.moved(moves)
        out = split.scatter(logits, len(items))
        if hidden is not None:
            c = self.runner.model.config
            self._last_hidden = split.scatter(hidden, len(items)).view(len(items), c.hc_mult, c.hidden_size)
        self.times.steps += 1
        self.times.step_s += time.perf_counter() - started
        return out  # [B, V]

    # -- one step's traffic, in the order every rank runs it ----------------------------------
    def _exchange(
        self, items: Sequence[ForwardItem], split: RowSplit, pending: Placement | None, moves: list[Moves]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The plans down the control links, the pages and slots remote ranks lack out, the new
        placement, rank 0's rows (each MoE layer's dispatch and combine with every rank), the
        rows gathered to rank 0, what remote ranks wrote taken back. Returns every rank's
        logits [max_rows, V] and, with gather_streams, its streams [max_rows, N * H] (else
        None); RuntimeError / OSError / ValueError when a rank is gone or a wait times out."""
        pages, slots = self.runner.pages, self.runner.slots
        self._send_plans(items, split, pending, moves)
        with self.times.timed("pages_s"):
            sends = send_installs(moves, pages, slots)
        if pending is not None:
            self.moe.load_placement(pending)
        own = split.items_of(items, 0)
        logits = self._run_own(own)
        with self.times.timed("gather_s"):
            parts, hidden = self._gather(own, logits, split.max_rows)
        with self.times.timed("pages_s"):
            take_back(sends, moves, pages, slots, self.timeout_s)
        return parts, hidden

    def _send_plans(
        self, items: Sequence[ForwardItem], split: RowSplit, pending: Placement | None, moves: list[Moves]
    ) -> None:
        """Each worker's StepPlan down its control link: its rows, its first token's global
        index, the rows every rank pads to, the placement to load first, whether to gather
        streams, and the pages and slots it takes and gives back."""
        arrays = None if pending is None else (np.asarray(pending.phy2log), np.asarray(pending.replicas))
        for w, link in enumerate(self.ranks.links):
            r = w + 1
            link.send(
                StepPlan(
                    split.items_of(items, r),
                    int(split.offsets[r]),
                    split.max_rows,
                    arrays,
                    self.gather_streams,
                    *moves[r],
                )
            )

    def _run_own(self, own: list[ForwardItem]) -> torch.Tensor | None:
        """Rank 0's rows through its model: fp32 logits [B_0, V]; without rows, rank 0 still
        joins every MoE layer's exchange (None)."""
        self.moe.token_offset = 0
        if not own:
            self.moe.idle_forward()
            return None
        return self.runner.model.forward(own, self.runner.pages, self.runner.slots)

    def _gather(
        self, own: list[ForwardItem], logits: torch.Tensor | None, max_rows: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Every rank's logits gathered to rank 0, and with gather_streams every row's last
        hidden streams too (the MTP drafter continues from them; None otherwise)."""
        parts = gather_rows(logits, max_rows, self.config.vocab_size, self.backend, 0)
        assert parts is not None, "rank 0 is where the rows gather"
        hidden = None
        if self.gather_streams:
            model = self.runner.model
            mine = model.last_streams.reshape(len(own), -1) if own else None
            hidden = gather_rows(mine, max_rows, stream_width(model.config), self.backend, 0)
        return parts, hidden

    # -- where sequences run ------------------------------------------------------------------
    def _assign(self, items: Sequence[ForwardItem], starts: list[int]) -> list[list[int]]:
        """Each rank's rows (whole sequences; `starts` are the sequences' first rows): on this
        host split in order by count (the ranks share the pages); with ranks on other hosts the
        same counts, but a sequence keeps the rank it had last step where that rank is under its
        count (its pages are there), the rest fill the ranks under theirs in order."""
        if not self.remote:
            return split_in_order(starts, self.num_ranks)
        shares, self._owner = split_sticky(items, starts, self.num_ranks, self._owner)
        return shares

    # -- rank 0's pool, read and written outside a step ---------------------------------------
    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
        """Rank 0's page (the home copy); whoever asks may write it, so no remote copy stays current."""
        self.mirrors.stale(pages=[page_id])
        return self.runner.page_buffer(page_id)

    # -- speculative decoding: the slots live in shared memory, the MTP module on rank 0 --------
    @property
    def has_mtp(self) -> bool:
        return self.runner.has_mtp

    @property
    def draft_window(self) -> int:
        return self.runner.draft_window

    def copy_state_slot(self, src: int, dst: int) -> None:
        self.runner.copy_state_slot(src, dst)
        self.mirrors.stale(slots=[dst])

    def slot_hidden(self, slot: int) -> torch.Tensor:
        return self.runner.slot_hidden(slot)

    def last_hidden(self) -> torch.Tensor:
        """[B, N, H] fp32 every row's last hidden streams in the last forward, gathered from the
        ranks that ran them (with gather_streams only; ValueError otherwise)."""
        if not self.gather_streams:
            raise ValueError("this expert-parallel runner does not gather hidden streams (gather_streams=False)")
        return self._last_hidden

    def propose_drafts(self, items: Sequence[DraftItem]) -> list[list[int]]:
        """Drafts from rank 0's MTP module: its block's experts are its own, not spread over
        the ranks, so drafting needs no collective."""
        return self.runner.propose_drafts(items)

    def state_buffers(self, slot: int | None) -> list[np.ndarray | torch.Tensor]:
        if slot is not None:
            self.mirrors.stale(slots=[slot])
        return self.runner.state_buffers(slot)

    def resume_state_slot(self, slot: int, last_cached_page: int) -> None:
        self.runner.resume_state_slot(slot, last_cached_page)
        self.mirrors.stale(slots=[slot])

    def warmup(self) -> None:
        """A tiny prefill and decode through every rank (page 0 and slot 0 left as garbage)."""
        logger.info("EP warmup took %.2f s", warm_up(self.forward, self.page_size, self.config.bos_token_id))
