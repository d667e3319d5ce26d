# B=sequences of the step, V=vocab, L=MoE layers, E=experts, R=ranks
"""Expert-parallel decode, rank 0: a `Runner` (engine/forward.py) over N ranks of one
DeepSeek-V4 checkpoint under torch.distributed (gloo on CPU; NCCL when every rank has a GPU).

Attention is data-parallel: each step's sequences are split over the ranks by request count
(`split_by_requests`), each rank runs attention (and the shared expert) for its own share over
the pages every rank maps; the routed experts are spread over the ranks per the EPLB placement
(engine.eplb; experts in order, one replica each, when none is given) and every MoE layer
dispatches tokens to the ranks holding their experts and combines the results with all-to-all
(engine.expert_parallel). Logits come back to rank 0, which samples. All ranks step in
lockstep: one plan a step, sent by rank 0 (engine.ep_worker), and a rank without sequences
still joins each exchange.

A new placement (`set_placement`) is loaded by every rank before the next step: running
requests keep their pages and state, so none is dropped. This process is rank 0: it wraps the
single-process `DeepseekV4Runner` (its pages and slots are already in shared memory) and
spawns ranks 1..N-1 (engine.ep_ranks). References: DeepSeek-V3 technical report §3.4 (EP with
DP attention, redundant experts), SGLang's DP-attention + DeepEP MoE serving design.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.ep_ranks import EPWorldError, RankProcesses, pick_backend
from engine.ep_worker import StepPlan, WorldSpec, comm_device, gather_rows, init_world, stream_width
from engine.eplb import Placement, default_placement
from engine.expert_parallel import EPLoads, ExpertParallelMoE, check_placement, split_by_requests
from engine.expert_weights import CheckpointExperts
from engine.forward import DraftItem, ForwardItem
from engine.v4_runner import check_items, warm_up
from kvstore.shared_memory import locate

if TYPE_CHECKING:
    from engine.checkpoint import ModelFiles
    from engine.v4_runner import DeepseekV4Runner

logger = logging.getLogger(__name__)


class ExpertParallelRunner:
    """N ranks of one DeepSeek-V4 model behind the single-process runner's interface.

    runner: rank 0's `DeepseekV4Runner` (built by engine.runners); files: its checkpoint (the
    workers load it themselves); placement: an EPLB placement for num_ranks ranks (None:
    `default_placement`); timeout_s bounds every collective, start_timeout_s the workers' start
    (model load included); gather_streams: bring every row's last hidden streams to rank 0 each
    step, for the MTP drafter (`last_hidden`; one more collective a step, so only when drafting
    with MTP). Raises ValueError for fewer than 2 ranks, a placement that does not fit the model,
    or gather_streams without an MTP module; EPWorldError when a worker fails to start.
    """

    def __init__(
        self,
        runner: DeepseekV4Runner,
        files: ModelFiles,
        num_ranks: int,
        placement: Placement | None = None,
        kernel_backend: str = "torch",
        timeout_s: float = 30.0,
        start_timeout_s: float = 600.0,
        torch_threads: int = 0,
        backend: str = "auto",
        gather_streams: bool = False,
    ) -> None:
        if num_ranks < 2:
            raise ValueError(f"expert-parallel decode needs >= 2 ranks, got {num_ranks}")
        if gather_streams and not runner.has_mtp:
            raise ValueError(f"{runner.config.name!r} has no multi-token-prediction module: no streams to gather")
        self.gather_streams = gather_streams
        c = runner.model.config
        placement = placement or default_placement(c.num_hidden_layers, c.n_routed_experts, num_ranks)
        check_placement(placement, c.num_hidden_layers, c.n_routed_experts, num_ranks)
        self.runner, self.num_ranks = runner, num_ranks
        self.config, self.page_size, self.num_pages = runner.config, runner.page_size, runner.num_pages
        self.page_nbytes, self.num_state_slots = runner.page_nbytes, runner.num_state_slots
        self.page_layout = runner.page_layout
        self.backend = pick_backend(num_ranks) if backend == "auto" else backend
        self._pending: Placement | None = None
        self._broken = ""
        self._last_hidden = torch.zeros(0, c.hc_mult, c.hidden_size)  # [B, N, H] (MTP checkpoints)
        found = locate([runner.pages.data_ptr()], [runner.pages.numel() * 4])
        if found is None:
            raise ValueError("the runner's pages are not in a shared region; EP ranks could not reach them")
        region, (offset,) = found
        store = torch.distributed.TCPStore(
            "127.0.0.1",
            0,
            num_ranks,
            is_master=True,
            timeout=datetime.timedelta(seconds=start_timeout_s),
            wait_for_workers=False,
        )
        spec = WorldSpec(
            files,
            num_ranks,
            store.port,
            self.backend,
            timeout_s,
            region,
            offset,
            runner.num_pages,
            runner.page_size,
            runner.num_state_slots,
            kernel_backend,
            torch_threads,
            np.asarray(placement.phy2log, np.int64),
            np.asarray(placement.replicas, np.int64),
            runner.layout.slot_floats,
        )
        self.ranks = RankProcesses(spec)
        try:
            self.ranks.await_all("hello", start_timeout_s)
            init_world(spec, 0, store)
            self._store = store
            experts = CheckpointExperts(files.checkpoint_dir, c.num_hidden_layers, c.n_routed_experts)
            self.moe = ExpertParallelMoE(
                runner.model, 0, num_ranks, placement, experts, device=comm_device(self.backend, 0)
            )
            runner.model.routed_experts = self.moe
            runner.model.drop_routed_experts()  # rank 0 keeps its slots' experts only, as every rank
            ready = self.ranks.await_all("ready", start_timeout_s)
            self.expert_nbytes = [self.moe.expert_nbytes(), *(int(ready[w]) for w in range(num_ranks - 1))]
            """Bytes of routed-expert weights each rank held when it started (its slots' only)."""
        except BaseException:
            self.close()
            raise
        logger.info(
            "expert-parallel decode: %d ranks over %s, routed experts held per rank: %s MB",
            num_ranks,
            self.backend,
            [round(b / 1e6, 1) for b in self.expert_nbytes],
        )

    # -- the world --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (engine.ep_ranks) and leave the world."""
        self.ranks.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # -- placement and loads ----------------------------------------------------------------
    def set_placement(self, placement: Placement) -> None:
        """Load `placement` on every rank before the next step (running requests continue).
        Raises ValueError when it does not fit the model and the world."""
        c = self.runner.model.config
        check_placement(placement, c.num_hidden_layers, c.n_routed_experts, self.num_ranks)
        self._pending = placement

    @property
    def placement(self) -> Placement:
        return self._pending or self.moe.placement

    @property
    def loads(self) -> EPLoads:
        """Rows each rank's experts computed and tokens per expert, measured by the exchanges."""
        return self.moe.loads

    def expert_token_counts(self) -> np.ndarray:
        """[L, E] int64 tokens routed to each expert over every rank since start (a copy)."""
        return self.moe.loads.expert_tokens.copy()

    # -- the Runner interface ---------------------------------------------------------------
    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One lockstep step over every rank; fp32 logits [B, V] in items' order. Sequences are
        split over the ranks by count; a sequence's speculative verification rows (an item with
        `state_from` continues the one before it) stay on one rank, which writes their K/V before
        any of them attends, as one process does. Raises ValueError as DeepseekV4Runner.forward
        does (nothing is sent then), EPWorldError when a rank is gone or a collective times out
        (the world stays down)."""
        check_items(items, self.config, self.page_size, self.num_state_slots)  # before any rank hears of them
        if self._broken:
            raise EPWorldError(f"the EP world is down: {self._broken}")
        starts = [0] + [b for b in range(1, len(items)) if items[b].state_from is None] + [len(items)]
        shares = [
            range(starts[g.start], starts[g.stop]) for g in split_by_requests(len(starts) - 1, self.num_ranks)
        ]  # each rank's rows: whole sequences
        tokens = [sum(len(items[b].token_ids) for b in s) for s in shares]
        offsets = np.concatenate([[0], np.cumsum(tokens)[:-1]]).tolist()
        max_rows = max(len(s) for s in shares)
        pending, self._pending = self._pending, None
        arrays = None if pending is None else (np.asarray(pending.phy2log), np.asarray(pending.replicas))
        streams = self.gather_streams  # the MTP drafter continues from every row's last streams
        hidden = None
        try:
            for w, conn in enumerate(self.ranks.conns):
                s = shares[w + 1]
                conn.send(StepPlan([items[b] for b in s], int(offsets[w + 1]), max_rows, arrays, streams))
            if pending is not None:
                self.moe.load_placement(pending)
            self.moe.token_offset = 0
            own = [items[b] for b in shares[0]]
            logits = None
            if own:
                logits = self.runner.model.forward(own, self.runner.pages, self.runner.slots)
            else:
                self.moe.idle_forward()
            parts = gather_rows(logits, max_rows, self.config.vocab_size, self.backend, 0)
            if streams:
                mine = self.runner.model.last_streams.reshape(len(own), -1) if own else None
                hidden = gather_rows(mine, max_rows, stream_width(self.runner.model.config), self.backend, 0)
        except (RuntimeError, OSError, ValueError) as exc:
            self._broken = self.ranks.why_down()
            raise EPWorldError(f"expert-parallel step failed ({exc}); {self._broken}") from exc
        assert parts is not None
        if streams:
            assert hidden is not None
            c = self.runner.model.config
            self._last_hidden = torch.cat([hidden[r][: len(shares[r])] for r in range(self.num_ranks)]).view(
                len(items), c.hc_mult, c.hidden_size
            )
        return torch.cat([parts[r][: len(shares[r])] for r in range(self.num_ranks)])  # [B, V]

    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
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
        return self.runner.state_buffers(slot)

    def resume_state_slot(self, slot: int, last_cached_page: int) -> None:
        self.runner.resume_state_slot(slot, last_cached_page)

    def warmup(self) -> None:
        """A tiny prefill and decode through every rank (page 0 and slot 0 left as garbage)."""
        logger.info("EP warmup took %.2f s", warm_up(self.forward, self.page_size, self.config.bos_token_id))
