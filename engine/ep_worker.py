# P=pages, R=state slots, B=sequences of this rank, V=vocab
"""Ranks 1..N-1 of expert-parallel decode: processes that hold the model, map rank 0's pages and
state slots, and run their share of each step when rank 0 says so (engine.ep_runner is rank 0).

Control and data take different roads. Rank 0 sends each step's plan (this rank's sequences,
its first global token index, a placement to load first) over a multiprocessing pipe, so an
idle rank waits for work without a collective timing out; the step's data (the MoE dispatch and
combine, engine.expert_parallel, and the logits gathered to rank 0) goes over torch.distributed,
every wait bounded by the process group's timeout. A worker whose parent is gone exits within a
second; one whose step fails sends rank 0 the traceback and exits, so rank 0's collective fails
at once and names the cause.

KV pages and state slots live in rank 0's shared-memory region (kvstore.shared_memory); a
worker maps it writable through /proc/PID/fd/FD, so whichever rank runs a sequence's attention
reads and extends the same pages (the shared pool SGLang's DP attention keeps per rank is one
pool here, on one host).
"""

from __future__ import annotations

import datetime
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.forward import ForwardItem
from engine.kv_layout import flat_layout
from kvstore.shared_memory import HEADER_NBYTES, RegionDescriptor, map_region

if TYPE_CHECKING:
    import torch

    from engine.checkpoint import ModelFiles

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldSpec:
    """What every rank needs to join the EP world and build its model (picklable)."""

    files: ModelFiles
    num_ranks: int
    store_port: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    """Bound on every collective (and the rendezvous) in seconds."""
    region: RegionDescriptor
    """Rank 0's shared region holding pages, then slots."""
    state_offset: int
    """Byte offset of the pages in the region's pool."""
    num_pages: int
    page_size: int
    num_state_slots: int
    kernel_backend: str
    torch_threads: int
    phy2log: np.ndarray
    replicas: np.ndarray
    slot_floats: int = 0
    """Floats in one of rank 0's state slots (its layout's; 0: not checked)."""


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


def stream_width(config) -> int:
    """Floats of one row's last hidden streams (hc_mult streams of hidden_size)."""
    return config.hc_mult * config.hidden_size


def comm_device(backend: str, rank: int) -> str:
    """Where a rank's collective buffers live: its GPU under NCCL, else the CPU."""
    return f"cuda:{rank}" if backend == "nccl" else "cpu"


def init_world(spec: WorldSpec, rank: int, store=None) -> None:
    """Join the EP process group as `rank` over the TCP store on 127.0.0.1:spec.store_port
    (rank 0 passes the store it hosts). Raises RuntimeError / DistStoreError past spec.timeout_s."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.num_ranks, is_master=False, timeout=timeout)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.num_ranks, timeout=timeout)


def gather_rows(rows: torch.Tensor | None, max_rows: int, width: int, backend: str, rank: int) -> list | None:
    """Every rank's rows [B_r, width] fp32 (its logits, or its last hidden streams flattened)
    padded to [max_rows, width] and gathered to rank 0: the list of R tensors on rank 0, None
    elsewhere. A collective."""
    import torch
    import torch.distributed as dist

    device = comm_device(backend, rank)
    padded = torch.zeros(max_rows, width, dtype=torch.float32, device=device)
    if rows is not None:
        padded[: rows.shape[0]] = rows.to(device)
    if rank:
        dist.gather(padded, None, dst=0)
        return None
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.gather(padded, out, dst=0)
    return [t.cpu() for t in out]


def worker_main(spec: WorldSpec, rank: int, conn) -> None:
    """Entry point of rank `rank` (a spawned process): say hello, join the world, load the
    model, map the pages, say ready (with the bytes of routed experts it holds), then run steps
    until rank 0 sends None or goes away."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s ep-rank-{rank} %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    try:
        import torch

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        conn.send(("hello", rank))
        init_world(spec, rank)
        model, moe, pages, slots = _build(spec, rank)
        conn.send(("ready", moe.expert_nbytes()))
        while True:
            while not conn.poll(1.0):
                if os.getppid() != parent:
                    logger.info("rank 0 is gone; exiting")
                    return
            plan = conn.recv()
            if plan is None:  # leave at once: no collective teardown or interpreter clean-up to wait on
                logging.shutdown()
                os._exit(0)
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
    except EOFError:
        logger.info("rank 0 closed the control pipe; exiting")
    except BaseException:
        text = traceback.format_exc()
        logger.error("rank %d failed:\n%s", rank, text)
        try:
            conn.send(("error", text))
        except OSError:
            pass
        raise SystemExit(1) from None


def _placement(arrays: tuple[np.ndarray, np.ndarray], num_ranks: int):
    from engine.eplb import Placement

    return Placement(np.asarray(arrays[0], np.int64), np.asarray(arrays[1], np.int64), num_ranks)


def _build(spec: WorldSpec, rank: int):
    """(model, its ExpertParallelMoE, pages [P, page_floats], slots [R, slot_floats]) of a worker."""
    import torch

    from engine.checkpoint import load_checkpoint_tensors
    from engine.expert_parallel import ExpertParallelMoE
    from engine.expert_weights import CheckpointExperts, rank_keeps
    from engine.models.deepseek_v4 import DeepseekV4Model
    from engine.models.deepseek_v4_state import V4StateLayout
    from engine.models.deepseek_v4_weights import has_mtp
    from engine.models.deepseek_v4_weights import load_config as load_v4_config
    from kernels.backend import create_kernel_backend

    hf_config = load_v4_config(spec.files.checkpoint_dir, spec.files.name)
    # every tensor but the main layers' routed experts: the rank reads only its slots' experts
    tensors = load_checkpoint_tensors(spec.files.checkpoint_dir, keep=rank_keeps)
    # the layout rank 0's runner built (an MTP checkpoint's slots hold the last hidden streams
    # too), or this rank would read rank 0's shared pages and slots at the wrong offsets
    layout = V4StateLayout.from_config(hf_config, spec.page_size, mtp=has_mtp(tensors))
    if spec.slot_floats and layout.slot_floats != spec.slot_floats:
        raise RuntimeError(f"rank {rank}: state slots of {layout.slot_floats} floats, rank 0's hold {spec.slot_floats}")
    model = DeepseekV4Model(
        hf_config,
        tensors,
        layout,
        spec.files.name,
        create_kernel_backend(spec.kernel_backend),
        routed_experts_here=False,
    )
    del tensors
    moe = ExpertParallelMoE(
        model,
        rank,
        spec.num_ranks,
        _placement((spec.phy2log, spec.replicas), spec.num_ranks),
        CheckpointExperts(spec.files.checkpoint_dir, hf_config.num_hidden_layers, hf_config.n_routed_experts),
        device=comm_device(spec.backend, rank),
    )
    model.routed_experts = moe
    region = map_region(spec.region, writable=True)
    page_numel, slot_numel = spec.num_pages * layout.page_floats, spec.num_state_slots * layout.slot_floats
    state = torch.frombuffer(
        region, dtype=torch.float32, count=page_numel + slot_numel, offset=HEADER_NBYTES + spec.state_offset
    )
    memory = flat_layout(layout.page_floats, layout.slot_floats).split(state, spec.num_pages, spec.num_state_slots)
    pages, slots = memory.pages, memory.slots
    logger.info(
        "rank %d ready: %d pages, %d slots mapped from pid %d",
        rank,
        spec.num_pages,
        spec.num_state_slots,
        spec.region.pid,
    )
    return model, moe, pages, slots
