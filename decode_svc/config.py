"""Configuration of one decode instance."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from runtime.flags import env_flag


@dataclass(frozen=True)
class DecodeConfig:
    """Settings of a decode instance, built once in main() from flags and KVMESH_* variables."""

    model: str | None = None
    """Model name or path (engine.loader.resolve_model); None is the default model."""
    host: str = "127.0.0.1"
    """Address the gRPC server and the UCX listener bind to."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    kv_port: int = 0
    """UCX listener port for KV pushes; 0 picks a free one."""
    advertise_host: str = ""
    """Host prefill instances push KV to (the UCX listener takes every interface); empty means
    --host, or this machine's hostname when --host is a wildcard (0.0.0.0, ::)."""
    num_pages: int = 1024
    """KV pages in this instance's pool (page_size tokens each)."""
    page_size: int = 16
    """Token slots per page; must equal the prefill instances' page size."""
    max_batch_size: int = 64
    """Most requests reserved or running at once; more get RESOURCE_EXHAUSTED."""
    max_admit_per_step: int = 4
    """New KV loads (requests whose pushed KV has landed) admitted into the batch per step."""
    reservation_timeout_s: float = 60.0
    """A reservation no Generate call claims is freed after this many seconds, unless the
    Reserve call set its own kv_deadline_s (the gateway does: its prefill deadline + 10 s)."""
    kv_digest: bool = False
    """Hash each request's received KV pages (SHA-256) and report it, for tests."""
    metrics_port: int = 0
    """HTTP port of the Prometheus metrics endpoint (/metrics); 0 serves none."""
    torch_threads: int = 0
    """Intra-op threads of the model; 0 keeps torch's default (every core)."""
    instance_id: str = ""
    """Name in logs and stats; empty means decode@host:port."""

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_admit_per_step < 1:
            raise ValueError(f"max_admit_per_step must be >= 1, got {self.max_admit_per_step}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvmesh serve decode`; each falls back to its KVMESH_* variable."""
    env_flag(parser, "--model", "KVMESH_MODEL", None, "model name or path (none: SmolLM2-135M-Instruct)")
    env_flag(parser, "--host", "KVMESH_HOST", "127.0.0.1", "address the gRPC server and UCX listener bind to")
    env_flag(parser, "--port", "KVMESH_PORT", 0, "gRPC port (0: any free port)", int)
    env_flag(parser, "--kv-port", "KVMESH_KV_PORT", 0, "UCX listener port for KV pushes (0: any free port)", int)
    env_flag(parser, "--num-pages", "KVMESH_NUM_PAGES", 1024, "KV pages in the pool", int)
    env_flag(parser, "--page-size", "KVMESH_PAGE_SIZE", 16, "tokens per page (same on every service)", int)
    env_flag(parser, "--max-batch-size", "KVMESH_MAX_BATCH_SIZE", 64, "most requests reserved or running", int)
    env_flag(
        parser,
        "--max-admit-per-step",
        "KVMESH_MAX_ADMIT_PER_STEP",
        4,
        "new KV loads admitted into the running batch per step",
        int,
    )
    env_flag(parser, "--torch-threads", "KVMESH_TORCH_THREADS", 0, "intra-op threads of the model (0: all cores)", int)
    env_flag(parser, "--metrics-port", "KVMESH_METRICS_PORT", 0, "HTTP port of Prometheus /metrics (0: none)", int)
    env_flag(parser, "--instance-id", "KVMESH_INSTANCE_ID", "", "name in logs and stats (empty: decode@host:port)")
    env_flag(
        parser,
        "--advertise-host",
        "KVMESH_ADVERTISE_HOST",
        "",
        "host prefill pushes KV to (empty: --host, or the hostname when --host is 0.0.0.0)",
    )


def config_from_args(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_batch_size=args.max_batch_size,
        max_admit_per_step=args.max_admit_per_step,
        torch_threads=args.torch_threads,
        kv_digest=os.environ.get("KVMESH_KV_DIGEST") == "1",
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        advertise_host=args.advertise_host,
    )
