"""Configuration of the gateway."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from runtime.flags import env_flag


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of a gateway, built once in main() from flags and KVMESH_* variables."""

    prefill_addresses: tuple[str, ...]
    """gRPC addresses (host:port) of the prefill instances."""
    decode_addresses: tuple[str, ...]
    """gRPC addresses (host:port) of the decode instances."""
    model: str | None = None
    """Model name or path whose tokenizer the gateway uses; None is the default model."""
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str = ""
    """Redis holding the prefix index; empty routes by load alone."""
    page_size: int = 16
    """Tokens per block; must equal the services' page size (block hashes depend on it)."""
    default_max_tokens: int = 256
    """max_tokens when a request leaves it unset."""
    max_tokens_limit: int = 4096
    """Largest max_tokens a request may ask for."""
    cache_threshold: float = 0.3
    """Fraction of the prompt a cached prefix must cover to steer routing (SGLang's cache_threshold)."""
    load_weight: float = 0.02
    """Weight of queued prefill tokens against uncached prompt tokens in the routing cost."""
    routing_policy: str = "cache_aware"
    """cache_aware (the default), round_robin, random, consistent_hash or least_load."""
    rpc_timeout_s: float = 10.0
    """Deadline of the small control RPCs (Reserve, Release, GetStats)."""
    prefill_timeout_base_s: float = 30.0
    """A Prefill call's deadline is this many seconds plus the tokens queued on the instance
    (this prompt's included) at prefill_min_tokens_per_s."""
    prefill_min_tokens_per_s: float = 20.0
    """The slowest prefill rate (tokens/s) a live instance is expected to keep (2 busy CPU cores
    manage ~40; a frozen instance is found by the channel's pings within seconds, not by this)."""
    token_timeout_s: float = 8.0
    """Longest wait for the next token of a decode stream before the decode instance is
    taken for lost (the request then fails with UNAVAILABLE naming it)."""
    max_queued_requests: int = 4096
    """Requests that may wait in the admission queue for a decode slot; more get RESOURCE_EXHAUSTED."""
    max_queued_tokens: int = 4_000_000
    """Prompt tokens that may wait in the admission queue; more get RESOURCE_EXHAUSTED."""
    max_queue_time_s: float = 600.0
    """Seconds a request may wait for a decode slot before it gets RESOURCE_EXHAUSTED."""
    stats_interval_s: float = 0.5
    """How often instances' load and health are polled."""
    metrics_port: int = 0
    """HTTP port of the Prometheus metrics endpoint (/metrics); 0 serves none."""

    def __post_init__(self) -> None:
        if not self.prefill_addresses:
            raise ValueError("at least one prefill address is required (--prefill host:port)")
        if not self.decode_addresses:
            raise ValueError("at least one decode address is required (--decode host:port)")
        for flag, addresses in (("--prefill", self.prefill_addresses), ("--decode", self.decode_addresses)):
            for a in addresses:
                host, _, port = a.rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ValueError(f"{flag} needs host:port with a port in [1, 65535], got {a!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 token (the same on every service), got {self.page_size}")
        from gateway.router import POLICIES

        if self.routing_policy not in POLICIES:
            raise ValueError(f"--routing-policy must be one of {list(POLICIES)}, got {self.routing_policy!r}")
        if self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if not (math.isfinite(self.load_weight) and self.load_weight >= 0):
            raise ValueError(f"load_weight must be a finite number >= 0, got {self.load_weight}")
        for name in (
            "rpc_timeout_s",
            "prefill_timeout_base_s",
            "prefill_min_tokens_per_s",
            "token_timeout_s",
            "max_queue_time_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if self.max_queued_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError(
                f"max_queued_requests and max_queued_tokens must be >= 0, got "
                f"{self.max_queued_requests}, {self.max_queued_tokens}"
            )
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens must be in [1, {self.max_tokens_limit}], got {self.default_max_tokens}"
            )


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvmesh serve gateway`; each falls back to its KVMESH_* variable."""
    env_flag(
        parser,
        "--model",
        "KVMESH_MODEL",
        None,
        "model name or path whose tokenizer to use (none: SmolLM2-135M-Instruct)",
    )
    env_flag(parser, "--host", "KVMESH_HOST", "127.0.0.1", "address the gRPC server binds to")
    env_flag(parser, "--port", "KVMESH_PORT", 50051, "gRPC port clients connect to", int)
    parser.add_argument(
        "--prefill",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="a prefill instance, required (repeat or comma-separate; env KVMESH_PREFILL)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="a decode instance, required (repeat or comma-separate; env KVMESH_DECODE)",
    )
    env_flag(parser, "--redis-url", "REDIS_URL", "", "Redis of the prefix index (empty: route by load alone)")
    env_flag(parser, "--page-size", "KVMESH_PAGE_SIZE", 16, "tokens per block (same on every service)", int)
    env_flag(
        parser,
        "--default-max-tokens",
        "KVMESH_DEFAULT_MAX_TOKENS",
        256,
        "max_tokens when a request leaves it unset",
        int,
    )
    env_flag(parser, "--max-tokens-limit", "KVMESH_MAX_TOKENS_LIMIT", 4096, "largest max_tokens a request may ask", int)
    env_flag(
        parser,
        "--cache-threshold",
        "KVMESH_CACHE_THRESHOLD",
        0.3,
        "fraction of the prompt a cached prefix must cover to steer routing",
        float,
    )
    env_flag(
        parser,
        "--load-weight",
        "KVMESH_LOAD_WEIGHT",
        0.02,
        "weight of queued prefill tokens against uncached prompt tokens",
        float,
    )
    env_flag(parser, "--metrics-port", "KVMESH_METRICS_PORT", 0, "HTTP port of Prometheus /metrics (0: none)", int)
    env_flag(
        parser,
        "--routing-policy",
        "KVMESH_ROUTING_POLICY",
        "cache_aware",
        "prefill routing: cache_aware, round_robin, random, consistent_hash or least_load",
    )
    env_flag(
        parser,
        "--max-queued-requests",
        "KVMESH_MAX_QUEUED_REQUESTS",
        4096,
        "requests that may wait for a decode slot (more: RESOURCE_EXHAUSTED)",
        int,
    )
    env_flag(
        parser,
        "--max-queued-tokens",
        "KVMESH_MAX_QUEUED_TOKENS",
        4_000_000,
        "prompt tokens that may wait for a decode slot (more: RESOURCE_EXHAUSTED)",
        int,
    )
    env_flag(
        parser,
        "--max-queue-time",
        "KVMESH_MAX_QUEUE_TIME",
        600.0,
        "seconds a request may wait for a decode slot",
        float,
    )
    env_flag(
        parser,
        "--token-timeout",
        "KVMESH_TOKEN_TIMEOUT",
        8.0,
        "seconds without a token from decode before the instance is taken for lost",
        float,
    )
    env_flag(
        parser,
        "--prefill-timeout-base",
        "KVMESH_PREFILL_TIMEOUT_BASE",
        30.0,
        "a Prefill call's deadline: this + queued tokens / --prefill-min-rate (seconds)",
        float,
    )
    env_flag(
        parser,
        "--prefill-min-rate",
        "KVMESH_PREFILL_MIN_RATE",
        20.0,
        "slowest prefill rate (tokens/s) a live instance keeps",
        float,
    )


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    prefill = [a for v in (args.prefill or [os.environ.get("KVMESH_PREFILL", "")]) for a in _addresses(v)]
    decode = [a for v in (args.decode or [os.environ.get("KVMESH_DECODE", "")]) for a in _addresses(v)]
    return GatewayConfig(
        prefill_addresses=tuple(prefill),
        decode_addresses=tuple(decode),
        model=args.model,
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        page_size=args.page_size,
        default_max_tokens=args.default_max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        cache_threshold=args.cache_threshold,
        load_weight=args.load_weight,
        routing_policy=args.routing_policy,
        metrics_port=args.metrics_port,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_queue_time_s=args.max_queue_time,
        token_timeout_s=args.token_timeout,
        prefill_timeout_base_s=args.prefill_timeout_base,
        prefill_min_tokens_per_s=args.prefill_min_rate,
    )
