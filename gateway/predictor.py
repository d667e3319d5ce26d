"""Predicting a request's TTFT at each prefill instance and its ITL at each decode instance, from
the latency profiles the instances publish with their stats (kvmesh.runtime.latency_fit) and the
load the gateway sees, calibrated online against what the gateway then measures.

TTFT at a prefill instance, from the moment the request is routed (seconds):

    queue    the wait before it computes: the virtual finish time of the prompts this gateway
             routed there (each one's compute added as it is routed, the whole moved by how much
             later or sooner each first token came than expected: a FIFO queue's), or the queue
             the instance reports, by its profile (prefill_fit a . [requests, tokens,
             tokens^2 / (2 requests)]: other gateways' work too); the longer of the two
    compute  this prompt's uncached tokens T after its C cached ones: a . [1, T, T (C + T / 2)]
    push     the pages decode does not hold: push_fit . [1, pages]

and their sum is `raw`. The prediction is the gateway's own fit of measured TTFT on
[queue, compute, push, the other prefill instances' queues, a step of each busy decode] for
that instance (its last 64 requests, once it has 8; least relative error, so a burst's long
waits do not set the short prompts' predictions): how much each part really costs there (a
queue that batches, cores shared with decode), the hops and the first token's trip, learned as
they happen (llm-d predicts from a model it trains online; this is the
smallest such model, and its error is published: kvmesh_gateway_ttft_prediction_error_seconds).

ITL at a decode instance: decode_fit . [1, rows + 1, context + prompt], its step time once this
request joins the batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.gateway.instance_load import InstanceLoad, queued_tokens
from kvmesh.runtime.latency_fit import LinearFit

CALIBRATION_WINDOW = 64
"""Requests per prefill instance the gateway's calibration fits over."""


@dataclass(frozen=True)
class TtftPrediction:
    """One request's predicted TTFT at one prefill instance (seconds from its routing)."""

    seconds: float
    """The calibrated prediction (raw until the instance has enough measured requests)."""
    raw_s: float
    queue_s: float
    compute_s: float
    push_s: float
    peers_s: float = 0.0
    """The queues of the other prefill instances (seconds, each by its own profile)."""
    decode_s: float = 0.0
    """A step of every decode instance that has requests (seconds, each by its own profile).
    Both are work that competes for the cores where instances share a host; the calibration
    learns what they cost here (nothing where each instance has its own GPU)."""


