"""Configuration of one prefill instance: one `setting` per field declares its flag, variable,
default and help (runtime/settings.py); the settings prefill shares with decode are in
runtime/service_config.py."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.runtime.service_config import ModelServiceConfig
from kvmesh.runtime.settings import setting


@dataclass(frozen=True)
class PrefillConfig(ModelServiceConfig):
    """Settings of a prefill instance, built once in main() from flags and KVMESH_* variables."""

    max_batch_tokens: int = setting(
        4096, "--max-batch-tokens", "most prompt tokens prefilled together in one forward", ge=1
    )
    chunked_prefill_size: int = setting(
        512,
        "--chunked-prefill-size",
        "prompt tokens computed per chunk; each chunk's KV is pushed to decode while the next computes (0: one chunk)",
        ge=0,
    )
    cpu_share_forward_tokens: int = setting(
        0,
        "--cpu-share-forward-tokens",
        "with --cpu-share: most prompt tokens one forward computes while the decode instance on the same cores has "
        "steps to run (each prompt's chunk shrinks to fit), which bounds what a forward adds to a decode token's "
        "latency, for some throughput and TTFT (64 on a 2-core AMD EPYC at 4 streams: ITL p99 232 -> 127 ms, "
        "output tok/s 149 -> 137, TTFT p99 1.3 -> 1.8 s); 0: no bound beyond the chunk size",
        ge=0,
    )
    kv_pull: bool = setting(
        True,
        "--kv-pull",
        "pull a prompt's prefix from the peer prefill instance that holds it (the gateway names it) instead of "
        "computing it, when the estimate says that is cheaper; needs a KV listener (--kv-port)",
        kind="flag",
    )
    kv_port: int = setting(0, "--kv-port", "port of the KV listener peers push pulled blocks to (0: any free port)")
    push_timeout_s: float = setting(
        30.0, "--push-timeout", "seconds one KV push may take before it fails with UNAVAILABLE", gt=0
    )
