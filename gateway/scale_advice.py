"""How many prefill and decode instances the load needs against the SLO, from what every stats
poll brings (each instance's queue, rows and published latency profile) and the gateway's own
admission queue: the number `kvmesh up --autoscale` acts on and a Kubernetes autoscaler (KEDA
or an HPA on an external metric) scales the Deployments to (`kvmesh_gateway_desired_instances`).

Load-based, as Dynamo's planner in its load mode, with a margin each way:

    prefill  up   when the mean predicted queue wait (queued tokens by each instance's profile,
                  over the share of its cores it gets: kvmesh.gateway.prefill_queues) is over
                  half the TTFT target: a new request would spend its budget waiting
             down when that queue spread over one instance fewer would wait under a tenth of it
    decode   up   when a step of the busiest decode (by its profile) is over 0.8 x the ITL target,
                  its rows fill 90% of the decode slots, or requests wait for a slot
             down when the rows on one instance fewer would step under 0.4 x the target and fill
                  under half of its slots, and nothing waits

A change is advised only after it has held for `up_after` polls in a row (`down_after` to remove:
removing is slower to decide, since draining one takes its requests' time), one instance at a
time: the advice is the routable count plus or minus one, so an instance still starting is not
asked for twice. Without an SLO the advice is the current count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvmesh.gateway import metrics
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.predictor import queued_s, step_s
from kvmesh.gateway.prefill_queues import cores_shares, fitted_step_s, has_prefill_fit
from kvmesh.gateway.slo import Slo

logger = logging.getLogger(__name__)

PREFILL_UP, PREFILL_DOWN = 0.5, 0.1
"""Shares of the TTFT target the mean queue wait crosses to add / remove a prefill."""
DECODE_UP, DECODE_DOWN = 0.8, 0.4
"""Shares of the ITL target a decode step crosses to add / remove a decode."""
SLOTS_UP, SLOTS_DOWN = 0.9, 0.5
"""Shares of the decode slots (each decode's max_requests) the rows fill to add / remove a decode."""


class ScaleAdvisor:
    """`update()` after each stats poll; `desired` holds the advice per role ("prefill", "decode").

    slo: the gateway's default targets (`--slo-ttft-ms`, `--slo-itl-ms`); num_waiting: the
    requests waiting for a decode slot (the admission queue's length)."""

    def __init__(
        self,
        slo: Slo,
        prefills: Sequence[InstanceLoad],
        decodes: Sequence[InstanceLoad],
        num_waiting: Callable[[], int],
        up_after: int = 3,
        down_after: int = 20,
    ) -> None:
        self.slo, self.prefills, self.decodes, self.num_waiting = slo, prefills, decodes, num_waiting
        self.up_after, self.down_after = up_after, down_after
        self.desired: dict[str, int] = {}
        self.why: dict[str, str] = {}
        self._held: dict[str, tuple[int, int]] = {}
        """role -> (the direction wanted, +1 / -1 / 0, and for how many polls in a row)."""

    def update(self) -> None:
        for role, insts, want in (
            ("prefill", self.prefills, self._prefill_want),
            ("decode", self.decodes, self._decode_want),
        ):
            live = [i for i in insts if i.routable]
            direction, why = want(live) if self.slo else (0, "")
            held = self._held.get(role, (0, 0))
            held = (direction, held[1] + 1) if held[0] == direction else (direction, 1)
            self._held[role] = held
            after = self.up_after if direction > 0 else self.down_after
            desired = len(live) + direction if direction and held[1] >= after else len(live)
            desired = max(desired, 1)
            if desired != self.desired.get(role, len(live)) and desired != len(live):
                logger.info("scale advice: %s %d -> %d (%s)", role, len(live), desired, why)
            self.desired[role], self.why[role] = desired, why if desired != len(live) else ""
            metrics.DESIRED_INSTANCES.labels(role).set(desired)
            metrics.INSTANCES.labels(role).set(len(live))

    def _prefill_want(self, live: list[InstanceLoad]) -> tuple[int, str]:
        """(+1, -1 or 0, why) for the prefill instances `live`."""
        profiled = [p for p in live if has_prefill_fit(p)]
        if not self.slo.ttft_s or not profiled:
            return 0, ""
        # no prompt tokens waiting, no wait: requests that are pushing (or a count that lags)
        # hold no compute back
        # each queue's compute by its profile, stretched by the share of the cores its forwards
        # get while the others with work share them too (1 on cores of its own)
        shares = cores_shares([p for p in profiled if p.reported_queued_tokens > 0], self.decodes)
        waits = [
            queued_s(p, p.reported_queued_tokens, max(p.reported_active_requests, p.in_flight_requests))
            / shares[p.address]
            if p.reported_queued_tokens > 0
            else 0.0
            for p in profiled
        ]
        mean = sum(waits) / len(waits)
        if mean > PREFILL_UP * self.slo.ttft_s:
            return 1, f"prefill queue wait {mean:.2f} s > {PREFILL_UP:g} x the TTFT target"
        n = len(live)
        if n > 1 and mean * n / (n - 1) < PREFILL_DOWN * self.slo.ttft_s:
            return -1, f"prefill queue wait on {n - 1} instances {mean * n / (n - 1):.2f} s < {PREFILL_DOWN:g} x target"
        return 0, ""

    def _decode_want(self, live: list[InstanceLoad]) -> tuple[int, str]:
        """(+1, -1 or 0, why) for the decode instances `live`."""
        if not live:
            return 0, ""
        waiting = self.num_waiting()
        rows = sum(max(d.in_flight_requests, d.reported_active_requests) for d in live)
        slots = sum(d.max_requests for d in live if d.max_requests)
        profiled = [d for d in live if len(d.decode_fit) == 3]
        worst = max((step_s(d) for d in profiled), default=0.0)
        if waiting:
            return 1, f"{waiting} requests wait for a decode slot"
        if slots and rows >= SLOTS_UP * slots:
            return 1, f"{rows} rows fill {rows / slots:.0%} of the decode slots"
        if self.slo.itl_s and worst > DECODE_UP * self.slo.itl_s:
            return 1, f"decode step {worst * 1000:.0f} ms > {DECODE_UP:g} x the ITL target"
        n = len(live)
        if n < 2 or not profiled:
            return 0, ""
        context = sum(x.context_tokens for x in live)
        fewer = fitted_step_s(profiled[0].decode_fit, rows / (n - 1), context / (n - 1)) if rows else 0.0
        fits = not slots or rows < SLOTS_DOWN * slots * (n - 1) / n
        if fits and (not self.slo.itl_s or fewer < DECODE_DOWN * self.slo.itl_s):
            return -1, f"{rows} rows would step in {fewer * 1000:.0f} ms on {n - 1} decode instances"
        return 0, ""
