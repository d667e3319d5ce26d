"""`kvmesh serve decode`: one decode instance (gRPC server + UCX KV receiver + batch loop)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvmesh.decode_svc import ep, metrics
from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.delivery import deliver_on
from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.decode_svc.servicer import DecodeServicer
from kvmesh.engine.device import resolve_device
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.runners import create_runner
from kvmesh.kvstore.kv_tier import create_tier
from kvmesh.kvstore.registry import InstanceRecord, InstanceRegistry
from kvmesh.kvstore.transports import create_receiver, keep_until_exit
from kvmesh.protos.v1 import decode_pb2_grpc
from kvmesh.runtime import lifecycle, service
from kvmesh.runtime.kv_index import KVIndexWriter
from kvmesh.runtime.lifecycle import Lifecycle
from kvmesh.runtime.registration import Registration
from kvmesh.runtime.served_model import ServedModel

logger = logging.getLogger(__name__)


async def serve(config: DecodeConfig, stop: asyncio.Event, executor: service.MainThreadExecutor) -> None:
    """Load the model, start the gRPC server and the UCX listener, serve until stop is set."""
    device = resolve_device(config.device)  # a device this machine lacks: refused before any port opens
    files = resolve_model(config.model)
    ep.check_ep_model(files, config.ep, config.device)
    svc = service.Service(["kvmesh.v1.Decode"], config.host, config.port)
    address = config.reachable_address(svc.port)  # what gateways dial
    instance_id = config.instance_id or f"decode@{address}"
    # on the main thread: an OpenMP team made on another thread throttles every team's spin-waits
    await asyncio.wrap_future(executor.submit(service.set_torch_threads, config.torch_threads))
    runner = await asyncio.wrap_future(
        executor.submit(
            create_runner,
            files,
            config.num_pages,
            config.page_size,
            config.num_state_slots,
            config.kernel_backend,
            device,
        )
    )
    runner = await asyncio.wrap_future(executor.submit(ep.create_ep_runner, runner, files, config))
    if device.type == "cuda" and not config.enforce_eager and hasattr(runner, "enable_decode_graphs"):
        await asyncio.wrap_future(executor.submit(runner.enable_decode_graphs, config.max_batch_size))
    writer = None
    if config.redis_url and config.enable_prefix_caching:  # decode's KV events: gateways route turns by them
        writer = KVIndexWriter(config.redis_url, files.name, instance_id, "decode")
    tier = create_tier(config.kv_tier_blocks, runner.page_nbytes, config.kv_tier_dir, device.type, instance_id)
    engine = DecodeEngine(
        config,
        runner,
        dispatch=deliver_on(asyncio.get_running_loop()),
        on_events=writer.publisher.publish if writer else None,
        tier=tier,
    )
    logger.info("KV push path: %s (%s)", engine.kv_cache.push_path, engine.kv_cache.push_path_reason)
    # a wildcard bind address is no address to push to: advertise a name others can reach
    keep_until_exit(config.kv_transport)  # this process leaves with os._exit: no UCX teardown
    receiver = create_receiver(config.kv_transport, config.reachable_host, config.kv_port)
    await receiver.start()
    model = ServedModel.of(files, instance_id)
    servicer = DecodeServicer(engine, receiver, model)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, svc.server)
    metrics.bind(engine)
    ep.bind_metrics(metrics.REGISTRY, runner)
    service.start_metrics_server(config.metrics_port, config.host, metrics.REGISTRY)
    life = Lifecycle(svc, config.drain_grace_s)
    loop = asyncio.get_running_loop()

    def unhealthy(why: str) -> None:  # an EP rank is lost: health says NOT_SERVING from now on
        logger.error("decode %s cannot step any more (%s): health NOT_SERVING, reservations refused", instance_id, why)
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(svc.health.enter_graceful_shutdown()))

    engine.on_broken.append(unhealthy)
    await life.start()
    await asyncio.wrap_future(executor.submit(runner.warmup))
    await asyncio.wrap_future(executor.submit(engine.calibrate))  # what a speculative row costs here
    engine.start(executor)  # the batch loop occupies the main thread
    registration = None
    release: list = []
    if config.redis_url:
        record = InstanceRecord(instance_id, "decode", address, model.fingerprint, config.page_size)
        if writer is not None:
            publisher = writer.publisher

            async def resync() -> None:  # under the engine's lock, where its events come from
                engine.publish_snapshot(publisher)

            registration = Registration(
                writer.index.registry, record, config.lease_ttl_s, after_beat=writer.after_beat(resync)
            )
            release.append(writer.leave)
        else:
            registry = InstanceRegistry.from_url(config.redis_url, model=files.name)
            registration = Registration(registry, record, config.lease_ttl_s)
            release.append(registry.close)
    release.append(engine.shutdown)
    if hasattr(runner, "close"):  # expert-parallel ranks
        release.append(lambda: asyncio.wrap_future(executor.submit(runner.close)))
    release.append(receiver.close)
    if tier is not None:
        release.append(tier.close)
    banner = f"decode {instance_id} serving on {svc.address} (KV receiver {receiver.address})"
    await life.serve(stop, banner, registration, release, drain=servicer.drain)


def main(args: argparse.Namespace) -> None:
    lifecycle.main("decode", DecodeConfig, args, serve)
