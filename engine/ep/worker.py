# P=pages, R=state slots, B=sequences of this rank, V=vocab
"""Ranks 1..N-1 of expert-parallel decode: processes that hold the model and their share of the
routed experts, and run their share of each step when rank 0 says so (kvmesh.engine.ep.runner is rank 0).

Control and data take different roads. Rank 0 sends each step's plan (kvmesh.engine.ep.plan:
this rank's sequences, its first global token index, a placement to load first, pages and state
slots to take or give back) over a control link (kvmesh.engine.ep.link: a pipe, or an authenticated TCP connection to a rank
on another host), so an idle rank waits for work without a collective timing out; the step's
data (pages and slots, the MoE dispatch and combine, kvmesh.engine.ep.dispatch, and the logits
gathered to rank 0) goes over torch.distributed, every wait bounded by the process group's
timeout. A rank that loses rank 0 (its parent gone, its link closed or silent) exits within
seconds; one whose step fails sends rank 0 the traceback and exits, so rank 0's collective
fails at once and names the cause.

Where the KV pages and state slots live depends on the host:
- a rank spawned on rank 0's host (`worker_main`) maps rank 0's shared-memory region
  (kvmesh.kvstore.shared_memory) writable through /proc/PID/fd/FD, so whichever rank runs a
  sequence's attention reads and extends the same pages;
- a rank on another host (`remote_main`, `kvmesh serve ep-rank`) holds a mirror of the pool in
  its own memory: rank 0 sends it the pages and slots of the sequences it runs that it lacks
  (or holds stale) before the step (`StepPlan.install_*`) and it sends back the pages and slots
  it wrote (`StepPlan.writeback_*`) after, both over torch.distributed point-to-point
(kvmesh.engine.ep.transfer), so rank
  0's pool stays whole (KV pushes land there; decode's prefix cache reads it). SGLang's DP
  attention keeps a pool a rank; here rank 0's is the home copy and a rank's is a cache.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.engine.ep.link import STOP, Link
from kvmesh.engine.ep.transfer import gather_rows, pack, pack_size, recv_from_zero, stream_width, unpack
from kvmesh.engine.ep.world import WorldSpec, comm_device, config_digest, init_world
from kvmesh.engine.kv_layout import flat_layout
from kvmesh.kvstore.shared_memory import HEADER_NBYTES, map_region

if TYPE_CHECKING:
    from kvmesh.engine.checkpoint import ModelFiles
    from kvmesh.engine.ep.plan import StepPlan

logger = logging.getLogger(__name__)


def worker_main(spec: WorldSpec, rank: int, conn) -> None:
    """Entry point of rank `rank` spawned on rank 0's host: say hello, join the world, load the
    model, map rank 0's pages, say ready (with the bytes of routed experts it holds), then run
    steps until rank 0 sends STOP or goes away (its parent pid changes)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s ep-rank-{rank} %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    link = Link(conn, "rank-0")
    run_rank(spec, rank, link, lambda: os.getppid() != parent)


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float):
    """A connection to rank 0's control address, authenticated with `authkey`, retried once a
    second while rank 0 is not listening yet (it may start after its ranks). Raises OSError
    after timeout_s seconds, multiprocessing.AuthenticationError for a wrong key."""
    from multiprocessing.connection import Client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise OSError(
                    f"rank 0 at {address[0]}:{address[1]} not reachable within {timeout_s:.0f} s: {exc}"
                ) from exc
            time.sleep(1.0)


