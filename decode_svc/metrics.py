"""The decode service's Prometheus metrics (prometheus-client), served on --metrics-port.

Names follow Prometheus conventions: `kvmesh_` prefix, base units (seconds, tokens).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.runtime.engine_metrics import page_gauges, step_cpu_histogram
from kvmesh.runtime.moe_metrics import register_expert_load

REGISTRY = CollectorRegistry()

BATCH_SIZE = Gauge("kvmesh_decode_running_batch_size", "Requests in the running decode batch", registry=REGISTRY)
ACTIVE = Gauge("kvmesh_decode_active_requests", "Requests reserved, waiting or running", registry=REGISTRY)
PAGES_USED, PAGES_FREE, _ = page_gauges(REGISTRY)  # decode keeps no prefix cache
STEPS = Counter("kvmesh_decode_steps", "Decode steps (one batched forward each)", registry=REGISTRY)
TOKENS = Counter("kvmesh_decode_generated_tokens", "Tokens sampled by decode steps", registry=REGISTRY)
STEP_CPU = step_cpu_histogram(REGISTRY, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

CPU_SHARE_WAIT = Counter(
    "kvmesh_decode_cpu_share_wait_seconds",
    "Seconds decode steps waited for a prefill forward on the same cores (--cpu-share)",
    registry=REGISTRY,
)

ACCEPTED = Histogram(
    "kvmesh_decode_accepted_draft_tokens",
    "Draft tokens the model kept per sequence per speculative step (0 .. --num-draft-tokens)",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
    registry=REGISTRY,
)


def bind(engine) -> None:
    """Read the gauges from `engine` (a DecodeEngine) at scrape time."""
    register_expert_load(REGISTRY, engine.runner.expert_token_counts)
    BATCH_SIZE.set_function(lambda: engine.num_running)
    ACTIVE.set_function(lambda: engine.num_active_requests)
    engine.kv_cache.bind_metrics(used=PAGES_USED, free=PAGES_FREE)
