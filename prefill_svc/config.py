"""Configuration of one prefill instance."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from runtime.flags import env_flag


@dataclass(frozen=True)
class PrefillConfig:
    """Settings of a prefill instance, built once in main() from flags and KVMESH_* variables."""

    model: str | None = None
    """Model name or path (engine.loader.resolve_model); None is the default model."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port; 0 picks a free one."""
    num_pages: int = 1024
    """KV pages in this instance's pool; pages left over after a request hold the prefix cache."""
    page_size: int = 16
    """Token slots per page; must equal the decode instances' page size."""
    enable_prefix_caching: bool = True
    """Keep full prompt blocks after a request and reuse them for later prompts."""
    redis_url: str = ""
    """Redis holding the prefix index; empty disables KV event publishing."""
    torch_threads: int = 0
    """Intra-op threads of the model; 0 keeps torch's default (every core)."""
    instance_id: str = ""
    """Name under which this instance's blocks are indexed; empty means host:port of its gRPC server."""
    kv_digest: bool = False
    """Hash each pushed request's KV pages (SHA-256) and report it, for tests."""
    metrics_port: int = 0
    """HTTP port of the Prometheus metrics endpoint (/metrics); 0 serves none."""
    max_batch_tokens: int = 4096
    """Most prompt tokens prefilled together in one forward (queued requests batch up)."""
    push_timeout_s: float = 30.0
    """Seconds one KV push to decode may take before it fails with UNAVAILABLE."""
    lease_ttl_s: float = 10.0
    """Lifetime of this instance's lease in the prefix index; it is renewed every third of it,
    and when it lapses gateways stop counting the instance's cached blocks."""

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvmesh serve prefill`; each falls back to its KVMESH_* variable."""
    env_flag(parser, "--model", "KVMESH_MODEL", None, "model name or path (none: SmolLM2-135M-Instruct)")
    env_flag(parser, "--host", "KVMESH_HOST", "127.0.0.1", "address the gRPC server binds to")
    env_flag(parser, "--port", "KVMESH_PORT", 0, "gRPC port (0: any free port)", int)
    env_flag(
        parser, "--num-pages", "KVMESH_NUM_PAGES", 1024, "KV pages in the pool (the rest hold the prefix cache)", int
    )
    env_flag(parser, "--page-size", "KVMESH_PAGE_SIZE", 16, "tokens per page (same on every service)", int)
    env_flag(
        parser,
        "--max-batch-tokens",
        "KVMESH_MAX_BATCH_TOKENS",
        4096,
        "most prompt tokens prefilled together in one forward",
        int,
    )
    env_flag(parser, "--torch-threads", "KVMESH_TORCH_THREADS", 0, "intra-op threads of the model (0: all cores)", int)
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not keep prompt blocks after a request")
    env_flag(parser, "--redis-url", "REDIS_URL", "", "Redis of the prefix index, fed by KV events (empty: no index)")
    env_flag(parser, "--metrics-port", "KVMESH_METRICS_PORT", 0, "HTTP port of Prometheus /metrics (0: none)", int)
    env_flag(
        parser,
        "--instance-id",
        "KVMESH_INSTANCE_ID",
        "",
        "name in the prefix index (empty: host:port; the gateway learns it from GetStats)",
    )
    env_flag(
        parser,
        "--lease-ttl",
        "KVMESH_LEASE_TTL_S",
        10.0,
        "seconds the instance's index entries count after its last heartbeat",
        float,
    )


def config_from_args(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        num_pages=args.num_pages,
        page_size=args.page_size,
        enable_prefix_caching=not args.no_prefix_caching,
        max_batch_tokens=args.max_batch_tokens,
        torch_threads=args.torch_threads,
        redis_url=args.redis_url,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        lease_ttl_s=args.lease_ttl,
        kv_digest=os.environ.get("KVMESH_KV_DIGEST") == "1",
    )
