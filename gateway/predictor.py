"""Predicting a request's TTFT at each prefill instance and its ITL at each decode instance, from
the latency profiles the instances publish with their stats (kvmesh.runtime.latency_fit) and the
load the gateway sees, calibrated online against what the gateway then measures.

TTFT at a prefill instance, from the moment the request is routed (seconds):

    compute  this prompt's uncached tokens T after its C cached ones by the instance's profile
             (its forwards' own seconds): prefill_fit . [F, 1, T, T (C + T / 2)], F its forwards
             (T over the instance's max_forward_tokens; 0 when it shares the forward of a batch
             still waiting there: kvmesh.gateway.prefill_queues)
    queue    the wait for the work ahead of it and the cores' turns while it computes: when the
             fluid model of the routed work (kvmesh.gateway.prefill_queues: each instance's queue
             first come first served, and the queues of instances that share cores first come
             first served together, between their decode steps) would serve it out, less its
             compute; where the instance
             reports requests this gateway did not send (other gateways'), at least its reported
             queue by its profile
    push     the pages decode does not hold: push_fit . [1, pages]

and their sum is `raw`. The prediction is `raw` x exp(a + b . rows), a and b the gateway's own
least-squares fit of log(measured / raw) over the last 64 requests of the instance's core group
(or of the instance, on cores of its own; once it has 8; rows held within the range they span:
kvmesh.runtime.latency_fit.RatioFit), rows the requests the decode instances of its core group
stream: how far the profiles are off there, and how much the streaming slows the forwards of
cores they share, learned as it happens (llm-d predicts from a model it trains online; this is
the smallest such model, and its error is published: kvmesh_gateway_ttft_prediction_error_seconds).

ITL at a decode instance: decode_fit . [1, rows + 1, context + prompt], its step time once this
request joins the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.prediction_log import PredictionLog
from kvmesh.gateway.prefill_queues import (
    Job,
    PrefillQueues,
    fitted_compute_s,
    fitted_step_s,
    forwards_of,
    has_prefill_fit,
)
from kvmesh.runtime.latency_fit import RatioFit

CALIBRATION_WINDOW = 64
"""Requests per calibration (a core group's, or an instance's with cores of its own) it fits over."""


@dataclass(frozen=True)
class TtftPrediction:
    """One request's predicted TTFT at one prefill instance (seconds from its routing)."""

    seconds: float
    """The calibrated prediction (raw until the instance has enough measured requests)."""
    raw_s: float
    queue_s: float
    compute_s: float
    push_s: float
    share: float = 1.0
    """The share of its cores the instance's forwards get in their turns (1 on cores of its own;
    less where decode steps take turns with them: kvmesh.gateway.prefill_queues)."""
    rows: int = 0
    """The requests the decode instances of its core group stream (0 on cores of its own)."""
    tokens: int = 0
    """The prompt tokens it computes (its uncached ones)."""
    joins_batch: bool = False
    """It shares the forward of a batch waiting at the instance (kvmesh.gateway.prefill_queues)."""