def remote_main(conn, address: tuple[str, int], rank: int, files: ModelFiles, torch_threads: int = 0) -> int:
    """Rank `rank` on another host than rank 0 (`kvmesh serve ep-rank`), over `conn` (connect's):
    say hello, take the WorldSpec rank 0 sends (with this host's copy of the model, which must
    be the same: config.json's sha256), then join and run as worker_main does, with a mirror of
    the page pool. Returns 0 when rank 0 ended the world (STOP on the link), 1 when rank 0 was
    lost; SystemExit(1) when this rank failed. Raises OSError when rank 0 sends no spec within
    60 s, ValueError when the models differ."""
    link = Link(conn, "rank-0")
    link.send(("hello", rank))
    msg = link.get(60.0)
    if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "spec" and isinstance(msg[1], WorldSpec)):
        link.close()
        raise OSError(f"rank 0 at {address[0]}:{address[1]} sent no world spec within 60 s (got {msg!r:.80})")
    spec: WorldSpec = msg[1]
    if spec.config_digest and config_digest(files) != spec.config_digest:
        link.send(("error", f"rank {rank}: {files.checkpoint_dir}/config.json differs from rank 0's"))
        link.close()
        raise ValueError(f"{files.checkpoint_dir}/config.json differs from rank 0's: serve the same model")
    spec = replace(spec, files=files, store_host=address[0], torch_threads=torch_threads or spec.torch_threads)
    # rank 0 silent for a whole collective timeout is gone (a slow rank 0 still beats)
    return run_rank(spec, rank, link, lambda: link.silent_s > spec.timeout_s)


def run_rank(spec: WorldSpec, rank: int, link: Link, lost: Callable[[], bool]) -> int:
    """Join the world, build the model, say ready, then run steps from `link` until rank 0 sends
    STOP (returns 0) or `lost()` says rank 0 is gone (returns 1). A failure is sent to rank 0
    as ("error", traceback) and ends the process (SystemExit 1)."""
    try:
        import torch

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        link.send(("hello", rank))
        init_world(spec, rank)
        model, moe, pages, slots = _build(spec, rank)
        link.send(("ready", moe.expert_nbytes()))
        while True:
            msg = link.get(1.0)
            if msg is None:
                if link.closed.is_set() or lost():
                    logger.info("rank 0 is gone; leaving the world")
                    return 1
                continue
            if msg == STOP:
                break
            step(spec, rank, msg, model, moe, pages, slots)
        logger.info("rank 0 ended the world")
        logging.shutdown()
        if spec.region is not None:  # a spawned rank leaves at once: no teardown to wait on
            os._exit(0)
        return 0
    except BaseException:
        text = traceback.format_exc()
        logger.error("rank %d failed:\n%s", rank, text)
        try:
            link.send(("error", text))
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from None


def step(spec: WorldSpec, rank: int, plan: StepPlan, model, moe, pages, slots) -> None:
    """This rank's share of one step: take the pages and slots rank 0 sends, load a new
    placement, run its rows (or join the exchanges idle), gather logits (and streams) to rank 0,
    send back what it wrote. Every transfer is a collective or a point-to-point op bounded by
    the group's timeout (RuntimeError past it)."""
    if plan.install_pages or plan.install_slots:
        numel = pack_size(plan.install_pages, plan.install_slots, pages, slots)
        unpack(recv_from_zero(numel, spec.timeout_s), plan.install_pages, plan.install_slots, pages, slots)
    if plan.placement is not None:
        moe.load_placement(_placement(plan.placement, spec.num_ranks))
    moe.token_offset = plan.token_offset
    logits = None
    if plan.items:
        logits = model.forward(plan.items, pages, slots)
    else:
        moe.idle_forward()
    gather_rows(logits, plan.max_rows, model.config.vocab_size, spec.backend, rank)
    if plan.streams:
        streams = model.last_streams.reshape(len(plan.items), -1) if plan.items else None
        gather_rows(streams, plan.max_rows, stream_width(model.config), spec.backend, rank)
    if plan.writeback_pages or plan.writeback_slots:
        import torch.distributed as dist

        dist.send(pack(plan.writeback_pages, plan.writeback_slots, pages, slots), dst=0)


