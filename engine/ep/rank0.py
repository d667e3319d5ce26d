# B=sequences of the step, N=hidden streams (hc_mult), H=hidden, L=MoE layers, E=experts, R=ranks
"""Rank 0's hold on the expert-parallel world: it brings the world up, keeps the placement and
the loads the exchanges measure, and takes the world down. `ExpertParallelRunner`
(kvmesh.engine.ep.runner) is the runner on top of it, which steps the world.

Bringing the world up, in this order: check the arguments; find rank 0's pool in its shared
region (ranks on this host map it); host the TCP store every rank joins over; build the
`WorldSpec` (kvmesh.engine.ep.world); spawn ranks 1..N-1 on this host or wait for them to join
from other hosts (kvmesh.engine.ep.ranks); hand remote ranks the spec; wait for every rank's
hello; join the process group; put the MoE over the ranks (kvmesh.engine.ep.dispatch) into rank
0's model, which then keeps its slots' experts only, as every rank; wait for every rank's ready.
A failure anywhere after the ranks started stops them again.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmesh.engine.ep.dispatch import EPLoads, EPTimes, ExpertParallelMoE, check_placement
from kvmesh.engine.ep.eplb import Placement, default_placement
from kvmesh.engine.ep.expert_weights import CheckpointExperts
from kvmesh.engine.ep.mirrors import Mirrors
from kvmesh.engine.ep.ranks import RankProcesses, RemoteRanks, pick_backend
from kvmesh.engine.ep.world import WorldSpec, comm_device, config_digest, init_world
from kvmesh.kvstore.shared_memory import RegionDescriptor, locate

if TYPE_CHECKING:
    from kvmesh.engine.checkpoint import ModelFiles
    from kvmesh.engine.deepseek_v4.runner import DeepseekV4Runner

logger = logging.getLogger(__name__)


class RankZeroWorld:
    """Rank 0's side of the EP world: its ranks, its MoE over them, its placement and loads,
    and what a step needs to know about where sequences and pages live. The arguments are
    ExpertParallelRunner's (it says what each means and what is raised)."""

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
        _check_arguments(runner, num_ranks, gather_streams, init_addr, authkey)
        self.gather_streams = gather_streams
        self.remote = init_addr is not None
        """Ranks on other hosts, each with its own mirror of the pool (no shared memory)."""
        c = runner.model.config
        placement = placement or default_placement(c.num_hidden_layers, c.n_routed_experts, num_ranks)
        check_placement(placement, c.num_hidden_layers, c.n_routed_experts, num_ranks)
        self.runner, self.num_ranks = runner, num_ranks
        self.config, self.page_size, self.num_pages = runner.config, runner.page_size, runner.num_pages
        self.page_nbytes, self.num_state_slots = runner.page_nbytes, runner.num_state_slots
        self.page_layout, self.dtype = runner.page_layout, runner.dtype
        self.backend = pick_backend(num_ranks) if backend == "auto" else backend
        self.timeout_s = timeout_s
        self._pending: Placement | None = None
        self._broken = ""
        self._last_hidden = torch.zeros(0, c.hc_mult, c.hidden_size)  # [B, N, H] (MTP checkpoints)
        region = None if self.remote else _shared_region(runner)
        self.mirrors = Mirrors(num_ranks, self.page_size, self.remote)
        self._owner: dict[int, int] = {}  # state slot of a sequence -> the rank that ran it last
        self.times = EPTimes()
        """Rank 0's seconds in each part of the exchanges since start (kvmesh.engine.ep.dispatch)."""
        store = _host_store(init_addr[0] if init_addr else "127.0.0.1", num_ranks, start_timeout_s)
        spec = self._world_spec(files, store.port, region, placement, kernel_backend, torch_threads)
        self.ranks = _start_ranks(spec, init_addr, authkey, start_timeout_s)
        try:
            self._join(spec, store, files, placement, start_timeout_s)
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

    def _world_spec(
        self,
        files: ModelFiles,
        store_port: int,
        region: tuple[RegionDescriptor, int] | None,
        placement: Placement,
        kernel_backend: str,
        torch_threads: int,
    ) -> WorldSpec:
        """What every rank joins with: the checkpoint, the store, rank 0's pool (`region`: its
        shared region and its byte offset there; None with ranks on other hosts), the placement."""
        descriptor, offset = region if region is not None else (None, 0)
        runner = self.runner
        return WorldSpec(
            files,
            self.num_ranks,
            store_port,
            self.backend,
            self.timeout_s,
            descriptor,
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

    def _join(
        self,
        spec: WorldSpec,
        store: torch.distributed.TCPStore,
        files: ModelFiles,
        placement: Placement,
        timeout_s: float,
    ) -> None:
        """Hand remote ranks the spec, wait for every rank's hello, join the process group, put
        the MoE over the ranks into rank 0's model, wait for every rank's ready (each wait
        within timeout_s). EPWorldError naming a rank that failed, exited or did not report."""
        for link in self.ranks.links if self.remote else ():
            link.send(("spec", spec))
        self.ranks.await_all("hello", timeout_s)
        init_world(spec, 0, store)
        self._store = store
        c = self.runner.model.config
        experts = CheckpointExperts(files.checkpoint_dir, c.num_hidden_layers, c.n_routed_experts)
        self.moe = ExpertParallelMoE(
            self.runner.model,
            0,
            self.num_ranks,
            placement,
            experts,
            device=comm_device(self.backend, 0),
            times=self.times,
        )
        self.runner.model.routed_experts = self.moe
        self.runner.model.drop_routed_experts()  # rank 0 keeps its slots' experts only, as every rank
        ready = self.ranks.await_all("ready", timeout_s)
        self.expert_nbytes = [self.moe.expert_nbytes(), *(int(ready[w]) for w in range(self.num_ranks - 1))]
        """Bytes of routed-expert weights each rank held when it started (its slots' only)."""

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


def _check_arguments(
    runner: DeepseekV4Runner, num_ranks: int, gather_streams: bool, init_addr: tuple[str, int] | None, authkey: bytes
) -> None:
    """Raise ValueError for fewer than 2 ranks, gather_streams without an MTP module or with
    ranks on other hosts, or init_addr without a key (before anything starts)."""
    if num_ranks < 2:
        raise ValueError(f"expert-parallel decode needs >= 2 ranks, got {num_ranks}")
    if gather_streams and not runner.has_mtp:
        raise ValueError(f"{runner.config.name!r} has no multi-token-prediction module: no streams to gather")
    if init_addr is not None and gather_streams:
        raise ValueError("MTP drafting with EP ranks on other hosts is not built yet: use --speculative off or ngram")
    if init_addr is not None and not authkey:
        raise ValueError("EP ranks on other hosts need a shared key: set KVMESH_EP_SECRET on every rank")


def _shared_region(runner: DeepseekV4Runner) -> tuple[RegionDescriptor, int]:
    """The shared region holding rank 0's pages and their byte offset in its pool (ranks on
    this host map it). Raises ValueError when the pages are in none."""
    found = locate([runner.pages.data_ptr()], [runner.pages.numel() * 4])
    if found is None:
        raise ValueError("the runner's pages are not in a shared region; EP ranks could not reach them")
    region, (offset,) = found
    return region, offset


def _host_store(host: str, num_ranks: int, start_timeout_s: float) -> torch.distributed.TCPStore:
    """The TCP store every rank joins the process group over, on a free port of `host`; it
    waits start_timeout_s seconds for the ranks."""
    return torch.distributed.TCPStore(
        host,
        0,
        num_ranks,
        is_master=True,
        timeout=datetime.timedelta(seconds=start_timeout_s),
        wait_for_workers=False,
    )


def _start_ranks(
    spec: WorldSpec, init_addr: tuple[str, int] | None, authkey: bytes, start_timeout_s: float
) -> RankProcesses | RemoteRanks:
    """Ranks 1..N-1: spawned on this host (init_addr None), or joined from other hosts at
    init_addr, authenticated by `authkey`. OSError when init_addr cannot be bound,
    EPWorldError naming the ranks that did not join within start_timeout_s."""
    if init_addr is None:
        return RankProcesses(spec)
    return RemoteRanks(init_addr[0], init_addr[1], num_ranks=spec.num_ranks, authkey=authkey, timeout_s=start_timeout_s)
