"""The least-cost mesh whose simulated latencies meet an SLO (kvmesh.planner.simulate).

Every shape up to the caps is simulated on the workload (on shared cores, only chunks whose
forward fits the cores' turn: `TURN_BOUND_S`); a shape meets the SLO when its
`percentile`-th TTFT and ITL are within the targets and it keeps up (its last request ends
within `drain_s` of the last arrival plus that request's own TTFT and answer, so a queue that
grows without bound is not mistaken for a slow one). Cost is prefill instances x prefill_cost +
decode instances x decode_cost; among the shapes of the least cost that meet the SLO, the one
with the lowest TTFT at the percentile wins (then ITL). Shapes go out in order of cost, and the
search stops at the first cost that has one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.planner.profile import Profile
from kvmesh.planner.simulate import MeshShape, SimResult, simulate
from kvmesh.planner.workload import Workload

CHUNKS = (128, 256, 512, 1024, 2048)
BATCH_CAPS = (8, 16, 32, 64, 128)
TURN_BOUND_S = 2.0
"""The most seconds one side waits for its turn on shared cores (--cpu-share-max-wait's default).
A forward longer than this runs beside decode steps instead of between them, and both slow down
(runtime/cpu_share.py), which the simulation does not model. On shared cores the planner only
tries chunks whose forward is predicted within `TURN_MARGIN` of this bound."""
TURN_MARGIN = 0.75


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float
    percentile: float = 90.0
    """The share of requests (0-100) that must meet each target."""

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLO targets must be > 0, got TTFT {self.ttft_s} s and ITL {self.itl_s} s")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"the percentile must be in (0, 100], got {self.percentile}")


@dataclass(frozen=True)
class Candidate:
    shape: MeshShape
    cost: float
    result: SimResult
    meets: bool

    def figures(self) -> dict[str, float]:
        """TTFT and ITL p50/p90/p99 (seconds)."""
        return {f"{which}_p{q}_s": self.result.percentile(which, q) for which in ("ttft", "itl") for q in (50, 90, 99)}


def meets(result: SimResult, workload: Workload, slo: Slo) -> bool:
    """The result's percentiles within the SLO and its queue bounded (see the module)."""
    last = workload.requests[-1]
    bound = last.arrival_s + 4 * (slo.ttft_s + slo.itl_s * max(last.output_tokens, 1)) + 10
    return (
        result.percentile("ttft", slo.percentile) <= slo.ttft_s
        and result.percentile("itl", slo.percentile) <= slo.itl_s
        and result.end_s <= bound
    )


def plan(
    workload: Workload,
    profile: Profile,
    slo: Slo,
    max_prefill: int = 4,
    max_decode: int = 4,
    prefill_cost: float = 1.0,
    decode_cost: float = 1.0,
    chunks: Sequence[int] = CHUNKS,
    batch_caps: Sequence[int] = BATCH_CAPS,
    shared_cores: bool | None = None,
) -> tuple[Candidate | None, list[Candidate]]:
    """(the chosen shape, or None when none up to the caps meets the SLO; every shape simulated).

    Raises ValueError for an empty workload, caps < 1, costs <= 0, or a request longer than the
    profile's model context."""
    if not workload.requests:
        raise ValueError("the workload has no requests")
    if max_prefill < 1 or max_decode < 1 or prefill_cost <= 0 or decode_cost <= 0:
        raise ValueError("instance caps must be >= 1 and costs > 0")
    longest = max(r.input_tokens + r.output_tokens for r in workload.requests)
    if longest > profile.max_context_tokens:
        raise ValueError(f"a request of {longest} tokens exceeds the model's context of {profile.max_context_tokens}")
    if profile.shared_cores if shared_cores is None else shared_cores:
        fits = [c for c in chunks if profile.forward_s(c, c * c / 2) <= TURN_MARGIN * TURN_BOUND_S]
        chunks = fits or [min(chunks)]
    counts = sorted(
        itertools.product(range(1, max_prefill + 1), range(1, max_decode + 1)),
        key=lambda pd: (pd[0] * prefill_cost + pd[1] * decode_cost, pd),
    )
    tried: list[Candidate] = []
    best: Candidate | None = None
    for p, d in counts:
        cost = p * prefill_cost + d * decode_cost
        if best is not None and cost > best.cost:
            break
        for chunk, cap in itertools.product(chunks, batch_caps):
            shape = MeshShape(p, d, chunk, cap)
            result = simulate(workload, shape, profile, shared_cores)
            c = Candidate(shape, cost, result, meets(result, workload, slo))
            tried.append(c)
            if c.meets and (best is None or _rank(c, slo) < _rank(best, slo)):
                best = c
    return best, tried


def _rank(c: Candidate, slo: Slo) -> tuple[float, float, float, int]:
    return (
        c.cost,
        round(c.result.percentile("ttft", slo.percentile), 3),
        round(c.result.percentile("itl", slo.percentile), 4),
        -c.shape.max_batch_size,
    )
