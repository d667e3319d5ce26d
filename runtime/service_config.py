"""Settings every model-serving process (prefill and decode) shares, declared once; each
service's config dataclass extends `ModelServiceConfig` with its own."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from kvmesh.kvstore.transports import check_transport
from kvmesh.runtime.settings import check_bounds, setting


def metrics_port_setting() -> Any:
    """The `--metrics-port` field every service (the gateway too) declares."""
    return setting(0, "--metrics-port", "HTTP port of Prometheus /metrics (0: none)")


def redis_url_setting(what: str) -> Any:
    """The `--redis-url` field every service (the gateway too) declares; `what`, its help, says
    what the service keeps in that Redis."""
    return setting("", "--redis-url", what, env="REDIS_URL")


def drain_grace_setting() -> Any:
    """The `--drain-grace` field every service (the gateway too) declares."""
    return setting(
        25.0,
        "--drain-grace",
        "seconds in-flight requests may run on after SIGTERM before they are cut off "
        "(keep it under Kubernetes' terminationGracePeriodSeconds)",
        ge=0,
    )


@dataclass(frozen=True)
class ModelServiceConfig:
    """Model, server, KV memory and kernel settings of a prefill or decode instance."""

    model: str | None = setting(None, "--model", "model name or path (none: SmolLM2-135M-Instruct)")
    host: str = setting("127.0.0.1", "--host", "address the gRPC server (and decode's KV listener) binds to")
    port: int = setting(0, "--port", "gRPC port (0: any free port)")
    advertise_host: str = setting(
        "",
        "--advertise-host",
        "host other machines reach this instance at: its address in the instance registry, and on decode where "
        "prefill pushes KV (empty: --host, or this machine's hostname when --host is 0.0.0.0 or ::)",
    )
    num_pages: int = setting(
        1024, "--num-pages", "KV pages in the pool (on prefill, pages left over hold the prefix cache)", ge=1
    )
    page_size: int = setting(16, "--page-size", "token slots per page; the same on every service of a mesh", ge=1)
    torch_threads: int = setting(0, "--torch-threads", "intra-op threads of the model (0: torch's default, every core)")
    device: str = setting(
        "auto",
        "--device",
        "where the model computes and its KV pages live: auto (cuda:0 when torch sees a CUDA device, else cpu), "
        "cpu, or cuda[:N] (weights, pages and state slots on the GPU, in --dtype; the Triton kernels; refused at "
        "start when torch sees no such device)",
    )
    dtype: str = setting(
        "auto",
        "--dtype",
        "what the model computes in and keeps its KV pages in: auto (bfloat16 where the hardware computes it "
        "natively: CUDA sm80+, or a CPU with amx_bf16 or avx512_bf16 in its flags; else float32), float32 (greedy "
        "tokens equal transformers' fp32), or bfloat16; every prefill and decode of a mesh needs the same "
        "(docs/precision.md)",
    )
    quantization: str = setting(
        "none",
        "--quantization",
        "the layers' matmul activations: none (as --dtype), or int8 (W4A8: each row's inputs as int8 blocks against "
        "the GGUF file's Q4_1 weights, llama.cpp's Q8 activations; Llama on the CPU only; the lm_head, attention and "
        "the pages keep --dtype; judged by the rule in docs/precision.md)",
    )
    kernel_backend: str = setting(
        "torch",
        "--kernel-backend",
        "MoE and indexer kernels on the CPU: torch, or triton (TRITON_INTERPRET=1); on a GPU they are always "
        "the Triton kernels",
    )
    enable_prefix_caching: bool = setting(
        True,
        "--prefix-caching",
        "keep a request's full blocks after it ends and reuse them for later requests: on prefill the prompt's "
        "(computed once), on decode the prompt's and the answer's (not pushed again); both publish them as KV "
        "events to the prefix index",
        kind="flag",
    )
    kv_tier_blocks: int = setting(
        0,
        "--kv-tier-blocks",
        "blocks a second KV tier keeps of those the page pool evicts, loaded back into the pool on a later prefix "
        "hit instead of recomputed (with prefix caching); 0: none",
        ge=0,
    )
    kv_tier_dir: str = setting(
        "",
        "--kv-tier-dir",
        "where the second tier keeps its blocks as files (medium `disk`; a directory of this instance's own is "
        "made under it and removed at exit); empty: host memory (medium `host`, beside a GPU pool only)",
    )
    kv_transport: str = setting("ucx", "--kv-transport", "how KV pages move from prefill to decode: ucx")
    kv_push_path: str = setting(
        "auto",
        "--kv-push-path",
        "how a push reaches pages on a GPU: auto (UCX moves device memory itself when it loaded a CUDA transport, "
        "else through host buffers), direct, or staged (through pinned host buffers); pages in host memory always "
        "move in place",
    )
    redis_url: str = redis_url_setting(
        "Redis of the instance registry, where gateways find this instance, and on prefill of the prefix index "
        "its KV events feed (empty: neither)"
    )
    metrics_port: int = metrics_port_setting()
    instance_id: str = setting(
        "", "--instance-id", "name in the prefix index, logs and stats (empty: from the gRPC address)"
    )
    drain_grace_s: float = drain_grace_setting()
    lease_ttl_s: float = setting(
        10.0,
        "--lease-ttl",
        "seconds this instance stays in the instance registry (and its prefix-index entries count) after its "
        "last renewal; renewed every third of it, so a dead or frozen instance drops out this long after it stops",
        env="KVMESH_LEASE_TTL_S",
        gt=0,
    )
    cpu_share: str = setting(
        "",
        "--cpu-share",
        "a file the prefill and decode instances on the same CPU cores share to take turns, one prefill forward or "
        "one decode step at a time, so the two do not fight over the cores (`kvmesh up` makes one); empty: off",
    )
    cpu_share_max_wait_s: float = setting(
        2.0,
        "--cpu-share-max-wait",
        "seconds a peer's turn or ask holds a prefill forward or a decode step back at most: a longer forward or "
        "step, or a peer that stopped asking (dead or frozen), is passed over (with --cpu-share)",
        ge=0,
    )
    kv_digest: bool = setting(
        False,
        "--kv-digest",
        "hash each request's KV pages (SHA-256) on both ends of a push and report it (tests)",
        kind="flag",
    )

    def __post_init__(self) -> None:
        check_bounds(self)  # this class's fields and the subclass's
        # imported here: the kernels package loads torch, and the gateway's command line
        # (which never builds this config) parses these flags too
        from kvmesh.engine.device import check_device_spec
        from kvmesh.engine.precision import check_dtype_spec, check_quantization_spec
        from kvmesh.kernels.backend import check_backend
        from kvmesh.kvstore.staging import check_push_path

        check_device_spec(self.device)  # whether this machine has it: kvmesh.engine.device.resolve_device at start
        check_dtype_spec(self.dtype)  # what it means here: kvmesh.engine.runners.runner_precision at start
        check_quantization_spec(self.quantization)  # where it can run: kvmesh.engine.precision.apply_quantization
        check_backend(self.kernel_backend)
        check_transport(self.kv_transport)
        check_push_path(self.kv_push_path)

    @property
    def reachable_host(self) -> str:
        """The host other machines reach this instance at: --advertise-host, else --host
        unless it is a wildcard (no address to dial), else this machine's hostname."""
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host

    def reachable_address(self, port: int) -> str:
        """host:port of this instance's gRPC server as others dial it (`reachable_host`, an
        IPv6 address in brackets); `port` is the port the server bound."""
        host = self.reachable_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{port}"