class LatencyPredictor:
    """TTFT and ITL predictions for a gateway's instances; `observe` feeds the calibration.

    page_size: tokens per KV page (the push's pages); prefills, decodes: the gateway's instances
    (lists it keeps up to date: kvmesh.gateway.instances.InstanceSet's)."""

    def __init__(
        self, page_size: int, prefills: Sequence[InstanceLoad] = (), decodes: Sequence[InstanceLoad] = ()
    ) -> None:
        self.page_size = page_size
        self.prefills, self.decodes = prefills, decodes
        self._calibration: dict[str, LinearFit] = {}
        self._busy_until: dict[str, float] = {}
        """Prefill address -> when the work this gateway routed there should be done
        (time.monotonic(), seconds): a virtual finish time, as a FIFO queue's."""
        self._shift: dict[str, float] = {}
        """Prefill address -> how far its busy time was moved by measured first tokens (seconds)."""

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
        if len(prefill.prefill_fit) != 3:
            return None
        queue_s = self._queue_s(prefill)
        peers_s = sum(
            self._queue_s(p) for p in self.prefills if p is not prefill and p.routable and len(p.prefill_fit) == 3
        )
        decode_s = sum(step_s(d) for d in self.decodes if d.routable and len(d.decode_fit) == 3)
        per_request, per_token, per_attention = prefill.prefill_fit
        computed = max(num_prompt_tokens - cached_tokens, 1)
        compute_s = per_request + per_token * computed + per_attention * computed * (cached_tokens + computed / 2)
        pages = max(math.ceil(num_prompt_tokens / self.page_size) - decode_cached_pages, 0)
        push_s = prefill.push_fit[0] + prefill.push_fit[1] * pages if len(prefill.push_fit) == 2 else 0.0
        raw = queue_s + compute_s + push_s
        fit = self._calibration.get(prefill.address)
        calibrated = fit.predict((queue_s, compute_s, push_s, peers_s, decode_s)) if fit is not None else None
        return TtftPrediction(
            calibrated if calibrated is not None else raw, raw, queue_s, compute_s, push_s, peers_s, decode_s
        )

    def itl(self, decode: InstanceLoad, num_prompt_tokens: int) -> float | None:
        """The decode's step time once this request joins its batch (seconds); None while it has
        published no profile."""
        if len(decode.decode_fit) != 3:
            return None
        return step_s(decode, 1, num_prompt_tokens)

    def _queue_s(self, prefill: InstanceLoad) -> float:
        """The wait before a prompt routed to `prefill` now starts computing (seconds): what this
        gateway routed there is done at its virtual finish time, and what the instance reports
        queued (other gateways' work too) by its profile; the longer of the two."""
        reported = queued_s(prefill, prefill.reported_queued_tokens, prefill.reported_active_requests)
        busy = self._busy_until.get(prefill.address)
        if busy is None:  # nothing routed there yet: the gateway's own count, by the profile
            return max(reported, queued_s(prefill, queued_tokens(prefill), prefill.in_flight_requests))
        return max(reported, busy - time.monotonic())

    def commit(self, prefill: InstanceLoad, predicted: TtftPrediction) -> tuple[float, float]:
        """A request was routed to `prefill` with this prediction: its compute joins the queue.
        Returns what `observe` takes back: (its predicted end of compute, the shift so far)."""
        now = time.monotonic()
        busy = max(self._busy_until.get(prefill.address, now), now) + predicted.compute_s
        self._busy_until[prefill.address] = busy
        return busy, self._shift.get(prefill.address, 0.0)

    def observe(
        self, prefill: InstanceLoad, predicted: TtftPrediction, measured_s: float, committed: tuple[float, float]
    ) -> None:
        """A routed request's prediction (its parts), the TTFT then measured from its routing
        (seconds) and what `commit` returned: the calibration learns from it, and the queue
        behind it moves by how much later (or sooner) its compute ended than expected."""
        expected, shift_then = committed
        shift = self._shift.get(prefill.address, 0.0)
        late = (time.monotonic() - predicted.push_s) - (expected + shift - shift_then)
        self._shift[prefill.address] = shift + late
        self._busy_until[prefill.address] = max(self._busy_until.get(prefill.address, 0.0) + late, time.monotonic())
        fit = self._calibration.setdefault(
            prefill.address, LinearFit(5, window=CALIBRATION_WINDOW, min_samples=8, relative=True)
        )
        parts = (predicted.queue_s, predicted.compute_s, predicted.push_s, predicted.peers_s, predicted.decode_s)
        fit.add(parts, measured_s)


def step_s(decode: InstanceLoad, more_rows: int = 0, more_context: int = 0) -> float:
    """A step of `decode` by its profile with `more_rows` requests of `more_context` tokens
    added to its batch (0 when it has no requests and none are added)."""
    rows = max(decode.in_flight_requests, decode.reported_active_requests) + more_rows
    if not rows:
        return 0.0
    return fitted_step_s(decode.decode_fit, rows, decode.context_tokens + more_context)


def fitted_step_s(decode_fit: Sequence[float], rows: float, context: float) -> float:
    """A decode step of `rows` requests holding `context` tokens by a decode profile
    (decode_fit: seconds on [1, rows, context tokens])."""
    base, per_row, per_context = decode_fit
    return base + per_row * rows + per_context * context


def queued_s(prefill: InstanceLoad, queued: int, requests: int) -> float:
    """The seconds `queued` prompt tokens in `requests` requests take on `prefill` by its
    profile, each request taken as the queue's mean length."""
    per_request, per_token, per_attention = prefill.prefill_fit
    waiting = max(requests, 1 if queued else 0)
    return per_request * waiting + per_token * queued + per_attention * queued * queued / (2 * max(waiting, 1))
