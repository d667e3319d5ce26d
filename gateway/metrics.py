"""The gateway's Prometheus metrics (prometheus-client), served over HTTP on --metrics-port.

Names follow Prometheus conventions: `kvmesh_` prefix, base units, `_total` on counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()
"""This process's registry (not the library's global one: tests may start several gateways)."""

PREFIX_INDEX_UP = Gauge(
    "kvmesh_gateway_prefix_index_up",
    "1 while the Redis prefix index answers, 0 while routing falls back to load alone",
    registry=REGISTRY,
)
ROUTED_REQUESTS = Counter(
    "kvmesh_gateway_routed_requests_total",
    "Requests routed to a prefill instance, by policy and by whether the prefix index "
    "informed the choice (index=prefix) or was down (index=load_only)",
    ["policy", "index"],
    registry=REGISTRY,
)
INDEX_CACHED_TOKENS = Counter(
    "kvmesh_gateway_index_cached_tokens_total",
    "Prompt tokens the index reported cached on the chosen prefill instance",
    registry=REGISTRY,
)

DESIRED_INSTANCES = Gauge(
    "kvmesh_gateway_desired_instances",
    "Instances of each role the load needs against the SLO (kvmesh.gateway.scale_advice): what "
    "`kvmesh up --autoscale` and a Kubernetes autoscaler scale to",
    ["role"],
    registry=REGISTRY,
)
INSTANCES = Gauge(
    "kvmesh_gateway_instances", "Routable instances of each role, as the gateway sees them", ["role"], registry=REGISTRY
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TTFT = Histogram(
    "kvmesh_request_ttft_seconds",
    "Time from a request's arrival to its first token",
    buckets=_LATENCY,
    registry=REGISTRY,
)
ITL = Histogram(
    "kvmesh_request_itl_seconds",
    "Mean time between a request's tokens after the first",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
E2E = Histogram(
    "kvmesh_request_e2e_seconds", "Time from a request's arrival to its last token", buckets=_LATENCY, registry=REGISTRY
)
REQUESTS = Counter(
    "kvmesh_requests",
    "Requests ended, by finish reason (stop, length, or error) and gRPC status",
    ["finish_reason", "status"],
    registry=REGISTRY,
)
TTFT_PREDICTION_ERROR = Histogram(
    "kvmesh_gateway_ttft_prediction_error_seconds",
    "Predicted minus measured TTFT of each request the gateway predicted (kvmesh.gateway.predictor): "
    "negative when the prediction was short",
    buckets=(-10, -2.5, -1, -0.5, -0.25, -0.1, -0.05, -0.025, 0, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    registry=REGISTRY,
)
TTFT_PREDICTION_RATIO = Histogram(
    "kvmesh_gateway_ttft_prediction_ratio",
    "Predicted over measured TTFT of each request the gateway predicted (1: exact; 0.75-1.25: within 25%)",
    buckets=(0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2, 4),
    registry=REGISTRY,
)
SLO_REQUESTS = Counter(
    "kvmesh_gateway_slo_requests_total",
    "Requests with an SLO, by outcome: met (TTFT and ITL within it), missed, or shed (refused at routing "
    "because no instance was predicted to meet it, --slo-miss shed)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("met", "missed", "shed"):  # at 0 from the start: a first shed is a rate, not a new series
    SLO_REQUESTS.labels(_outcome)
