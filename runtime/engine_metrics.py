"""The Prometheus metrics both engines export under one name each (prefill and decode put them
on their own registries): the KV page gauges, read from the engine's KVCacheManager at scrape
time (`KVCacheManager.bind_metrics`), and the CPU seconds of one engine step."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge, Histogram


def page_gauges(registry: CollectorRegistry, cached: bool = False) -> tuple[Gauge, Gauge, Gauge | None]:
    """(`kvmesh_kv_pages_used`, `kvmesh_kv_pages_free`, `kvmesh_kv_pages_cached` with cached,
    else None) on `registry`: pages referenced by requests in flight, pages a request could get
    now, pages holding a prefix-cache block."""
    used = Gauge("kvmesh_kv_pages_used", "KV pages referenced by requests in flight", registry=registry)
    free = Gauge(
        "kvmesh_kv_pages_free", "KV pages a request could get now (free, or cached and evictable)", registry=registry
    )
    if not cached:
        return used, free, None
    return used, free, Gauge("kvmesh_kv_pages_cached", "KV pages holding a prefix-cache block", registry=registry)


def step_cpu_histogram(registry: CollectorRegistry, buckets: Sequence[float]) -> Histogram:
    """`kvmesh_engine_step_cpu_seconds` on `registry`: process CPU seconds of one engine step
    (a batched forward), in `buckets` (seconds)."""
    return Histogram(
        "kvmesh_engine_step_cpu_seconds",
        "Process CPU seconds of one engine step (batched forward)",
        buckets=buckets,
        registry=registry,
    )
