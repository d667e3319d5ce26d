"""Configuration of one prefill instance."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


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
    instance_id: str = ""
    """Name under which this instance's blocks are indexed; empty means host:port of its gRPC server."""
    kv_digest: bool = False
    """Hash each pushed request's KV pages (SHA-256) and report it, for tests."""
    max_batch_tokens: int = 4096
    """Most prompt tokens prefilled together in one forward (queued requests batch up)."""
    push_timeout_s: float = 30.0
    """Seconds one KV push to decode may take before it fails with UNAVAILABLE."""

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvmesh serve prefill`; each defaults to its KVMESH_* variable when set."""
    env = os.environ.get
    parser.add_argument("--model", default=env("KVMESH_MODEL"), help="model name or path (default SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default=env("KVMESH_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("KVMESH_PORT", "0")), help="gRPC port (0: any free)")
    parser.add_argument("--num-pages", type=int, default=int(env("KVMESH_NUM_PAGES", "1024")))
    parser.add_argument("--page-size", type=int, default=int(env("KVMESH_PAGE_SIZE", "16")))
    parser.add_argument("--max-batch-tokens", type=int, default=int(env("KVMESH_MAX_BATCH_TOKENS", "4096")),
                        help="most prompt tokens prefilled together in one forward")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not keep prompt blocks after a request")
    parser.add_argument("--redis-url", default=env("REDIS_URL", ""), help="Redis for the prefix index (KV events)")
    parser.add_argument("--instance-id", default=env("KVMESH_INSTANCE_ID", ""),
                        help="name in the prefix index (default host:port; the gateway learns it from GetStats)")


def config_from_args(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(model=args.model, host=args.host, port=args.port, num_pages=args.num_pages,
                         page_size=args.page_size, enable_prefix_caching=not args.no_prefix_caching,
                         max_batch_tokens=args.max_batch_tokens,
                         redis_url=args.redis_url, instance_id=args.instance_id,
                         kv_digest=os.environ.get("KVMESH_KV_DIGEST") == "1")
