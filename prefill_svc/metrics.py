"""The prefill service's Prometheus metrics (prometheus-client), served on --metrics-port.

Names follow Prometheus conventions: `kvmesh_` prefix, base units (seconds, bytes, tokens).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.runtime.engine_metrics import page_gauges, step_cpu_histogram
from kvmesh.runtime.moe_metrics import register_expert_load

REGISTRY = CollectorRegistry()

QUEUE_DEPTH = Gauge("kvmesh_prefill_queue_depth", "Prefill requests queued or computing", registry=REGISTRY)
QUEUED_TOKENS = Gauge(
    "kvmesh_prefill_queued_tokens", "Prompt tokens of the queued or computing requests", registry=REGISTRY
)
PAGES_USED, PAGES_FREE, PAGES_CACHED = page_gauges(REGISTRY, cached=True)
CACHE_HIT_TOKENS = Counter(
    "kvmesh_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=REGISTRY
)
COMPUTED_TOKENS = Counter("kvmesh_prefill_computed_tokens", "Prompt tokens computed (not cached)", registry=REGISTRY)
TIER_HIT_TOKENS = Counter(
    "kvmesh_prefill_tier_hit_tokens",
    "Prompt tokens found in the second KV tier and loaded back (counted in the prefix cache hits too)",
    registry=REGISTRY,
)
PULLED_TOKENS = Counter(
    "kvmesh_prefill_pulled_tokens",
    "Prompt tokens pulled from a peer instead of computed (counted in the prefix cache hits too)",
    registry=REGISTRY,
)
PREFILLS = Counter("kvmesh_prefill_requests", "Prefills computed", registry=REGISTRY)
KV_BYTES = Counter("kvmesh_kv_transfer_bytes", "Bytes of KV state pushed to decode instances", registry=REGISTRY)
KV_SECONDS = Histogram(
    "kvmesh_kv_transfer_seconds",
    "Duration of one request's KV push",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
KV_PUSH_FAILURES = Counter(
    "kvmesh_kv_transfer_failures", "KV pushes to a decode instance that failed or timed out", registry=REGISTRY
)
STEP_CPU = step_cpu_histogram(REGISTRY, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def bind(engine) -> None:
    """Read the gauges from `engine` (a PrefillEngine) at scrape time."""
    register_expert_load(REGISTRY, engine.runner.expert_token_counts)
    QUEUE_DEPTH.set_function(lambda: engine.pending.num_active)
    QUEUED_TOKENS.set_function(lambda: engine.pending.num_queued_tokens)
    engine.kv_cache.bind_metrics(used=PAGES_USED, free=PAGES_FREE, cached=PAGES_CACHED)


def observe_prefill(result) -> None:
    """Count one finished prefill (a PrefillResult)."""
    PREFILLS.inc()
    CACHE_HIT_TOKENS.inc(result.num_cached_tokens)
    TIER_HIT_TOKENS.inc(result.num_tier_tokens)
    COMPUTED_TOKENS.inc(result.num_computed_tokens)


def observe_push(nbytes: int, seconds: float) -> None:
    KV_BYTES.inc(nbytes)
    KV_SECONDS.observe(seconds)
