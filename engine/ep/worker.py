# P=pages, R=state slots, B=sequences of this rank, V=vocab
"""Ranks 1..N-1 of expert-parallel decode: processes that hold the model and their share of the
routed experts, and run their share of each step when rank 0 says so (kvmesh.engine.ep.runner is rank 0).

Control and data take different roads. Rank 0 sends each step's plan (this rank's sequences,
its first global token index, a placement to load first, pages and state slots to take or give
back) over a control link (kvmesh.engine.ep.link: a pipe, or an authenticated TCP connection to a rank
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
  it wrote (`StepPlan.writeback_*`) after, both over torch.distributed point-to-point, so rank
  0's pool stays whole (KV pushes land there; decode's prefix cache reads it). SGLang's DP
  attention keeps a pool a rank; here rank 0's is the home copy and a rank's is a cache.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.engine.ep.link import STOP, Link
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.kv_layout import flat_layout
from kvmesh.kvstore.shared_memory import HEADER_NBYTES, RegionDescriptor, map_region

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.checkpoint import ModelFiles

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
    region: RegionDescriptor | None
    """Rank 0's shared region holding pages, then slots; None: ranks on other hosts, each with
    a mirror of the pool (rank 0 moves pages and slots over torch.distributed)."""
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
    store_host: str = "127.0.0.1"
    """Where rank 0's TCP store listens (its address on the EP network for remote ranks)."""
    config_digest: str = ""
    """sha256 of rank 0's config.json: a remote rank refuses to join with a different model."""


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
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.num_ranks, is_master=False, timeout=timeout)
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


def config_digest(files: ModelFiles) -> str:
    """sha256 of the checkpoint's config.json (ranks on other hosts must load the same model)."""
    return hashlib.sha256((files.checkpoint_dir / "config.json").read_bytes()).hexdigest()


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
        unpack(recv_from_zero(numel, spec), plan.install_pages, plan.install_slots, pages, slots)
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


def pack_size(page_ids: Sequence[int], slot_ids: Sequence[int], pages, slots) -> int:
    """Floats of pack(page_ids, slot_ids, ...)."""
    return len(page_ids) * pages.shape[1] + len(slot_ids) * slots.shape[1]


def pack(page_ids: Sequence[int], slot_ids: Sequence[int], pages, slots):
    """The pages' rows [n, page_floats] then the slots' rows [m, slot_floats], as one flat fp32
    tensor (what moves between rank 0 and a remote rank)."""
    import torch

    return torch.cat([pages[list(page_ids)].reshape(-1), slots[list(slot_ids)].reshape(-1)])


def unpack(flat, page_ids: Sequence[int], slot_ids: Sequence[int], pages, slots) -> None:
    """Write pack's output back into pages and slots (in place)."""
    n = len(page_ids) * pages.shape[1]
    if page_ids:
        pages[list(page_ids)] = flat[:n].view(len(page_ids), pages.shape[1])
    if slot_ids:
        slots[list(slot_ids)] = flat[n:].view(len(slot_ids), slots.shape[1])


def recv_from_zero(numel: int, spec: WorldSpec):
    """numel fp32 from rank 0, point-to-point, within the group's timeout (RuntimeError past it)."""
    import torch
    import torch.distributed as dist

    flat = torch.empty(numel, dtype=torch.float32)
    work = dist.irecv(flat, src=0)
    assert work is not None, "point-to-point ops return their work outside a coalescing manager"
    work.wait(datetime.timedelta(seconds=spec.timeout_s))
    return flat


def _placement(arrays: tuple[np.ndarray, np.ndarray], num_ranks: int):
    from kvmesh.engine.ep.eplb import Placement

    return Placement(np.asarray(arrays[0], np.int64), np.asarray(arrays[1], np.int64), num_ranks)


def _build(spec: WorldSpec, rank: int):
    """(model, its ExpertParallelMoE, pages [P, page_floats], slots [R, slot_floats]) of a worker."""
    import torch

    from kvmesh.engine.checkpoint import load_checkpoint_tensors
    from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
    from kvmesh.engine.deepseek_v4.state import V4StateLayout
    from kvmesh.engine.deepseek_v4.weights import has_mtp
    from kvmesh.engine.ep.dispatch import ExpertParallelMoE
    from kvmesh.engine.ep.expert_weights import CheckpointExperts, rank_keeps
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
    pages, slots = memory.pages, memory.slots
    logger.info("rank %d ready: %d pages, %d slots %s", rank, spec.num_pages, spec.num_state_slots, where)
    return model, moe, pages, slots
