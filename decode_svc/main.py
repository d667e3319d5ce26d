"""`kvmesh serve decode`: one decode instance (gRPC server + UCX KV receiver + batch loop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvmesh.decode_svc import ep, metrics
from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.delivery import deliver_on
from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.decode_svc.servicer import DecodeServicer
from kvmesh.engine.forward import Runner
from kvmesh.kvstore.kv_publisher import KVEventPublisher
from kvmesh.kvstore.transports import create_receiver, keep_until_exit
from kvmesh.protos.v1 import decode_pb2_grpc
from kvmesh.runtime import lifecycle, service
from kvmesh.runtime.model_start import ModelStart

logger = logging.getLogger(__name__)


async def serve(config: DecodeConfig, stop: asyncio.Event, executor: service.MainThreadExecutor) -> None:
    """Load the model, start the gRPC server and the UCX listener, serve until stop is set."""
    start = ModelStart.open(
        "decode",
        config,
        executor,
        "kvmesh.v1.Decode",
        check_files=lambda files: ep.check_ep_model(files, config.ep, config.device),
        default_id=lambda address: f"decode@{address}",
    )
    runner = await _load_runner(start, config)
    writer = None
    if config.redis_url and config.enable_prefix_caching:  # decode's KV events: gateways route turns by them
        writer = start.index_writer()
    tier = start.open_tier(runner.page_layout)
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
    model = start.served_model()
    servicer = DecodeServicer(engine, receiver, model)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, start.svc.server)
    metrics.bind(engine)
    ep.bind_metrics(metrics.REGISTRY, runner)
    start.serve_metrics(metrics.REGISTRY)
    engine.on_broken.append(_unhealthy(start))
    life = await start.open_ports()
    await start.on_main(runner.warmup)
    await start.on_main(engine.calibrate)  # what a speculative row costs here
    engine.start(executor)  # the batch loop occupies the main thread

    async def resync(publisher: KVEventPublisher) -> None:  # under the engine's lock, where its events come from
        engine.publish_snapshot(publisher)

    registration, leave = start.register(model, writer, resync)
    release: list[Callable[[], Any]] = [leave] if leave is not None else []
    release.append(engine.shutdown)
    if hasattr(runner, "close"):  # expert-parallel ranks
        release.append(lambda: start.on_main(runner.close))
    release.append(receiver.close)
    if tier is not None:
        release.append(tier.close)
    banner = f"decode {start.instance_id} serving on {start.svc.address} (KV receiver {receiver.address})"
    await life.serve(stop, banner, registration, release, drain=servicer.drain)


async def _load_runner(start: ModelStart, config: DecodeConfig) -> Runner:
    """The model's runner with decode's state slots, across the expert-parallel ranks with --ep
    (decode_svc.ep), with CUDA graphs of the decode step on a GPU unless --enforce-eager."""
    runner = await start.load_runner(config.num_state_slots)
    runner = await start.on_main(ep.create_ep_runner, runner, start.files, config)
    if start.device.type == "cuda" and not config.enforce_eager and hasattr(runner, "enable_decode_graphs"):
        await start.on_main(runner.enable_decode_graphs, config.max_batch_size)
    return runner


def _unhealthy(start: ModelStart) -> Callable[[str], None]:
    """What the engine calls (from its thread) when it cannot step any more: an EP rank is lost,
    so health says NOT_SERVING from now on."""
    loop = asyncio.get_running_loop()

    def unhealthy(why: str) -> None:
        logger.error(
            "decode %s cannot step any more (%s): health NOT_SERVING, reservations refused", start.instance_id, why
        )
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(start.svc.health.enter_graceful_shutdown()))

    return unhealthy


def main(args: argparse.Namespace) -> None:
    lifecycle.main("decode", DecodeConfig, args, serve)
