"""`kvmesh serve prefill`: one prefill instance (gRPC server + prefix cache + KV pusher)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvmesh.engine.forward import Runner
from kvmesh.kvstore.kv_publisher import KVEventPublisher
from kvmesh.kvstore.kv_tier import KVTier
from kvmesh.kvstore.transport import KVPushReceiver
from kvmesh.kvstore.transports import create_receiver, create_sender, keep_until_exit
from kvmesh.prefill_svc import metrics
from kvmesh.prefill_svc.config import PrefillConfig
from kvmesh.prefill_svc.engine import PrefillEngine
from kvmesh.prefill_svc.kv_pull import KVPuller
from kvmesh.prefill_svc.servicer import PrefillServicer
from kvmesh.protos.v1 import prefill_pb2_grpc
from kvmesh.runtime import lifecycle, service
from kvmesh.runtime.cpu_share import open_cpu_share
from kvmesh.runtime.kv_index import KVIndexWriter
from kvmesh.runtime.model_start import ModelStart

logger = logging.getLogger(__name__)


# requests between compute and the end of their push, for models with per-request state
PREFILL_STATE_SLOTS = 64


async def serve(config: PrefillConfig, stop: asyncio.Event, executor: service.MainThreadExecutor) -> None:
    """Load the model, clear this instance's old index entries, serve until stop is set."""
    start = ModelStart.open("prefill", config, executor, "kvmesh.v1.Prefill")
    # KV events leave the model thread at once; a background thread writes them to Redis
    writer = start.index_writer() if config.redis_url else None
    runner = await start.load_runner(PREFILL_STATE_SLOTS)
    tier = start.open_tier(runner.page_layout)
    engine = _engine(config, runner, writer, executor, tier)
    logger.info("KV push path: %s (%s)", engine.kv_cache.push_path, engine.kv_cache.push_path_reason)
    keep_until_exit(config.kv_transport)  # this process leaves with os._exit: no UCX teardown
    sender = create_sender(config.kv_transport)
    model = start.served_model()
    receiver, puller = await _open_pull(config, engine, runner)
    servicer = PrefillServicer(engine, sender, model, config, puller)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, start.svc.server)
    metrics.bind(engine)
    start.serve_metrics(metrics.REGISTRY)
    life = await start.open_ports()
    await start.on_main(runner.warmup)

    async def resync(publisher: KVEventPublisher) -> None:
        # the snapshot on the worker thread, where the events come from
        await asyncio.wrap_future(engine.call(lambda: publisher.resync(engine.kv_cache.snapshot())))

    registration, leave = start.register(model, writer, resync)
    release: list[Callable[[], Any]] = [engine.shutdown, sender.close]
    if puller is not None and receiver is not None:
        release += [puller.close, receiver.close]
    if tier is not None:
        release.append(tier.close)
    if leave is not None:
        release.append(leave)
    await life.serve(stop, f"prefill {start.instance_id} serving on {start.svc.address}", registration, release)


def _engine(
    config: PrefillConfig,
    runner: Runner,
    writer: KVIndexWriter | None,
    executor: service.MainThreadExecutor,
    tier: KVTier | None,
) -> PrefillEngine:
    """The prefill engine on `runner`, computing on `executor` (the main thread), its KV events
    going to `writer` (None: not published), evicted blocks to `tier` (None: dropped)."""
    return PrefillEngine(
        runner,
        config.page_size,
        config.num_pages,
        config.enable_prefix_caching,
        writer.publisher.publish if writer else None,
        executor=executor,
        max_batch_tokens=config.max_batch_tokens,
        chunked_prefill_size=config.chunked_prefill_size,
        cpu_share=open_cpu_share(config.cpu_share, config.cpu_share_max_wait_s),
        forward_tokens_beside_decode=config.cpu_share_forward_tokens,
        push_path=config.kv_push_path,
        tier=tier,
    )


async def _open_pull(
    config: PrefillConfig, engine: PrefillEngine, runner: Runner
) -> tuple[KVPushReceiver | None, KVPuller | None]:
    """With --kv-pull: the KV listener peers push the blocks this instance pulls into, started,
    and the puller that asks them; else (None, None)."""
    if not config.kv_pull:
        return None, None
    receiver = create_receiver(config.kv_transport, config.reachable_host, config.kv_port)
    await receiver.start()
    return receiver, KVPuller(engine, receiver, runner.page_layout.describe(), digest=config.kv_digest)


def main(args: argparse.Namespace) -> None:
    lifecycle.main("prefill", PrefillConfig, args, serve)
