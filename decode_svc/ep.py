# L=MoE layers, P=physical expert slots, E=experts, R=ranks
"""`kvmesh serve decode --ep N`: this decode process becomes rank 0 of N expert-parallel ranks
(kvmesh.engine.ep.runner) for a MoE checkpoint; the dense default model keeps single-process decode.

`--eplb-placement FILE` places the experts per an EPLB plan: the JSON `kvmesh eplb plan --ranks
N --redundant X --json STATS` prints ({"phy2log": [[...]], "replicas": [[...]], ...}). The file
is read again when it changes (checked at most once a second, between steps), so an operator
can re-plan from `kvmesh eplb stats` and load the new placement without dropping a request.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvmesh.engine.checkpoint import ModelFiles, architecture
from kvmesh.engine.device import resolve_device
from kvmesh.engine.ep.eplb import Placement
from kvmesh.engine.ep.link import ep_secret, parse_init_addr
from kvmesh.engine.ep.runner import ExpertParallelRunner
from kvmesh.engine.forward import ForwardItem

logger = logging.getLogger(__name__)


def load_placement_file(path: str, num_ranks: int) -> Placement:
    """The placement in `path` (`kvmesh eplb plan --json` output) for num_ranks ranks. Raises
    ValueError naming what is missing or malformed, OSError when it cannot be read."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or "phy2log" not in data or "replicas" not in data:
        raise ValueError(f'{path}: expected `kvmesh eplb plan --json` output with "phy2log" and "replicas"')
    try:
        phy2log = np.array(data["phy2log"], dtype=np.int64)
        replicas = np.array(data["replicas"], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: phy2log and replicas must be [layers][slots] integer lists ({exc})") from None
    return Placement(phy2log, replicas, num_ranks)


class ServiceEPRunner(ExpertParallelRunner):
    """The EP runner of a decode service: reloads --eplb-placement when the file changes."""

    def __init__(self, *args, placement_file: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.placement_file = placement_file
        self._mtime = os.stat(placement_file).st_mtime_ns if placement_file else 0
        self._checked = time.monotonic()

    def forward(self, items: Sequence[ForwardItem]):
        if self.placement_file and time.monotonic() - self._checked >= 1.0:
            self._checked = time.monotonic()
            self._maybe_reload()
        return super().forward(items)

    def _maybe_reload(self) -> None:
        try:
            mtime = os.stat(self.placement_file).st_mtime_ns
            if mtime == self._mtime:
                return
            self._mtime = mtime
            self.set_placement(load_placement_file(self.placement_file, self.num_ranks))
        except (OSError, ValueError) as exc:  # a half-written or bad file: keep the placement in use
            logger.warning("not loading %s: %s", self.placement_file, exc)
            return
        logger.info("loading the EPLB placement in %s before the next step", self.placement_file)


def serve_rank(model: str, init_addr: str, rank: int, torch_threads: int = 0, join_timeout_s: float = 600.0) -> int:
    """`kvmesh serve ep-rank`: be rank `rank` of a decode's expert-parallel world from another
    host. Connects to the decode's --ep-init-addr (retrying while it is not up yet, for
    join_timeout_s seconds), loads this host's copy of `model` (a path or a known name; the same
    config.json as rank 0's), keeps a mirror of the page pool, and runs steps until the decode
    ends the world (returns 0) or is lost (returns 1); run it under a supervisor that restarts
    it, as Kubernetes does, to rejoin the decode's next world. Raises ValueError for a model
    without MoE layers, a bad address or rank, or a missing KVMESH_EP_SECRET; OSError when rank
    0 is not reachable in time."""
    from kvmesh.engine.ep.worker import connect, remote_main
    from kvmesh.engine.loader import resolve_model

    address = parse_init_addr(init_addr)
    if rank < 1:
        raise ValueError(f"--rank must be >= 1 (rank 0 is the decode service), got {rank}")
    files = resolve_model(model)
    check_ep_model(files, 2)
    authkey = ep_secret()
    logger.info("EP rank %d: joining %s:%d with %s", rank, *address, files.name)
    conn = connect(address, authkey, join_timeout_s)
    return remote_main(conn, address, rank, files, torch_threads)


MOE_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
"""Architectures whose runner can run expert-parallel."""


def check_ep_model(files: ModelFiles, num_ranks: int, device: str = "cpu") -> None:
    """Before anything loads: ValueError when --ep > 1 is asked of a model without MoE layers, or
    on a GPU (the ranks share host memory and talk over gloo: CPU only so far)."""
    if num_ranks > 1 and resolve_device(device).type != "cpu":
        raise ValueError(f"--ep {num_ranks} runs on the CPU only so far (shared-memory pages, gloo); use --device cpu")
    if num_ranks > 1 and architecture(files) not in MOE_ARCHITECTURES:
        raise ValueError(
            f"--ep {num_ranks} needs a MoE model ({', '.join(MOE_ARCHITECTURES)}); {files.name!r} is "
            f"{architecture(files)}, a dense model: serve it with --ep 1 (single-process decode)"
        )


def create_ep_runner(runner, files: ModelFiles, config):
    """`runner` itself when config.ep == 1, else rank 0 of config.ep EP ranks around it.

    With --ep-init-addr the ranks join from other hosts (`kvmesh serve ep-rank`, `serve_rank`).
    Raises ValueError when --ep is set for a model without MoE layers (the dense default model
    decodes in one process), for a bad --eplb-placement, or one that does not fit the model,
    or --ep-init-addr without KVMESH_EP_SECRET; EPWorldError (kvmesh.engine.ep.ranks) when a rank
    fails to start or join."""
    if config.ep <= 1:
        return runner
    check_ep_model(files, config.ep, config.device)
    placement = load_placement_file(config.eplb_placement, config.ep) if config.eplb_placement else None
    init_addr = parse_init_addr(config.ep_init_addr) if config.ep_init_addr else None
    return ServiceEPRunner(
        runner,
        files,
        config.ep,
        placement,
        kernel_backend=config.kernel_backend,
        timeout_s=config.ep_timeout_s,
        torch_threads=config.torch_threads,
        placement_file=config.eplb_placement,
        gather_streams=config.speculative == "mtp",
        init_addr=init_addr,
        authkey=ep_secret() if init_addr else b"",
    )


class RankLoadCollector(Collector):
    """`kvmesh_ep_rank_tokens_total{layer, rank}`: rows each EP rank's experts computed;
    `kvmesh_ep_balancedness{layer}`: their mean over max (measured, not predicted)."""

    def __init__(self, runner: ExpertParallelRunner) -> None:
        self.runner = runner

    def collect(self):
        loads = self.runner.loads
        tokens = CounterMetricFamily(
            "kvmesh_ep_rank_tokens", "Tokens each expert-parallel rank's experts computed", labels=["layer", "rank"]
        )
        balance = GaugeMetricFamily(
            "kvmesh_ep_balancedness", "Mean over max EP rank load, measured, per MoE layer", labels=["layer"]
        )
        for layer, row in enumerate(loads.rank_tokens):
            for rank, n in enumerate(row):
                tokens.add_metric([str(layer), str(rank)], float(n))
        for layer, b in enumerate(loads.balancedness()):
            balance.add_metric([str(layer)], float(b))
        yield tokens
        yield balance


_REGISTERED: dict[int, RankLoadCollector] = {}


def bind_metrics(registry: CollectorRegistry, runner) -> None:
    """Export the EP ranks' measured loads when `runner` is expert-parallel (a later call for
    the same registry replaces the earlier runner)."""
    old = _REGISTERED.pop(id(registry), None)
    if old is not None:
        registry.unregister(old)
    if isinstance(runner, ExpertParallelRunner):
        _REGISTERED[id(registry)] = collector = RankLoadCollector(runner)
        registry.register(collector)