class LatencyPredictor:
    """TTFT and ITL predictions for a gateway's instances; `commit` and `observe` keep the model
    of the routed work and feed the calibration.

    page_size: tokens per KV page (the push's pages); prefills, decodes: the gateway's instances
    (lists it keeps up to date: kvmesh.gateway.instances.InstanceSet's)."""

    def __init__(
        self, page_size: int, prefills: Sequence[InstanceLoad] = (), decodes: Sequence[InstanceLoad] = ()
    ) -> None:
        self.page_size = page_size
        self.prefills, self.decodes = prefills, decodes
        self.queues = PrefillQueues(prefills, decodes)
        self.log: PredictionLog | None = None
        """Where each observed prediction is written (--predictor-log); None: nowhere."""
        self._calibration: dict[str, RatioFit] = {}

    def ttft(
        self,
        prefill: InstanceLoad,
        num_prompt_tokens: int,
        cached_tokens: int,
        decode_cached_pages: int = 0,
    ) -> TtftPrediction | None:
        """The TTFT of a prompt of `num_prompt_tokens` tokens, `cached_tokens` of them held at
        `prefill` and `decode_cached_pages` pages of them at the decode (not pushed); None while
        the instance has published no profile."""
        if not has_prefill_fit(prefill):
            return None
        computed = max(num_prompt_tokens - cached_tokens, 1)
        joins = self.queues.joins_batch(prefill, computed)
        forwards = 0 if joins else forwards_of(prefill, computed)
        compute_s = fitted_compute_s(prefill.prefill_fit, computed, cached_tokens, forwards)
        finish_s, share = self.queues.finish_s(prefill, compute_s)
        queue_s = finish_s - compute_s
        if self._others_queued(prefill):
            queue_s = max(queue_s, queued_s(prefill, prefill.reported_queued_tokens, prefill.reported_active_requests))
        pages = max(math.ceil(num_prompt_tokens / self.page_size) - decode_cached_pages, 0)
        push_s = prefill.push_fit[0] + prefill.push_fit[1] * pages if len(prefill.push_fit) == 2 else 0.0
        raw = queue_s + compute_s + push_s
        rows = self.queues.streaming_rows(prefill)
        fit = self._calibration.get(_calibration_key(prefill))
        calibrated = fit.correct((1.0, rows), raw) if fit is not None else None
        return TtftPrediction(
            calibrated if calibrated is not None else raw, raw, queue_s, compute_s, push_s, share, rows, computed, joins
        )

    def _others_queued(self, prefill: InstanceLoad) -> bool:
        """Whether `prefill` reports requests this gateway did not route there (other gateways'),
        in a report polled after its last first token came (one polled before may count work
        now done; and the model knows this gateway's own work better than a count of tokens,
        which holds a prompt half computed as whole)."""
        return (
            prefill.reported_active_requests > prefill.in_flight_requests
            and prefill.polled_at > self.queues.done_at(prefill)
        )

    def itl(self, decode: InstanceLoad, num_prompt_tokens: int) -> float | None:
        """The decode's step time once this request joins its batch (seconds); None while it has
        published no profile."""
        if len(decode.decode_fit) != 3:
            return None
        return step_s(decode, 1, num_prompt_tokens)

    def commit(self, prefill: InstanceLoad, predicted: TtftPrediction) -> Job:
        """A request was routed to `prefill` with this prediction: its compute joins the model of
        the queue there. Returns its job, what `observe` takes back."""
        return self.queues.add(prefill, predicted.compute_s, predicted.tokens, predicted.joins_batch)

    def observe(self, prefill: InstanceLoad, predicted: TtftPrediction, measured_s: float, job: Job) -> None:
        """A routed request's prediction (its parts), the TTFT then measured from its routing
        (seconds) and what `commit` returned: its job leaves the model of the queue, and the
        calibration learns from it."""
        self.queues.done(prefill, job, predicted.push_s)
        fit = self._calibration.setdefault(
            _calibration_key(prefill), RatioFit(2, window=CALIBRATION_WINDOW, min_samples=8)
        )
        fit.add((1.0, predicted.rows), predicted.raw_s, measured_s)


def _calibration_key(prefill: InstanceLoad) -> str:
    """Instances on one group's cores share a calibration (what slows one slows all of them);
    one with cores of its own has its own."""
    return f"group:{prefill.core_group}" if prefill.core_group else prefill.address


def step_s(decode: InstanceLoad, more_rows: int = 0, more_context: int = 0) -> float:
    """A step of `decode` by its profile with `more_rows` requests of `more_context` tokens
    added to its batch (0 when it has no requests and none are added)."""
    rows = max(decode.in_flight_requests, decode.reported_active_requests) + more_rows
    if not rows:
        return 0.0
    return fitted_step_s(decode.decode_fit, rows, decode.context_tokens + more_context)


def queued_s(prefill: InstanceLoad, queued: int, requests: int) -> float:
    """The seconds `queued` prompt tokens in `requests` requests take on `prefill` by its
    profile, each request taken as the queue's mean length, in forwards of max_forward_tokens
    (one a request when unbounded)."""
    waiting = max(requests, 1 if queued else 0)
    forwards = forwards_of(prefill, queued) if prefill.max_forward_tokens > 0 and queued else waiting
    return fitted_compute_s(prefill.prefill_fit, queued, 0, forwards, waiting)
