"""`kvmesh serve gateway`: the client-facing gRPC service, and its OpenAI-compatible HTTP API
(--http-port) in the same process and event loop, both over one RequestPath."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import TYPE_CHECKING

from kvmesh.engine.checkpoint import ModelFiles, load_tokenizer, model_fingerprint
from kvmesh.engine.loader import load_config, resolve_model
from kvmesh.gateway import metrics
from kvmesh.gateway.admission import AdmissionQueue
from kvmesh.gateway.auth import ApiKeys
from kvmesh.gateway.config import GatewayConfig
from kvmesh.gateway.discovery import Discovery
from kvmesh.gateway.pool import InstancePool
from kvmesh.gateway.prediction_log import PredictionLog
from kvmesh.gateway.request_path import RequestPath
from kvmesh.gateway.requests import PromptBuilder
from kvmesh.gateway.scale_advice import ScaleAdvisor
from kvmesh.gateway.servicer import GatewayServicer
from kvmesh.gateway.sessions import SessionTable
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader
from kvmesh.kvstore.registry import AsyncRegistryReader
from kvmesh.protos.v1 import gateway_pb2_grpc
from kvmesh.runtime import lifecycle, service
from kvmesh.runtime.lifecycle import Lifecycle

if TYPE_CHECKING:
    from kvmesh.gateway.http.server import HttpFront

logger = logging.getLogger(__name__)

API_KEYS_ENV = "KVMESH_API_KEYS"
"""Comma-separated API keys, added to --api-key-file's (an environment variable, not a flag:
a flag's value shows in every process listing)."""


