"""A request's latency targets (its SLO): TTFT and ITL in seconds, from the request (the gRPC
fields slo_ttft_ms / slo_itl_ms, or the headers x-slo-ttft-ms / x-slo-tpot-ms that llm-d's
clients send), else from the gateway's settings (--slo-ttft-ms, --slo-itl-ms). What the gateway
does with them is kvmesh.gateway.tries': route where the prediction meets them, and with
--slo-miss shed refuse a request no instance is predicted to serve in time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

TTFT_HEADER = "x-slo-ttft-ms"
ITL_HEADERS = ("x-slo-tpot-ms", "x-slo-itl-ms")
"""llm-d's header names (TPOT: time per output token, the ITL a client sees), and ours."""

SLO_MISS = ("queue", "shed")
"""What the gateway does with a request no instance is predicted to serve within its SLO:
queue it where the predicted TTFT is least, or shed it at once (RESOURCE_EXHAUSTED, HTTP 429,
with a retry-after from the prediction)."""


@dataclass(frozen=True)
class Slo:
    """Latency targets in seconds; 0: none."""

    ttft_s: float = 0.0
    itl_s: float = 0.0

    def __bool__(self) -> bool:
        return self.ttft_s > 0 or self.itl_s > 0


NO_SLO = Slo()
"""No latency target."""


def slo_of(fields_ms: tuple[float, float], metadata: Sequence[tuple[str, str | bytes]], default: Slo) -> Slo:
    """The request's SLO: its fields (ms, gRPC; 0: unset), else its headers (ms), else `default`.
    Raises ValueError naming the header for a value that is not a non-negative finite number."""
    ttft_ms, itl_ms = fields_ms
    headers = {k.lower(): v for k, v in metadata}
    if not ttft_ms and TTFT_HEADER in headers:
        ttft_ms = _milliseconds(TTFT_HEADER, headers[TTFT_HEADER])
    for name in ITL_HEADERS:
        if not itl_ms and name in headers:
            itl_ms = _milliseconds(name, headers[name])
    for name, value in (("slo_ttft_ms", ttft_ms), ("slo_itl_ms", itl_ms)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative number of milliseconds, got {value}")
    return Slo(ttft_ms / 1000 if ttft_ms else default.ttft_s, itl_ms / 1000 if itl_ms else default.itl_s)


def _milliseconds(name: str, value: str | bytes) -> float:
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of milliseconds, got {text[:32]!r}") from None
    if not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"{name} must be a non-negative number of milliseconds, got {text[:32]!r}")
    return ms
