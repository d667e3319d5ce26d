"""The prefill work a gateway has routed and not yet seen answered, as a fluid model of each
prefill instance's queue on the cores it runs on: where the TTFT predictor
(kvmesh.gateway.predictor) reads a new request's wait from.

Each instance computes its queue first come first served (kvmesh.prefill_svc.pending). A job is
one routed request's compute seconds by its instance's profile (prefill_fit: its forwards' own
seconds, the turns waited on shared cores left out: `fitted_compute_s`). When its worker frees,
an instance takes every queued request up to its batch's tokens into one batch, whose requests
share each forward: a job that joins the queue behind one still waiting, and fits with the
waiting jobs of that batch into max_forward_tokens tokens, shares their forward (`joins_batch`)
and costs no forward of its own. Time serves the head job of each instance that has work at a
rate (seconds of its compute per second):

    1                on cores of its own (a GPU each: core_group '');
    F / (F + S)      on cores a group of instances shares (InstanceStats.core_group: the
                     launcher's --cpu-share on one host), to the head job routed first among
                     the group's instances, and 0 to the others: their forwards take turns one
                     at a time, first come first served by the oldest request of each forward's
                     batch (kvmesh.runtime.cpu_share), so the group's prompts are computed in
                     the order they were routed, as one engine's queue; F is one forward's
                     seconds (max_forward_tokens tokens by prefill_fit) and S a step of each of
                     the group's decode instances that has requests (each steps once between
                     two forwards, by decode_compute_fit).

So a request's wait is the work routed to its cores before it, at the share the decode steps
leave (a queue that serves in order: what is routed later never delays it). A request's first
token, seen at the gateway, ends its job and every job ahead of it at that instance (computed
before it, or with it in one batch), so the model is set right by what happens; a job served
out in the model before its first token came gives the next one back the service it took
meanwhile. A job whose request fails is never seen: it is served out like the others.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.gateway.instance_load import InstanceLoad

EPSILON_S = 1e-9
"""Compute seconds below which a job is served out."""


PREFILL_FIT_FEATURES = 4
"""prefill_fit's length: seconds on [forwards, requests, tokens computed, attention]."""


def has_prefill_fit(prefill: InstanceLoad) -> bool:
    """Whether `prefill` has published its profile (prefill_fit)."""
    return len(prefill.prefill_fit) == PREFILL_FIT_FEATURES


def fitted_compute_s(
    prefill_fit: Sequence[float], tokens: float, cached: float, forwards: float, requests: int = 1
) -> float:
    """Seconds of compute by a prefill profile (prefill_fit: seconds on [forwards, requests,
    tokens computed, tokens x (cached + tokens / 2)]) of `requests` requests computing `tokens`
    tokens after `cached` ones in `forwards` forwards."""
    per_forward, per_request, per_token, per_attention = prefill_fit
    attention = per_attention * tokens * (cached + tokens / (2 * max(requests, 1)))
    return per_forward * forwards + per_request * requests + per_token * tokens + attention


def forwards_of(prefill: InstanceLoad, tokens: int) -> int:
    """The forwards `prefill` computes `tokens` prompt tokens in, alone (max_forward_tokens each;
    1 when unbounded)."""
    bound = prefill.max_forward_tokens
    return max(math.ceil(tokens / bound), 1) if bound > 0 else 1


@dataclass(eq=False)
class Job:
    """One routed request's prefill compute in the model (seconds), and the tokens of the batch it
    closes (its own, or with those of the waiting jobs it joined: `joins_batch`)."""

    compute_s: float
    batch_tokens: int = 0
    joined: bool = False
    order: tuple[float, int] = (0.0, 0)
    """When it was routed (PrefillQueues' clock) and how many jobs were added before it: its
    place among its core group's jobs."""
    """It shares the forward of the job ahead of it (the instance computes them in one batch)."""
    remaining_s: float = field(init=False)
    served_at: float | None = None
    """When the model served it out (PrefillQueues' clock); None while it has work left."""

    def __post_init__(self) -> None:
        self.remaining_s = self.compute_s


