"""The start-up both model services (prefill and decode) share, as one object whose methods are
its steps. Each service's `serve` calls them in its own order around its own parts (the engine,
the servicer, the KV transport), then hands over to kvmesh.runtime.lifecycle:

    start = ModelStart.open("prefill", config, executor, "kvmesh.v1.Prefill")  # device, model, port, name
    runner = await start.load_runner(num_state_slots)   # on the main thread
    tier = start.open_tier(runner.page_layout)
    ...                                                 # engine, servicer on start.svc.server
    start.serve_metrics(registry)
    life = await start.open_ports()                     # health NOT_SERVING while the model warms
    await start.on_main(runner.warmup)
    registration, leave = start.register(model, writer, resync)
    await life.serve(stop, banner, registration, release=[..., leave])

The shutdown order is the service's `release` list and Lifecycle's (leave the registry, stop
admitting, drain, stop the server, release in the order given).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from kvmesh.engine.checkpoint import ModelFiles
from kvmesh.engine.device import resolve_device
from kvmesh.engine.forward import Runner
from kvmesh.engine.kv_layout import PageLayout
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.precision import Precision, apply_quantization
from kvmesh.engine.runners import create_runner, runner_precision
from kvmesh.kvstore.kv_publisher import KVEventPublisher
from kvmesh.kvstore.kv_tier import KVTier, create_tier
from kvmesh.kvstore.registry import InstanceRecord, InstanceRegistry
from kvmesh.runtime import service
from kvmesh.runtime.kv_index import KVIndexWriter
from kvmesh.runtime.lifecycle import Lifecycle
from kvmesh.runtime.registration import Registration
from kvmesh.runtime.served_model import ServedModel
from kvmesh.runtime.service_config import ModelServiceConfig

logger = logging.getLogger(__name__)


class ModelStart:
    """One prefill or decode process on its way up: the device, checkpoint and precision it
    serves, its gRPC server (bound, not started) and its name. Built by `open`.

    Attributes:
        role: "prefill" or "decode" (its registry record and its KV events say it).
        address: host:port others dial (ModelServiceConfig.reachable_address).
        instance_id: --instance-id, else a name made from `address`.
        precision: what --dtype resolved to here, and why (logged at open).
    """

    def __init__(
        self,
        role: str,
        config: ModelServiceConfig,
        executor: service.MainThreadExecutor,
        device: torch.device,
        files: ModelFiles,
        svc: service.Service,
        instance_id: str,
        precision: Precision,
    ) -> None:
        self.role, self.config, self.executor = role, config, executor
        self.device, self.files, self.svc, self.precision = device, files, svc, precision
        self.address = config.reachable_address(svc.port)
        self.instance_id = instance_id

    @classmethod
    def open(
        cls,
        role: str,
        config: ModelServiceConfig,
        executor: service.MainThreadExecutor,
        service_name: str,
        check_files: Callable[[ModelFiles], None] | None = None,
        default_id: Callable[[str], str] = str,
    ) -> ModelStart:
        """Resolve the device (one this machine lacks is refused before any port opens) and the
        checkpoint, check it (`check_files`, raising ValueError), resolve --dtype for it (a dtype its
        family does not compute is refused, ValueError) and log the choice, bind the gRPC port of
        `service_name` ("kvmesh.v1.Prefill") and name the instance: --instance-id, else
        `default_id(address)`. Raises ValueError, or OSError when the port cannot be bound."""
        device = resolve_device(config.device)
        files = resolve_model(config.model)
        if check_files is not None:
            check_files(files)
        precision = runner_precision(files, device, config.dtype)
        svc = service.Service([service_name], config.host, config.port)
        instance_id = config.instance_id or default_id(config.reachable_address(svc.port))
        logger.info("%s %s computes in %s (%s)", role, instance_id, precision.name, precision.reason)
        return cls(role, config, executor, device, files, svc, instance_id, precision)

    async def on_main(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the main thread, where torch is fastest (service.MainThreadExecutor)."""
        return await asyncio.wrap_future(self.executor.submit(fn, *args))

    async def load_runner(self, num_state_slots: int) -> Runner:
        """The model's runner (kvmesh.engine.runners.create_runner) with the configured pages, page
        size and kernels, and `num_state_slots` state slots, on the device, its matmuls' activations
        as --quantization says (ValueError where it cannot run)."""
        config = self.config
        # on the main thread: an OpenMP team made on another thread throttles every team's spin-waits
        await self.on_main(service.set_torch_threads, config.torch_threads)
        runner = await self.on_main(
            create_runner,
            self.files,
            config.num_pages,
            config.page_size,
            num_state_slots,
            config.kernel_backend,
            self.device,
            self.precision.name,
        )
        how = await self.on_main(apply_quantization, runner, config.quantization)
        logger.info("%s %s: %s (--quantization %s)", self.role, self.instance_id, how, config.quantization)
        return runner

    def index_writer(self) -> KVIndexWriter:
        """This instance's KV events on their way to the prefix index (its old entries cleared now)."""
        return KVIndexWriter(self.config.redis_url, self.files.name, self.instance_id, self.role)

    def open_tier(self, layout: PageLayout) -> KVTier | None:
        """The second KV tier the settings ask for, of pages of `layout` (None: none)."""
        config = self.config
        return create_tier(
            config.kv_tier_blocks,
            layout.page_nbytes,
            config.kv_tier_dir,
            self.device.type,
            self.instance_id,
            layout.describe(),
        )

    def served_model(self) -> ServedModel:
        """The checkpoint as this instance serves it (what its servicer checks requests against)."""
        return ServedModel.of(self.files, self.instance_id)

    def serve_metrics(self, registry) -> None:
        """Prometheus /metrics of `registry` on --metrics-port (0: none)."""
        service.start_metrics_server(self.config.metrics_port, self.config.host, registry)

    async def open_ports(self) -> Lifecycle:
        """Start the gRPC server; health says NOT_SERVING until the Lifecycle's `serve`."""
        life = Lifecycle(self.svc, self.config.drain_grace_s)
        await life.start()
        return life

    def register(
        self,
        model: ServedModel,
        writer: KVIndexWriter | None,
        resync: Callable[[KVEventPublisher], Awaitable[None]] | None = None,
    ) -> tuple[Registration | None, Callable[[], Awaitable[None] | None] | None]:
        """This instance's registry entry, kept from `Lifecycle.serve` on, and what to release at
        shutdown for it; (None, None) without --redis-url.

        writer: the instance's KV index writer: the entry lives in its index's registry, and
        after a renewal that found the index had forgotten this instance (or dropped events)
        `resync(writer.publisher)` re-publishes the cache; writer.leave is released. None: a
        registry client of its own, closed at shutdown.
        """
        if not self.config.redis_url:
            return None, None
        record = InstanceRecord(self.instance_id, self.role, self.address, model.fingerprint, self.config.page_size)
        ttl_s = self.config.lease_ttl_s
        if writer is not None:
            assert resync is not None, "a writer's registration re-publishes the cache"
            publisher = writer.publisher
            after_beat = writer.after_beat(lambda: resync(publisher))
            return Registration(writer.index.registry, record, ttl_s, after_beat=after_beat), writer.leave
        registry = InstanceRegistry.from_url(self.config.redis_url, model=self.files.name)
        return Registration(registry, record, ttl_s), registry.close
