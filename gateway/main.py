"""`kvmesh serve gateway`: the client-facing gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging

from engine.checkpoint import load_tokenizer, model_fingerprint
from engine.loader import load_config, resolve_model
from gateway import metrics
from gateway.admission import AdmissionQueue
from gateway.config import GatewayConfig
from gateway.discovery import Discovery
from gateway.pool import InstancePool
from gateway.requests import PromptBuilder
from gateway.servicer import GatewayServicer
from kvstore.redis_index import AsyncRedisKVIndexReader
from kvstore.registry import AsyncRegistryReader
from protos.kvmesh.v1 import gateway_pb2_grpc
from runtime import service, settings, tracing

logger = logging.getLogger(__name__)


async def serve(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Load the tokenizer, connect to the instances, serve until stop is set."""
    files = resolve_model(config.model)
    model_config = load_config(files)
    tokenizer = await asyncio.to_thread(load_tokenizer, files)
    builder = PromptBuilder(
        tokenizer, files.name, model_config.max_position_embeddings, config.default_max_tokens, config.max_tokens_limit
    )
    index = AsyncRedisKVIndexReader(config.redis_url, model=files.name) if config.redis_url else None
    pool = InstancePool(
        config.prefill_addresses,
        config.decode_addresses,
        config.page_size,
        index,
        config.cache_threshold,
        config.load_weight,
        config.rpc_timeout_s,
        config.routing_policy,
        model_fingerprint(files),
    )
    admission = AdmissionQueue(
        pool.decode_capacity, config.max_queued_requests, config.max_queued_tokens, config.max_queue_time_s
    )
    pool.on_capacity.append(admission.pump)
    svc = service.Service(["kvmesh.v1.Gateway"], config.host, config.port)
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(
            builder,
            pool,
            admission,
            frozenset(model_config.eos_token_ids),
            config.rpc_timeout_s,
            config.prefill_timeout_base_s,
            config.prefill_min_tokens_per_s,
            config.token_timeout_s,
        ),
        svc.server,
    )
    await pool.poll_once()
    discovery = registry = None
    if config.discovers:
        registry = AsyncRegistryReader(config.redis_url, model=files.name)
        discovery = Discovery(registry.live, pool, config.discovery_interval_s)
        await discovery.refresh()  # after the static instances' first poll: their ids dedupe the registry's
        discovery.start()
    pool.start_polling(config.stats_interval_s)
    service.start_metrics_server(config.metrics_port, config.host, metrics.REGISTRY)
    await svc.start()
    await svc.mark_serving()
    found = ", finding instances in the Redis registry" if config.discovers else ""
    print(f"gateway serving {files.name} on {svc.address}{found}", flush=True)
    await stop.wait()
    logger.info("shutting down")
    await svc.stop(grace_s=config.drain_grace_s)
    if discovery is not None and registry is not None:
        await discovery.close()
        await registry.close()
    await pool.close()
    tracing.shutdown_tracing()


def main(args: argparse.Namespace) -> None:
    service.setup_logging("gateway")
    tracing.setup_tracing("kvmesh-gateway")
    config = settings.from_args(GatewayConfig, args)
    service.run(lambda stop, _executor: serve(config, stop))