class PrefillQueues:
    """The fluid model of the work routed to `prefills` (a gateway's live lists, kept up to date:
    kvmesh.gateway.instances.InstanceSet's), whose cores `decodes` may share; `clock`: seconds
    (time.monotonic, or a test's)."""

    def __init__(
        self,
        prefills: Sequence[InstanceLoad] = (),
        decodes: Sequence[InstanceLoad] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefills, self.decodes = prefills, decodes
        self._clock = clock
        self._jobs: dict[str, deque[Job]] = {}
        self._done_at: dict[str, float] = {}
        self._at = clock()
        self._added = itertools.count()

    def add(self, prefill: InstanceLoad, compute_s: float, tokens: int = 0, joined: bool = False) -> Job:
        """A request of `tokens` tokens to compute was routed to `prefill` with `compute_s` seconds
        to compute, in the batch of the job ahead of it when `joined` (what `joins_batch` said):
        it joins the end of its queue. Returns its job, for `done`."""
        now = self._clock()
        self._advance(now)
        jobs = self._jobs.setdefault(prefill.address, deque())
        batch_tokens = tokens + (jobs[-1].batch_tokens if joined and jobs else 0)
        job = Job(max(compute_s, 0.0), batch_tokens, joined and bool(jobs), (now, next(self._added)))
        jobs.append(job)
        return job

    def joins_batch(self, prefill: InstanceLoad, tokens: int) -> bool:
        """Whether a new job of `tokens` tokens at `prefill` would be computed in one batch with
        the job at the end of its queue: that job still waits (its batch is not the one computing
        now, which holds the head job and those that joined it) and the two fit in one forward
        (max_forward_tokens; never where that is unbounded, whose batch bound the gateway does
        not know)."""
        self._advance(self._clock())
        bound = prefill.max_forward_tokens
        jobs = [j for j in self._jobs.get(prefill.address, ()) if j.served_at is None]
        if bound <= 0 or len(jobs) < 2 or jobs[-1].batch_tokens + tokens > bound:
            return False
        computing = 1  # the head and the jobs that joined its batch
        while computing < len(jobs) and jobs[computing].joined:
            computing += 1
        return computing < len(jobs)

    def done(self, prefill: InstanceLoad, job: Job, push_s: float = 0.0) -> None:
        """`job`'s first token came now (`push_s` after its compute ended, as predicted): it and
        the jobs ahead of it leave the queue. If the model served it out earlier, the job now at
        the head gets back the service it took since (up to its own compute)."""
        now = self._clock()
        self._advance(now)
        self._done_at[prefill.address] = now
        jobs = self._jobs.get(prefill.address)
        if jobs is None:
            return
        if any(j is job for j in jobs):
            while jobs and jobs.popleft() is not job:
                pass
        elif job.served_at is not None and jobs and (late_s := now - push_s - job.served_at) > 0:
            head = jobs[0]
            head.remaining_s = min(head.compute_s, head.remaining_s + late_s * self._turn_share(prefill.address))

    def done_at(self, prefill: InstanceLoad) -> float:
        """When the last first token from `prefill` came (the clock's seconds; -inf before one):
        a stats report polled before it may count work that is done."""
        return self._done_at.get(prefill.address, float("-inf"))

    def depth(self, prefill: InstanceLoad) -> tuple[int, int]:
        """(jobs with work left at `prefill`, instances of its core group with work left) now,
        before a new one joins."""
        self._advance(self._clock())
        group = prefill.core_group
        peers = {p.address for p in self.prefills if group and p.core_group == group} | {prefill.address}
        return (
            sum(j.served_at is None for j in self._jobs.get(prefill.address, ())),
            sum(_head(self._jobs.get(a, deque())) is not None for a in peers),
        )

    def streaming_rows(self, prefill: InstanceLoad) -> int:
        """The requests the decode instances that share `prefill`'s cores stream (0 when it has
        cores of its own)."""
        if not prefill.core_group:
            return 0
        return sum(
            max(d.in_flight_requests, d.reported_active_requests)
            for d in self.decodes
            if d.core_group == prefill.core_group and d.routable
        )

    def finish_s(self, prefill: InstanceLoad, compute_s: float) -> tuple[float, float]:
        """(seconds from now until a new job of `compute_s` seconds at `prefill` would be served
        out, the rate `prefill`'s work is served at while it is its turn)."""
        now = self._clock()
        self._advance(now)
        queues = {  # a copy to serve
            a: deque(Job(j.remaining_s, order=j.order) for j in jobs) for a, jobs in self._jobs.items()
        }
        new = Job(max(compute_s, EPSILON_S), order=(now, next(self._added)))
        queues.setdefault(prefill.address, deque()).append(new)
        return self._serve(queues, 0.0, math.inf, until=new), self._turn_share(prefill.address)

    def _advance(self, now: float) -> None:
        """Serve the queues from the last time they were served until `now`."""
        self._serve(self._jobs, self._at, now - self._at)
        self._at = now
        for jobs in self._jobs.values():  # served out: nothing left to weigh
            while jobs and jobs[0].served_at is not None:
                jobs.popleft()

    def _serve(self, queues: dict[str, deque[Job]], start: float, seconds: float, until: Job | None = None) -> float:
        """Serve the head job of each of `queues` at its rate, from the clock's `start`, for
        `seconds` or until `until` is served out (each job served out is stamped with when);
        returns the seconds served (less when every queue ran dry first)."""
        elapsed = 0.0
        while elapsed < seconds and (until is None or until.served_at is None):
            heads = {a: h for a, jobs in queues.items() if (h := _head(jobs)) is not None}
            if not heads:
                break
            rates = {a: rate for a, rate in self._rates(heads).items() if rate > 0}
            step = min(seconds - elapsed, min(heads[a].remaining_s / rate for a, rate in rates.items()))
            elapsed += step
            for a, rate in rates.items():
                head = heads[a]
                head.remaining_s -= rate * step
                if head.remaining_s <= EPSILON_S:
                    head.remaining_s, head.served_at = 0.0, start + elapsed
        return elapsed

    def _rates(self, heads: dict[str, Job]) -> dict[str, float]:
        """Seconds of compute per second each instance's head job (`heads`: address -> job) gets:
        its turn's share for the one routed first in its core group (1 on cores of its own, or
        gone from the pool), 0 for the others there."""
        group_of = {p.address: p.core_group for p in self.prefills}
        first: dict[str, str] = {}  # core group -> the address whose head was routed first
        rates = {}
        for address, job in heads.items():
            group = group_of.get(address, "")
            if not group:
                rates[address] = 1.0
            elif group not in first or job.order < heads[first[group]].order:
                first[group] = address
        for group, address in first.items():
            rates.update({a: 0.0 for a in heads if group_of.get(a) == group})
            rates[address] = self._turn_share(address)
        return rates

    def _turn_share(self, address: str) -> float:
        """The share of its cores the instance at `address` computes at in its turns: F / (F + S)
        in a core group, 1 on cores of its own (or gone from the pool)."""
        inst = next((p for p in self.prefills if p.address == address), None)
        return turn_share(inst, self.decodes) if inst is not None else 1.0


def cores_shares(busy: Sequence[InstanceLoad], decodes: Sequence[InstanceLoad]) -> dict[str, float]:
    """The share of its cores each of the `busy` prefill instances' forwards get on average while
    all of them have work (address -> 0-1): 1 on cores of its own; in a core group of k of them,
    1/k of F / (F + S) (the module's turns, over the time the group's queues take to drain)."""
    groups: dict[str, list[InstanceLoad]] = {}
    for inst in busy:
        groups.setdefault(inst.core_group or f"own:{inst.address}", []).append(inst)
    return {inst.address: turn_share(inst, decodes) / len(members) for members in groups.values() for inst in members}


def turn_share(prefill: InstanceLoad, decodes: Sequence[InstanceLoad]) -> float:
    """The share of its cores `prefill`'s forwards get in its turns: F / (F + S) in a core group
    (the module's rule), 1 on cores of its own or without a profile."""
    if not prefill.core_group:
        return 1.0
    forward_s = _forward_s(prefill)
    return forward_s / (forward_s + _decode_steps_s(decodes, prefill.core_group)) if forward_s > 0 else 1.0


def _decode_steps_s(decodes: Sequence[InstanceLoad], group: str) -> float:
    """A step of each decode instance of core `group` that has requests (seconds, by its
    decode_compute_fit): what runs between two prefill forwards there."""
    total = 0.0
    for d in decodes:
        rows = max(d.in_flight_requests, d.reported_active_requests)
        if d.core_group == group and d.routable and rows and len(d.decode_compute_fit) == 3:
            total += fitted_step_s(d.decode_compute_fit, rows, d.context_tokens)
    return total


def fitted_step_s(decode_fit: Sequence[float], rows: float, context: float) -> float:
    """A decode step of `rows` requests holding `context` tokens by a decode profile
    (decode_fit or decode_compute_fit: seconds on [1, rows, context tokens])."""
    base, per_row, per_context = decode_fit
    return base + per_row * rows + per_context * context


def _head(jobs: deque[Job]) -> Job | None:
    """The first job with work left."""
    return next((j for j in jobs if j.served_at is None), None)


def _forward_s(prefill: InstanceLoad) -> float:
    """One forward of `prefill`: max_forward_tokens new tokens by its profile (seconds); 0 when
    unknown (no bound, or no profile)."""
    if not prefill.max_forward_tokens or not has_prefill_fit(prefill):
        return 0.0
    return fitted_compute_s(prefill.prefill_fit, prefill.max_forward_tokens, 0, 1)
