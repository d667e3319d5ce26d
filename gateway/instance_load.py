"""What the gateway knows of one instance: `InstanceLoad`, its health and its load (the
gateway's own in-flight accounting plus what the instance last reported), and
`queued_tokens`, the prefill queue the routing policies weigh."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.gateway.breaker import CircuitBreaker


@dataclass
class InstanceLoad:
    """What the gateway knows about one instance; counts are its own in-flight accounting
    plus what the instance last reported.

    It is routable when it answers its health polls (`reachable`), agrees with the
    gateway on page size and model and with the mesh on dtype (`mismatch` is empty) and its
    circuit breaker lets a request through.
    """

    address: str
    instance_id: str = ""
    reachable: bool = True
    failed_polls: int = 0
    """Stats polls in a row that failed."""
    mismatch: str = ""
    """Why the instance cannot serve with this gateway (page size, model or dtype differ); '' when it can."""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    reported_queued_tokens: int = 0
    reported_active_requests: int = 0
    polled_at: float = 0.0
    """When the stats poll whose answer set the reported_* counts was sent (time.monotonic())."""
    max_requests: int = 0
    """Requests the instance takes at once, as it reports (decode); 0 until known."""
    total_routed_tokens: int = 0
    """Prefill tokens of requests routed here that were not cancelled (the cache_aware tie-break)."""
    kv_address: str = ""
    """Where prefill pushes this decode instance's KV, as its stats and Reserve answers last said;
    '' until known (the gateway then waits for Reserve before it sends Prefill)."""
    kv_layout: str = ""
    """The KV page layout the instance reported (kvmesh.engine.kv_layout.PageLayout.describe); '' until it has."""
    kv_tier_medium: str = ""
    """The medium of the instance's second KV tier ("host", "disk"), as it reported; '' for none."""
    dtype: str = ""
    """What the instance computes in ("float32", "bfloat16"), as it reported; '' until it has."""
    prefill_fit: tuple[float, ...] = ()
    push_fit: tuple[float, ...] = ()
    decode_fit: tuple[float, ...] = ()
    """The latency profile the instance reported (InstanceStats' fields of those names; () until
    measured): what kvmesh.gateway.predictor predicts TTFT and ITL from."""
    decode_compute_fit: tuple[float, ...] = ()
    """Decode: decode_fit with the turns waited on shared cores left out (what a step costs them)."""
    context_tokens: int = 0
    """Decode: the tokens of context its running requests hold, as it reported."""
    core_group: str = ""
    """Which cores the instance shares with others of its group ('' when it has cores of its own)."""
    max_forward_tokens: int = 0
    """Prefill: the most tokens one forward computes, as it reported (0: unbounded)."""

    @property
    def routable(self) -> bool:
        return self.reachable and not self.mismatch and self.breaker.allows()

    @property
    def has_free_slot(self) -> bool:
        """Fewer requests in flight here than it takes (always, while its capacity is unknown)."""
        load = max(self.in_flight_requests, self.reported_active_requests)
        return not self.max_requests or load < self.max_requests


def queued_tokens(inst: InstanceLoad) -> int:
    """Prefill tokens queued on an instance: the gateway's own count or the instance's report,
    whichever is larger (the report lags a burst; the gateway does not see other gateways)."""
    return max(inst.in_flight_tokens, inst.reported_queued_tokens)
