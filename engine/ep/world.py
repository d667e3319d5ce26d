"""The expert-parallel world every rank joins: what it joins with (`WorldSpec`, which rank 0
builds and hands to ranks 1..N-1), how it joins (`init_world`, the torch.distributed process
group over rank 0's TCP store), where its collective buffers live (`comm_device`), and the check
that a rank on another host serves the same model as rank 0 (`config_digest`).
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.kvstore.shared_memory import RegionDescriptor

if TYPE_CHECKING:
    from kvmesh.engine.checkpoint import ModelFiles


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


def config_digest(files: ModelFiles) -> str:
    """sha256 of the checkpoint's config.json (ranks on other hosts must load the same model)."""
    return hashlib.sha256((files.checkpoint_dir / "config.json").read_bytes()).hexdigest()
