"""The gateway's Prometheus metrics (prometheus-client), served over HTTP on --metrics-port.

Names follow Prometheus conventions: `kvmesh_` prefix, base units, `_total` on counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry()
"""This process's registry (not the library's global one: tests may start several gateways)."""

PREFIX_INDEX_UP = Gauge("kvmesh_gateway_prefix_index_up",
                        "1 while the Redis prefix index answers, 0 while routing falls back to load alone",
                        registry=REGISTRY)
ROUTED_REQUESTS = Counter("kvmesh_gateway_routed_requests_total",
                          "Requests routed to a prefill instance, by policy and by whether the prefix index "
                          "informed the choice (index=prefix) or was down (index=load_only)",
                          ["policy", "index"], registry=REGISTRY)
INDEX_CACHED_TOKENS = Counter("kvmesh_gateway_index_cached_tokens_total",
                              "Prompt tokens the index reported cached on the chosen prefill instance",
                              registry=REGISTRY)