def _placement(arrays: tuple[np.ndarray, np.ndarray], num_ranks: int):
    from kvmesh.engine.ep.eplb import Placement

    return Placement(np.asarray(arrays[0], np.int64), np.asarray(arrays[1], np.int64), num_ranks)


def _build(spec: WorldSpec, rank: int):
    """(model, its ExpertParallelMoE, pages [P, page_floats], slots [R, slot_floats]) of a worker."""
    from kvmesh.engine.ep.dispatch import ExpertParallelMoE
    from kvmesh.engine.ep.expert_weights import CheckpointExperts

    model = _load_model(spec, rank)
    c = model.config
    moe = ExpertParallelMoE(
        model,
        rank,
        spec.num_ranks,
        _placement((spec.phy2log, spec.replicas), spec.num_ranks),
        CheckpointExperts(spec.files.checkpoint_dir, c.num_hidden_layers, c.n_routed_experts),
        device=comm_device(spec.backend, rank),
    )
    model.routed_experts = moe
    pages, slots = _pool(spec, model.layout, rank)
    return model, moe, pages, slots


def _load_model(spec: WorldSpec, rank: int):
    """The rank's DeepseekV4Model without the main layers' routed experts (its
    ExpertParallelMoE reads its slots' own), in rank 0's state layout. RuntimeError when the
    layout's state slots differ from rank 0's."""
    from kvmesh.engine.checkpoint import load_checkpoint_tensors
    from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
    from kvmesh.engine.deepseek_v4.state import V4StateLayout
    from kvmesh.engine.deepseek_v4.weights import has_mtp
    from kvmesh.engine.ep.expert_weights import rank_keeps
    from kvmesh.engine.loader import load_deepseek_v4_config as load_v4_config
    from kvmesh.kernels.backend import create_kernel_backend

    hf_config = load_v4_config(spec.files.checkpoint_dir, spec.files.name)
    # every tensor but the main layers' routed experts: the rank reads only its slots' experts
    tensors = load_checkpoint_tensors(spec.files.checkpoint_dir, keep=rank_keeps)
    # the layout rank 0's runner built (an MTP checkpoint's slots hold the last hidden streams
    # too), or this rank would read rank 0's shared pages and slots at the wrong offsets
    layout = V4StateLayout.from_config(hf_config, spec.page_size, mtp=has_mtp(tensors))
    if spec.slot_floats and layout.slot_floats != spec.slot_floats:
        raise RuntimeError(f"rank {rank}: state slots of {layout.slot_floats} floats, rank 0's hold {spec.slot_floats}")
    return DeepseekV4Model(
        hf_config,
        tensors,
        layout,
        spec.files.name,
        create_kernel_backend(spec.kernel_backend),
        routed_experts_here=False,
    )


def _pool(spec: WorldSpec, layout, rank: int):
    """(pages [P, page_floats], slots [R, slot_floats]) fp32 the rank's attention reads and
    writes: rank 0's shared region mapped writable on its host, else a zeroed mirror of rank
    0's pool that rank 0 fills page by page (`step`)."""
    import torch

    page_numel, slot_numel = spec.num_pages * layout.page_floats, spec.num_state_slots * layout.slot_floats
    if spec.region is None:  # another host: a mirror of rank 0's pool, filled as rank 0 sends pages
        state = torch.zeros(page_numel + slot_numel, dtype=torch.float32)
        where = "held here (a mirror of rank 0's)"
    else:
        region = map_region(spec.region, writable=True)
        state = torch.frombuffer(
            region, dtype=torch.float32, count=page_numel + slot_numel, offset=HEADER_NBYTES + spec.state_offset
        )
        where = f"mapped from pid {spec.region.pid}"
    memory = flat_layout(layout.page_floats, layout.slot_floats).split(state, spec.num_pages, spec.num_state_slots)
    logger.info("rank %d ready: %d pages, %d slots %s", rank, spec.num_pages, spec.num_state_slots, where)
    return memory.pages, memory.slots
