"""Configuration of one prefill instance: one `setting` per field declares its flag, variable,
default and help (runtime/settings.py); the settings prefill shares with decode are in
runtime/service_config.py."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.service_config import ModelServiceConfig
from runtime.settings import setting


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
