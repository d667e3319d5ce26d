"""`kvmesh serve prefill`: one prefill instance (gRPC server + prefix cache + KV pusher)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvmesh.engine.device import resolve_device
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.runners import create_runner
from kvmesh.kvstore.kv_tier import create_tier
from kvmesh.kvstore.registry import InstanceRecord
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
from kvmesh.runtime.lifecycle import Lifecycle
from kvmesh.runtime.registration import Registration
from kvmesh.runtime.served_model import ServedModel

logger = logging.getLogger(__name__)


# requests between compute and the end of their push, for models with per-request state
PREFILL_STATE_SLOTS = 64


async def serve(config: PrefillConfig, stop: asyncio.Event, executor: service.MainThreadExecutor) -> None:
    """Load the model, clear this instance's old index entries, serve until stop is set."""
    device = resolve_device(config.device)  # a device this machine lacks: refused before any port opens
    files = resolve_model(config.model)
    svc = service.Service(["kvmesh.v1.Prefill"], config.host, config.port)
    address = config.reachable_address(svc.port)  # what gateways dial
    instance_id = config.instance_id or address
    # KV events leave the model thread at once; a background thread writes them to Redis
    writer = KVIndexWriter(config.redis_url, files.name, instance_id, "prefill") if config.redis_url else None
    publish = writer.publisher.publish if writer else None
    # on the main thread: an OpenMP team made on another thread throttles every team's spin-waits
    await asyncio.wrap_future(executor.submit(service.set_torch_threads, config.torch_threads))
    runner = await asyncio.wrap_future(
        executor.submit(
            create_runner,
            files,
            config.num_pages,
            config.page_size,
            PREFILL_STATE_SLOTS,
            config.kernel_backend,
            device,
        )
    )
    tier = create_tier(config.kv_tier_blocks, runner.page_nbytes, config.kv_tier_dir, device.type, instance_id)
    engine = PrefillEngine(
        runner,
        config.page_size,
        config.num_pages,
        config.enable_prefix_caching,
        publish,
        executor=executor,
        max_batch_tokens=config.max_batch_tokens,
        chunked_prefill_size=config.chunked_prefill_size,
        cpu_share=open_cpu_share(config.cpu_share, config.cpu_share_max_wait_s),
        forward_tokens_beside_decode=config.cpu_share_forward_tokens,
        push_path=config.kv_push_path,
        tier=tier,
    )
    logger.info("KV push path: %s (%s)", engine.kv_cache.push_path, engine.kv_cache.push_path_reason)
    keep_until_exit(config.kv_transport)  # this process leaves with os._exit: no UCX teardown
    sender = create_sender(config.kv_transport)
    model = ServedModel.of(files, instance_id)
    receiver, puller = None, None
    if config.kv_pull:  # peers push the blocks this instance pulls into its own KV listener
        receiver = create_receiver(config.kv_transport, config.reachable_host, config.kv_port)
        await receiver.start()
        puller = KVPuller(engine, receiver, runner.page_layout.describe(), digest=config.kv_digest)
    servicer = PrefillServicer(engine, sender, model, config, puller)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, svc.server)
    metrics.bind(engine)
    service.start_metrics_server(config.metrics_port, config.host, metrics.REGISTRY)
    life = Lifecycle(svc, config.drain_grace_s)
    await life.start()
    await asyncio.wrap_future(executor.submit(runner.warmup))
    registration = None
    release = [engine.shutdown, sender.close]
    if puller is not None and receiver is not None:
        release += [puller.close, receiver.close]
    if tier is not None:
        release.append(tier.close)
    if writer is not None:
        record = InstanceRecord(instance_id, "prefill", address, model.fingerprint, config.page_size)
        publisher = writer.publisher

        async def resync() -> None:  # the snapshot on the worker thread, where the events come from
            await asyncio.wrap_future(engine.call(lambda: publisher.resync(engine.kv_cache.snapshot())))

        registration = Registration(
            writer.index.registry, record, config.lease_ttl_s, after_beat=writer.after_beat(resync)
        )
        release.append(writer.leave)
    await life.serve(stop, f"prefill {instance_id} serving on {svc.address}", registration, release)


def main(args: argparse.Namespace) -> None:
    lifecycle.main("prefill", PrefillConfig, args, serve)