async def serve(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Load the tokenizer, connect to the instances, serve until stop is set."""
    files = resolve_model(config.model)
    model_config = load_config(files)
    tokenizer = await asyncio.to_thread(load_tokenizer, files)
    builder = PromptBuilder(
        tokenizer, files.name, model_config.max_position_embeddings, config.default_max_tokens, config.max_tokens_limit
    )
    pool = _instance_pool(config, files)
    path = _request_path(config, builder, pool, frozenset(model_config.eos_token_ids))
    pool.on_capacity.append(
        ScaleAdvisor(config.slo, pool.prefills, pool.decodes, lambda: path.admission.num_queued).update
    )
    svc = service.Service(["kvmesh.v1.Gateway"], config.host, config.port, tls=_read_tls(config))
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(path), svc.server)
    http = _http_front(config, path)
    await _wait_for_instances(config)
    await pool.poll_once()
    release = await _start_discovery(config, pool, files.name)
    pool.start_polling(config.stats_interval_s)
    service.start_metrics_server(config.metrics_port, config.host, metrics.REGISTRY)
    life = Lifecycle(svc, config.drain_grace_s, [http] if http is not None else [])
    await life.start()
    banner = _banner(config, files.name, svc.address, http, len(path.keys))
    await life.serve(stop, banner, release=[*release, pool.close])


def _instance_pool(config: GatewayConfig, files: ModelFiles) -> InstancePool:
    """The pool of the listed instances, reading the prefix index in config.redis_url (if any),
    its predictor writing to --predictor-log (ValueError when that file cannot be opened)."""
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
        config.decode_hit_slack,
        config.decode_reuse_min_blocks,
        config.pull_min_blocks,
        config.tier_hit_weight,
    )
    if config.predictor_log:
        try:
            pool.predictor.log = PredictionLog(config.predictor_log)
        except OSError as exc:
            raise ValueError(f"--predictor-log {config.predictor_log}: {exc.strerror}") from None
    return pool


def _request_path(
    config: GatewayConfig, builder: PromptBuilder, pool: InstancePool, eos_token_ids: frozenset[int]
) -> RequestPath:
    """The one request path over `pool`: its admission queue (pumped as capacity grows), the API
    keys (ValueError when --api-key-file cannot be read) and the session table."""
    admission = AdmissionQueue(
        pool.decode_capacity,
        config.max_queued_requests,
        config.max_queued_tokens,
        config.max_queue_time_s,
        config.max_requests_per_key,
        config.max_queued_tokens_per_key,
    )
    pool.on_capacity.append(admission.pump)
    try:
        keys = ApiKeys.load(config.api_key_file, os.environ.get(API_KEYS_ENV, ""))
    except OSError as exc:
        raise ValueError(f"--api-key-file {config.api_key_file}: {exc.strerror}") from None
    return RequestPath(
        builder,
        pool,
        admission,
        eos_token_ids,
        config.rpc_timeout_s,
        config.prefill_timeout_base_s,
        config.prefill_min_tokens_per_s,
        config.token_timeout_s,
        keys,
        SessionTable(config.max_sessions),
        config.slo,
        config.slo_miss == "shed",
    )


def _read_tls(config: GatewayConfig) -> tuple[bytes, bytes] | None:
    """(private key, certificate chain) as PEM bytes, or None for plain TCP; ValueError naming
    the file that cannot be read."""
    if not config.tls_cert:
        return None
    try:
        with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
            return k.read(), c.read()
    except OSError as exc:
        raise ValueError(f"TLS: cannot read {exc.filename}: {exc.strerror}") from None


def _http_front(config: GatewayConfig, path: RequestPath) -> HttpFront | None:
    """The OpenAI-compatible HTTP front over `path` (kvmesh.gateway.http.server.HttpFront), or None
    without --http-port."""
    if not config.http_port:
        return None
    from kvmesh.gateway.http.server import HttpFront  # starlette and uvicorn load only when HTTP is on
    from kvmesh.gateway.response_store import create_response_store

    return HttpFront(
        path,
        config.host,
        config.http_port,
        config.tls_cert,
        config.tls_key,
        config.drain_grace_s,
        tool_parser=config.tool_parser,
        session_from_user=config.session_from_user,
        responses=create_response_store(config.redis_url, config.response_ttl_s),
    )


async def _wait_for_instances(config: GatewayConfig) -> None:
    """With --wait-for-instances: wait for every listed instance to report SERVING."""
    if config.wait_for_instances_s:
        # started beside its instances (`kvmesh up`): the tokenizer loaded while they loaded
        # their models; SERVING only once every listed instance is, so the first poll finds them
        addresses = [*config.prefill_addresses, *config.decode_addresses]
        await asyncio.gather(*(service.wait_for_health(a, config.wait_for_instances_s) for a in addresses))


async def _start_discovery(config: GatewayConfig, pool: InstancePool, model: str) -> list:
    """With --discover and a --redis-url: add the registry's instances now and follow it in the
    background. Returns what to close at shutdown (none without discovery)."""
    if not config.discovers:
        return []
    registry = AsyncRegistryReader(config.redis_url, model=model)
    discovery = Discovery(registry.live, pool, config.discovery_interval_s)
    await discovery.refresh()  # after the static instances' first poll: their ids dedupe the registry's
    discovery.start()
    return [discovery.close, registry.close]


def _banner(config: GatewayConfig, model: str, address: str, http: HttpFront | None, num_keys: int) -> str:
    """The line logged once the gateway serves: its model, its addresses and how it is set up."""
    http_note = f", OpenAI HTTP API on {http.address}/v1" if http is not None else ""
    keys_note = f", {num_keys} API keys" if num_keys else ""
    found = ", finding instances in the Redis registry" if config.discovers else ""
    if not config.redis_url:
        found = ", no Redis: routing by load and latency prediction alone (no prefix index, no registry)"
    slo = config.slo
    slo_note = f", SLO TTFT {slo.ttft_s * 1000:g} ms ITL {slo.itl_s * 1000:g} ms ({config.slo_miss})" if slo else ""
    return f"gateway serving {model} on {address}{http_note}{keys_note}{found}{slo_note}"


def main(args: argparse.Namespace) -> None:
    lifecycle.main("gateway", GatewayConfig, args, lambda config, stop, _executor: serve(config, stop))
