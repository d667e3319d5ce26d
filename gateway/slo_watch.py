"""One request's latency predictions at the gateway and how they turn out (kvmesh.gateway.tries
runs it): before routing, whether any instance is predicted to meet the request's SLO (with
--slo-miss shed, a request none is gets RESOURCE_EXHAUSTED at once, never a page or a queue
slot); at routing, the TTFT and ITL predicted where it goes (on the route's span and in Final);
at its first token, the measured TTFT that calibrates the predictor; at its end, the prediction's
error and whether the SLO was met (Prometheus), and the prediction's line in --predictor-log."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import NoReturn

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway import metrics
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.pool import InstancePool
from kvmesh.gateway.predictor import TtftPrediction
from kvmesh.gateway.prefill_queues import Job
from kvmesh.gateway.router import RouteAsk, RouteDecision
from kvmesh.gateway.slo import Slo
from kvmesh.protos.v1 import gateway_pb2


class SloWatch:
    """The predictions of one request (arrived at `arrived`, time.perf_counter() seconds)."""

    def __init__(self, pool: InstancePool, slo: Slo, request_id: str, num_prompt_tokens: int, arrived: float) -> None:
        self.pool, self.slo, self.request_id = pool, slo, request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrived = arrived
        self.prefill: InstanceLoad | None = None
        self.ttft: TtftPrediction | None = None
        self.itl_s: float | None = None
        self.routed_at = 0.0
        self.calibrated = False
        self.job: Job | None = None  # this try's place in the predictor's model of the queue
        self._inputs: dict = {}  # what the prediction read, for --predictor-log
        self._record: dict = {}  # the prediction and the TTFT measured, written with the request's end

    @property
    def ttft_budget_s(self) -> float:
        """What is left of the TTFT SLO now (seconds, at least 1 ms); 0 without a TTFT SLO."""
        if not self.slo.ttft_s:
            return 0.0
        return max(self.slo.ttft_s - (time.perf_counter() - self.arrived), 1e-3)

    def check(self, cached_blocks: Mapping[str, int], exclude: frozenset[str]) -> None:
        """Shed: raise RequestFailed(OVERLOADED, retry_after_s from the prediction) when no
        routable prefill is predicted to meet the TTFT SLO or no decode the ITL SLO. An
        instance without a profile yet is taken to meet it (nothing says otherwise)."""
        misses = []
        retry_after = 1.0
        if self.slo.ttft_s:
            best = self._best_ttft(cached_blocks, exclude)
            budget = self.ttft_budget_s
            if best is not None and best > budget:
                misses.append(f"TTFT {best * 1000:.0f} ms predicted, {budget * 1000:.0f} ms left of its SLO")
                retry_after = max(retry_after, best - budget)
        if self.slo.itl_s:
            best_itl = self.pool.best_itl(self.num_prompt_tokens, exclude)
            if best_itl is not None and best_itl > self.slo.itl_s:
                misses.append(f"ITL {best_itl * 1000:.1f} ms predicted, SLO {self.slo.itl_s * 1000:.1f} ms")
        if misses:
            self._shed(misses, retry_after)

    def check_route(self, decision: RouteDecision) -> None:
        """Shed, at routing: raise RequestFailed(OVERLOADED) when the prefill the request was
        routed to is not predicted to meet what is left of its TTFT SLO (`check` passed before
        its decode was reserved; the queues may have grown since). The caller's abort releases
        what the attempt took."""
        if self.slo.ttft_s and decision.predicted_ttft_s is not None and not decision.meets_slo:
            budget = self.ttft_budget_s
            self._shed(
                [f"TTFT {decision.predicted_ttft_s * 1000:.0f} ms predicted, {budget * 1000:.0f} ms left of its SLO"],
                max(1.0, decision.predicted_ttft_s - budget),
            )

    def _shed(self, misses: list[str], retry_after_s: float) -> NoReturn:
        metrics.SLO_REQUESTS.labels("shed").inc()
        raise RequestFailed(
            FailureCause.OVERLOADED,
            f"[{self.request_id}] no instance is predicted to meet this request's SLO ({'; '.join(misses)}); "
            "retry later, or relax x-slo-ttft-ms / x-slo-tpot-ms",
            retry_after_s=math.ceil(retry_after_s),
        )

    def _best_ttft(self, cached_blocks: Mapping[str, int], exclude: frozenset[str]) -> float | None:
        """The least TTFT predicted over the routable prefill instances; None when one has no profile."""
        ask = RouteAsk(self.num_prompt_tokens, cached_blocks, self.pool.page_size, ())
        best: float | None = None
        for inst in self.pool.prefills:
            if not inst.routable or inst.address in exclude:
                continue
            found = self.pool.predictor.ttft(inst, self.num_prompt_tokens, ask.cached_tokens(inst))
            if found is None:
                return None
            best = found.seconds if best is None else min(best, found.seconds)
        return best

    def routed(self, prefill: InstanceLoad, decision: RouteDecision, decode: InstanceLoad, decode_pages: int) -> dict:
        """The try went to `prefill` and `decode` (holding `decode_pages` of the prompt): its
        predictions, and the route span's attributes that show them and their inputs."""
        self.prefill, self.routed_at, self.calibrated, self.job = prefill, time.perf_counter(), False, None
        predictor = self.pool.predictor
        self.ttft = predictor.ttft(prefill, self.num_prompt_tokens, decision.cached_tokens, decode_pages)
        self.itl_s = predictor.itl(decode, self.num_prompt_tokens)
        if self.ttft is not None:
            if predictor.log is not None:
                jobs_ahead, busy = predictor.queues.depth(prefill)
                self._inputs = {
                    "cached_tokens": decision.cached_tokens,
                    "decode_cached_pages": decode_pages,
                    "jobs_ahead": jobs_ahead,
                    "prefills_busy": busy,
                }
            self.job = predictor.commit(prefill, self.ttft)
        attributes: dict = {"kvmesh.slo.ttft_s": self.slo.ttft_s, "kvmesh.slo.itl_s": self.slo.itl_s}
        if self.ttft is not None:
            attributes.update(
                {
                    "kvmesh.predicted.ttft_s": self.routed_at - self.arrived + self.ttft.seconds,
                    "kvmesh.predicted.raw_s": self.ttft.raw_s,
                    "kvmesh.predicted.queue_s": self.ttft.queue_s,
                    "kvmesh.predicted.compute_s": self.ttft.compute_s,
                    "kvmesh.predicted.push_s": self.ttft.push_s,
                    "kvmesh.predicted.cores_share": self.ttft.share,
                    "kvmesh.predicted.meets_slo": decision.meets_slo,
                }
            )
        if self.itl_s is not None:
            attributes["kvmesh.predicted.itl_s"] = self.itl_s
        return attributes

    def first_token(self) -> None:
        """The first token is out: its TTFT since routing calibrates the predictor (once a try)."""
        if self.calibrated or self.prefill is None or self.ttft is None or self.job is None:
            return
        self.calibrated = True
        measured_s = time.perf_counter() - self.routed_at
        predictor = self.pool.predictor
        predictor.observe(self.prefill, self.ttft, measured_s, self.job)
        if predictor.log is not None:
            t = self.ttft
            self._record = {
                "request_id": self.request_id,
                "routed_at": round(time.time() - measured_s, 3),
                "prefill": self.prefill.address,
                "core_group": self.prefill.core_group,
                "prompt_tokens": self.num_prompt_tokens,
                **self._inputs,
                "queue_s": t.queue_s,
                "compute_s": t.compute_s,
                "push_s": t.push_s,
                "raw_s": t.raw_s,
                "predicted_s": t.seconds,
                "share": t.share,
                "rows": t.rows,
                "measured_s": measured_s,
            }

    def final(self, final: gateway_pb2.Final) -> None:
        """Put the predictions in `final` (TTFT from arrival), count the error and the SLO's
        outcome, and write the prediction's line (--predictor-log) with the parts prefill measured."""
        if self._record and self.pool.predictor.log is not None:
            self.pool.predictor.log.write({**self._record, **measured_parts(final)})
            self._record = {}
        if self.ttft is not None:
            final.predicted_ttft_s = self.routed_at - self.arrived + self.ttft.seconds
            if final.ttft_s > 0:
                metrics.TTFT_PREDICTION_ERROR.observe(final.predicted_ttft_s - final.ttft_s)
                metrics.TTFT_PREDICTION_RATIO.observe(final.predicted_ttft_s / final.ttft_s)
        if self.itl_s is not None:
            final.predicted_itl_s = self.itl_s
        if self.slo:
            met = (not self.slo.ttft_s or final.ttft_s <= self.slo.ttft_s) and (
                not self.slo.itl_s or final.itl_s <= self.slo.itl_s
            )
            metrics.SLO_REQUESTS.labels("met" if met else "missed").inc()


def measured_parts(final: gateway_pb2.Final) -> dict[str, float | int]:
    """What prefill measured of a request's TTFT (kvmesh.gateway.prediction_log's measured_*
    fields, seconds): its wait from its arrival there to its compute (a pull's included), the
    compute's wall time (turns waited on shared cores included), the push after it, and the
    prompt tokens it found cached (pulled ones included)."""
    return {
        "measured_queue_s": final.queue_s,
        "measured_compute_s": final.prefill_s,
        "measured_push_s": final.kv_transfer.exposed_seconds,
        "pull_s": final.pull_s,
        "measured_cached_tokens": final.cached_tokens,
    }
