# B=sequences of the step, V=vocab, L=MoE layers, E=experts, R=ranks
"""Expert-parallel decode, rank 0: a `Runner` (engine/forward.py) over N ranks of one
DeepSeek-V4 checkpoint under torch.distributed (gloo on CPU; NCCL when every rank has a GPU).

Attention is data-parallel: each step's sequences are split over the ranks by request count
(`split_by_requests`), each rank runs attention (and the shared expert) for its own share over
the pages every rank maps; the routed experts are spread over the ranks per the EPLB placement
(kvmesh.engine.ep.eplb; experts in order, one replica each, when none is given) and every MoE layer
dispatches tokens to the ranks holding their experts and combines the results with all-to-all
(kvmesh.engine.ep.dispatch). Logits come back to rank 0, which samples. All ranks step in
lockstep: one plan a step, sent by rank 0 (kvmesh.engine.ep.worker), and a rank without sequences
still joins each exchange.

A new placement (`set_placement`) is loaded by every rank before the next step: running
requests keep their pages and state, so none is dropped. This process is rank 0: it wraps the
single-process `DeepseekV4Runner` (its pages and slots are already in shared memory) and spawns
ranks 1..N-1 on this host (kvmesh.engine.ep.ranks), or, given `init_addr`, waits for them to join from
other hosts. Ranks on other hosts share no memory with rank 0: each keeps a mirror of the pool,
a sequence stays on the rank that ran it last step while the split stays balanced (sticky DP
attention), and rank 0 sends a rank the pages and slots it lacks before a step and takes back
the ones it wrote after (kvmesh.engine.ep.worker), over torch.distributed. References: DeepSeek-V3
technical report §3.4 (EP with DP attention, redundant experts), SGLang's DP-attention + DeepEP
MoE serving design.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmesh.engine.deepseek_v4.runner import check_items, warm_up
from kvmesh.engine.ep.dispatch import EPLoads, EPTimes, ExpertParallelMoE, check_placement, split_by_requests
from kvmesh.engine.ep.eplb import Placement, default_placement
from kvmesh.engine.ep.expert_weights import CheckpointExperts
from kvmesh.engine.ep.ranks import EPWorldError, RankProcesses, RemoteRanks, pick_backend
from kvmesh.engine.ep.worker import (
    StepPlan,
    WorldSpec,
    comm_device,
    config_digest,
    gather_rows,
    init_world,
    pack,
    stream_width,
    unpack,
)
from kvmesh.engine.forward import DraftItem, ForwardItem
from kvmesh.kvstore.shared_memory import locate

if TYPE_CHECKING:
    from kvmesh.engine.checkpoint import ModelFiles
    from kvmesh.engine.deepseek_v4.runner import DeepseekV4Runner

logger = logging.getLogger(__name__)


class ExpertParallelRunner:
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
    join.
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
        init_addr: tuple[str, int] | None = None,
        authkey: bytes = b"",
    ) -> None:
        if num_ranks < 2:
            raise ValueError(f"expert-parallel decode needs >= 2 ranks, got {num_ranks}")
        if gather_streams and not runner.has_mtp:
            raise ValueError(f"{runner.config.name!r} has no multi-token-prediction module: no streams to gather")
        if init_addr is not None and gather_streams:
            raise ValueError(
                "MTP drafting with EP ranks on other hosts is not built yet: use --speculative off or ngram"
            )
        if init_addr is not None and not authkey:
            raise ValueError("EP ranks on other hosts need a shared key: set KVMESH_EP_SECRET on every rank")
        self.gather_streams = gather_streams
        self.remote = init_addr is not None
        """Ranks on other hosts, each with its own mirror of the pool (no shared memory)."""
        c = runner.model.config
        placement = placement or default_placement(c.num_hidden_layers, c.n_routed_experts, num_ranks)
        check_placement(placement, c.num_hidden_layers, c.n_routed_experts, num_ranks)
        self.runner, self.num_ranks = runner, num_ranks
        self.config, self.page_size, self.num_pages = runner.config, runner.page_size, runner.num_pages
        self.page_nbytes, self.num_state_slots = runner.page_nbytes, runner.num_state_slots
        self.page_layout = runner.page_layout
        self.backend = pick_backend(num_ranks) if backend == "auto" else backend
        self.timeout_s = timeout_s
        self._pending: Placement | None = None
        self._broken = ""
        self._last_hidden = torch.zeros(0, c.hc_mult, c.hidden_size)  # [B, N, H] (MTP checkpoints)
        region, offset = None, 0
        if not self.remote:
            found = locate([runner.pages.data_ptr()], [runner.pages.numel() * 4])
            if found is None:
                raise ValueError("the runner's pages are not in a shared region; EP ranks could not reach them")
            region, (offset,) = found
        # a remote rank's copy of each page and slot is valid until another rank writes it
        self._valid_pages: list[set[int]] = [set() for _ in range(num_ranks)]
        self._valid_slots: list[set[int]] = [set() for _ in range(num_ranks)]
        self._owner: dict[int, int] = {}  # state slot of a sequence -> the rank that ran it last
        self._lock = threading.Lock()
        self.times = EPTimes()
        """Rank 0's seconds in each part of the exchanges since start (kvmesh.engine.ep.dispatch)."""
        store = torch.distributed.TCPStore(
            init_addr[0] if init_addr else "127.0.0.1",
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
            config_digest=config_digest(files),
        )
        if init_addr is None:
            self.ranks: RankProcesses | RemoteRanks = RankProcesses(spec)
        else:
            self.ranks = RemoteRanks(init_addr[0], init_addr[1], num_ranks, authkey, start_timeout_s)
        try:
            for link in self.ranks.links if self.remote else ():
                link.send(("spec", spec))
            self.ranks.await_all("hello", start_timeout_s)
            init_world(spec, 0, store)
            self._store = store
            experts = CheckpointExperts(files.checkpoint_dir, c.num_hidden_layers, c.n_routed_experts)
            self.moe = ExpertParallelMoE(
                runner.model, 0, num_ranks, placement, experts, device=comm_device(self.backend, 0), times=self.times
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
            "expert-parallel decode: %d ranks over %s (%s), routed experts held per rank: %s MB",
            num_ranks,
            self.backend,
            f"joined at {init_addr[0]}:{init_addr[1]}" if init_addr else "on this host",
            [round(b / 1e6, 1) for b in self.expert_nbytes],
        )

    # -- the world --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (kvmesh.engine.ep.ranks) and leave the world."""
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
        starts = [0] + [b for b in range(1, len(items)) if items[b].state_from is None] + [len(items)]
        shares = self._assign(items, starts)  # each rank's rows: whole sequences
        tokens = [sum(len(items[b].token_ids) for b in s) for s in shares]
        offsets = np.concatenate([[0], np.cumsum(tokens)[:-1]]).tolist()
        max_rows = max(len(s) for s in shares)
        pending, self._pending = self._pending, None
        arrays = None if pending is None else (np.asarray(pending.phy2log), np.asarray(pending.replicas))
        streams = self.gather_streams  # the MTP drafter continues from every row's last streams
        moves = [self._moves(r, [items[b] for b in shares[r]]) for r in range(self.num_ranks)]
        hidden = None
        pages, slots = self.runner.pages, self.runner.slots
        try:
            for w, link in enumerate(self.ranks.links):
                r = w + 1
                link.send(
                    StepPlan([items[b] for b in shares[r]], int(offsets[r]), max_rows, arrays, streams, *moves[r])
                )
            timer = time.perf_counter()
            sends = [
                torch.distributed.isend(pack(moves[r][0], moves[r][1], pages, slots), dst=r)
                for r in range(1, self.num_ranks)
                if moves[r][0] or moves[r][1]
            ]
            self.times.pages_s += time.perf_counter() - timer
            if pending is not None:
                self.moe.load_placement(pending)
            self.moe.token_offset = 0
            own = [items[b] for b in shares[0]]
            logits = None
            if own:
                logits = self.runner.model.forward(own, pages, slots)
            else:
                self.moe.idle_forward()
            timer = time.perf_counter()
            parts = gather_rows(logits, max_rows, self.config.vocab_size, self.backend, 0)
            if streams:
                mine = self.runner.model.last_streams.reshape(len(own), -1) if own else None
                hidden = gather_rows(mine, max_rows, stream_width(self.runner.model.config), self.backend, 0)
            self.times.gather_s += time.perf_counter() - timer
            timer = time.perf_counter()
            bound = datetime.timedelta(seconds=self.timeout_s)
            for work in sends:
                _wait(work, bound)
            for r in range(1, self.num_ranks):
                back_pages, back_slots = moves[r][2], moves[r][3]
                if back_pages or back_slots:
                    flat = torch.empty(len(back_pages) * pages.shape[1] + len(back_slots) * slots.shape[1])
                    _wait(torch.distributed.irecv(flat, src=r), bound)
                    unpack(flat, back_pages, back_slots, pages, slots)
            self.times.pages_s += time.perf_counter() - timer
        except (RuntimeError, OSError, ValueError) as exc:
            self._broken = self.ranks.why_down()
            raise EPWorldError(f"expert-parallel step failed ({exc}); {self._broken}") from exc
        assert parts is not None
        self._moved(moves)
        out = torch.empty(len(items), self.config.vocab_size)
        for r in range(self.num_ranks):
            out[shares[r]] = parts[r][: len(shares[r])]
        if streams:
            assert hidden is not None
            c = self.runner.model.config
            flat_hidden = torch.empty(len(items), hidden[0].shape[1])
            for r in range(self.num_ranks):
                flat_hidden[shares[r]] = hidden[r][: len(shares[r])]
            self._last_hidden = flat_hidden.view(len(items), c.hc_mult, c.hidden_size)
        self.times.steps += 1
        self.times.step_s += time.perf_counter() - started
        return out  # [B, V]

    # -- where sequences run, and the pages that move with them -------------------------------
    def _assign(self, items: Sequence[ForwardItem], starts: list[int]) -> list[list[int]]:
        """Each rank's rows (whole sequences; `starts` are the sequences' first rows): on this
        host split in order by count (the ranks share the pages); with ranks on other hosts the
        same counts, but a sequence keeps the rank it had last step where that rank is under its
        count (its pages are there), the rest fill the ranks under theirs in order."""
        n = len(starts) - 1
        targets = [len(g) for g in split_by_requests(n, self.num_ranks)]
        if not self.remote:
            bounds = np.concatenate([[0], np.cumsum(targets)]).tolist()
            return [list(range(starts[bounds[r]], starts[bounds[r + 1]])) for r in range(self.num_ranks)]
        keys: list[int] = []
        for g in range(n):
            slot = items[starts[g]].state_slot
            keys.append(slot if slot is not None else -1 - g)
        count = [0] * self.num_ranks
        rank_of: list[int | None] = [None] * n
        for g, key in enumerate(keys):
            r = self._owner.get(key)
            if r is not None and count[r] < targets[r]:
                rank_of[g], count[r] = r, count[r] + 1
        for g in range(n):
            if rank_of[g] is None:
                r = next(r for r in range(self.num_ranks) if count[r] < targets[r])
                rank_of[g], count[r] = r, count[r] + 1
        self._owner = {keys[g]: r for g, r in enumerate(rank_of) if r is not None}
        shares: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for g, r in enumerate(rank_of):
            assert r is not None
            shares[r].extend(range(starts[g], starts[g + 1]))
        return shares

    def _moves(self, rank: int, items: list[ForwardItem]) -> tuple[list[int], list[int], list[int], list[int]]:
        """(pages to send `rank` before the step, slots to send, pages it writes, slots it
        writes) for its rows `items`; nothing moves on this host (the pages are shared)."""
        if not self.remote or not items:
            return [], [], [], []
        size = self.page_size
        reads = list(dict.fromkeys(p for it in items for p in it.block_ids))
        writes = list(
            dict.fromkeys(
                it.block_ids[p]
                for it in items
                for p in range(
                    it.num_computed_tokens // size, (it.num_computed_tokens + len(it.token_ids) - 1) // size + 1
                )
            )
        )
        read_slots = list(dict.fromkeys(s for it in items for s in (it.state_slot, it.state_from) if s is not None))
        write_slots = list(dict.fromkeys(it.state_slot for it in items if it.state_slot is not None))
        if rank == 0:
            return [], [], writes, write_slots  # rank 0 holds the home copy: only the others go stale
        with self._lock:
            send = [p for p in reads if p not in self._valid_pages[rank]]
            send_slots = [s for s in read_slots if s not in self._valid_slots[rank]]
        return send, send_slots, writes, write_slots

    def _moved(self, moves: list[tuple[list[int], list[int], list[int], list[int]]]) -> None:
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

    def _stale(self, pages: Sequence[int] = (), slots: Sequence[int] = ()) -> None:
        """Rank 0 changed these pages or slots outside a step (a KV push lands, a slot is
        resumed or copied): no remote rank's copy of them is current any more."""
        if not self.remote:
            return
        with self._lock:
            for r in range(1, self.num_ranks):
                self._valid_pages[r].difference_update(pages)
                self._valid_slots[r].difference_update(slots)

    def page_buffer(self, page_id: int) -> np.ndarray | torch.Tensor:
        """Rank 0's page (the home copy); whoever asks may write it, so no remote copy stays current."""
        self._stale(pages=[page_id])
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
        self._stale(slots=[dst])

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
            self._stale(slots=[slot])
        return self.runner.state_buffers(slot)

    def resume_state_slot(self, slot: int, last_cached_page: int) -> None:
        self.runner.resume_state_slot(slot, last_cached_page)
        self._stale(slots=[slot])

    def warmup(self) -> None:
        """A tiny prefill and decode through every rank (page 0 and slot 0 left as garbage)."""
        logger.info("EP warmup took %.2f s", warm_up(self.forward, self.page_size, self.config.bos_token_id))


def _wait(work, bound: datetime.timedelta) -> None:
    """Wait for a point-to-point op (torch.distributed isend / irecv) within `bound`;
    RuntimeError past it."""
    assert work is not None, "point-to-point ops return their work outside a coalescing manager"
    work.wait(bound)
