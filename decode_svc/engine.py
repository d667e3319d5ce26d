"""The decode engine: one table of requests by transfer id, and the continuous-batching loop.

The table (decode_svc/table.py) holds each request from Reserve until its pages are freed,
reserved and begun as decode_svc/admission.py says; decode_svc/transfers.py adds its landing
and expiry on the event loop. One thread runs
the loop: each step it admits at most `max_admit_per_step` requests whose KV has landed, runs
ONE forward over every running request (one new token each, or k + 1 rows with k speculative
drafts: kvmesh.engine.speculative), samples, hands the step's tokens to `dispatch` in one call, and
frees the pages of finished requests. Requests join and leave between steps (Orca-style
iteration-level scheduling, as in vLLM's v1 scheduler). Everything the gRPC side calls is
guarded by one lock; the forward itself runs outside it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

import torch

from kvmesh.decode_svc import metrics
from kvmesh.decode_svc.admission import Admission
from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.delivery import (
    CapacityError,
    Delivery,
    DispatchFn,
    InstanceBroken,
    RequestReleased,
    StepFailed,
    deliver_all,
)
from kvmesh.decode_svc.step_rows import kept_logprobs, mask_grammars
from kvmesh.engine.ep.eplb import expert_stats, runner_ep_stats
from kvmesh.engine.ep.ranks import EPWorldError
from kvmesh.engine.forward import Runner
from kvmesh.engine.outcomes import FinishReason
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import TokenLogprobs
from kvmesh.engine.speculative.verify import StepRows
from kvmesh.kvstore.kv_events import KVEvent
from kvmesh.kvstore.kv_tier import KVTier
from kvmesh.runtime.cpu_share import open_cpu_share
from kvmesh.runtime.latency_fit import LinearFit

# the errors a caller of the engine sees (decode_svc/delivery.py's), importable from here too
__all__ = ["CapacityError", "DecodeEngine", "RequestReleased"]

logger = logging.getLogger(__name__)


class DecodeEngine(Admission):
    """Owns the decode KV cache, the request table and the batch loop over a Runner: one
    object, its parts by concept (the table and `release`: RequestTable; `reserve`, `begin`
    and admission: Admission; the loop and its steps here).

    dispatch: runs each step's deliveries (deliver_all: on the engine thread; the service
    passes deliver_on(its loop)). on_events: hears the KV events of decode's prefix cache
    (config.enable_prefix_caching: finished requests' full blocks stay cached, and a Reserve
    may reuse them), under the engine's lock; it must not block. tier: the second tier decode's
    evicted blocks go to (kvmesh.kvstore.kv_tier; None: none). Raises ValueError as kvmesh.engine.speculative.create_speculator
    does (too few state slots for config.num_state_slots, mtp without an MTP module).
    """

    def __init__(
        self,
        config: DecodeConfig,
        runner: Runner,
        dispatch: DispatchFn = deliver_all,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        tier: KVTier | None = None,
    ) -> None:
        self._cpu_share = open_cpu_share(config.cpu_share, config.cpu_share_max_wait_s)
        super().__init__(config, runner, dispatch, on_events, tier)
        self._stopping = False
        self.max_batch_size_seen = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        """Wall seconds spent in steps (the batch's forward and sampling) since start."""
        self.step_fit = LinearFit(3)
        """A step's wall seconds (its turn waited included) on [1, batch rows, context tokens]:
        the ITL predictor's input."""
        self.step_compute_fit = LinearFit(3)
        """The same, the turn waited left out: what a step costs cores it shares with prefill
        forwards (the TTFT predictor's input there)."""
        self.num_generated_tokens = 0
        """Tokens the steps sampled since start (num_generated_tokens / num_steps: the mean batch)."""
        self.cpu_share_wait_seconds = 0.0
        """Seconds steps waited for a prefill forward on the same cores (--cpu-share), since start."""
        self._loop_done: concurrent.futures.Future | None = None
        self.broken = ""
        """Why this instance cannot step any more ('' while it can): its expert-parallel world
        lost a rank (kvmesh.engine.ep.ranks.EPWorldError). Reservations are refused from then on."""
        self.on_broken: list[Callable[[str], None]] = []
        """Called once, on the engine thread, with the reason when the instance breaks."""

    def start(self, executor: concurrent.futures.Executor | None = None) -> None:
        """Run the batch loop on `executor` (the service passes the main-thread executor,
        where torch is fastest) or, without one, on a thread of its own."""
        if executor is None:
            own = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-loop")
            self._loop_done = own.submit(self.run_loop)
            own.shutdown(wait=False)  # its thread ends when the loop returns
        else:
            self._loop_done = executor.submit(self.run_loop)

    def shutdown(self) -> None:
        """Stop the loop after its current step and wait for it (30 s at most)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._loop_done is not None:
            self._loop_done.result(timeout=30)

    # --- called from the gRPC side -------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    def stats(self) -> dict[str, int | float | str | list[int] | list[float]]:
        """Cache and batch figures for GetStats; integrity_error is '' when check_integrity() passes."""
        with self._cond:
            return {
                **self.kv_cache.stats(),
                "num_active_requests": len(self._requests),
                "max_batch_size": self.max_batch_size_seen,
                "num_steps": self.num_steps,
                "step_seconds": self.step_seconds,
                "decode_fit": self.step_fit.coefficients() or [],
                "decode_compute_fit": self.step_compute_fit.coefficients() or [],
                "core_group": self._cpu_share.group,
                "num_context_tokens": sum(r.num_tokens for r in self._running),
                "num_generated_tokens": self.num_generated_tokens,
                "cpu_share_wait_seconds": self.cpu_share_wait_seconds,
                **expert_stats(self.runner.expert_token_counts()),
                **runner_ep_stats(self.runner),
            }

    def calibrate(self) -> float:
        """Measure what a speculative verification row costs here (Speculator.calibrate); runs
        where steps run, before the loop starts."""
        return self.speculator.calibrate(self.config.page_size)

    # --- the engine thread -----------------------------------------------------------

    def run_loop(self) -> None:
        """The batch loop; returns after shutdown()."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._waiting or self._running)
                if self._stopping:
                    return
                batch = self._schedule()
            if not batch:
                continue
            try:
                # on cores shared with a prefill instance, a step and a prefill forward take turns
                started = time.perf_counter()
                with self._cpu_share.decode_step() as waited:
                    metrics.CPU_SHARE_WAIT.inc(waited)
                    self.cpu_share_wait_seconds += waited
                    self._step(batch)
                with self._cond:  # the step as its requests live it: the turn waited included
                    context = sum(r.num_tokens for r in batch)
                    seconds = time.perf_counter() - started
                    self.step_fit.add((1, len(batch), context), seconds)
                    self.step_compute_fit.add((1, len(batch), context), seconds - waited)
            except Exception as exc:  # a failed step ends these streams, never the service
                self._fail(batch, exc)

    def _schedule(self) -> list[Request]:
        """Under the lock: drop aborted requests, admit new ones, return this step's batch."""
        self._drop_aborted()
        self._admit()
        return list(self._running)

    def _step(self, batch: list[Request]) -> None:
        """One forward over the batch (rows: kvmesh.engine.speculative), its tokens sampled,
        appended and handed to `dispatch` in one call; finished requests leave the batch."""
        started = time.perf_counter()
        cpu_started = time.process_time()
        rows = self.speculator.rows(batch)  # one row a request, k + 1 with k drafts
        logits = self.runner.forward(rows.items)  # [rows, V]
        mask_grammars(batch, rows.starts, rows.drafts, logits)
        hidden = self.speculator.hidden()  # [rows, N, H], for a drafter that reads them
        kept = self.speculator.sample(batch, rows, logits)
        logprobs = kept_logprobs(batch, rows.starts, logits, kept)
        step_s = time.perf_counter() - started
        metrics.STEP_CPU.observe(time.process_time() - cpu_started)
        metrics.STEPS.inc()
        deliveries: list[Delivery] = []
        with self._cond:
            self.num_steps += 1
            self.step_seconds += step_s
            self.max_batch_size_seen = max(self.max_batch_size_seen, len(batch))
            for i, (r, tokens) in enumerate(zip(batch, kept)):
                if r.status is RequestStatus.ABORTED:
                    continue  # freed by the next _schedule
                deliveries.append(self._advance(r, i, rows, tokens, logprobs[i], hidden))
        generated = sum(len(tokens) for _, tokens, _, _ in deliveries)
        self.num_generated_tokens += generated
        metrics.TOKENS.inc(generated)
        self.dispatch(deliveries)

    def _advance(
        self,
        r: Request,
        i: int,
        rows: StepRows,
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
        hidden: torch.Tensor | None,
    ) -> Delivery:
        """Under the lock: request i of the step takes its sampled tokens (up to the first that
        ends the answer, or its grammar's end); its delivery. A finished request's pages go back."""
        ended_by_grammar = False
        if r.grammar is not None:
            tokens, ended_by_grammar = r.grammar.advance(tokens)
        tokens = r.append_tokens(tokens)
        if ended_by_grammar and r.finish is None:
            r.finish = FinishReason.STOP  # the grammar is complete (or refused a token): the answer ends
        if logprobs is not None:
            logprobs = logprobs[: len(tokens)]
        accepted = self.speculator.keep(r, i, rows, tokens, hidden if r.finish is None else None)
        if rows.drafts[i]:
            metrics.ACCEPTED.observe(accepted)
        assert r.emit is not None, r.request_id
        delivery = (r.emit, tokens, r.finish, logprobs)
        if r.finish is not None:
            self._running.remove(r)
            self._free(r)
        return delivery

    def _fail(self, batch: list[Request], exc: Exception) -> None:
        """A step raised: its requests end with StepFailed (InstanceBroken when the
        expert-parallel world lost a rank: this instance breaks, once) and their pages go back."""
        logger.exception("decode step failed for %d requests", len(batch))
        ending: Exception = StepFailed(f"decode step failed: {exc!r}")
        if isinstance(exc, EPWorldError):  # no later step can run: say so, and stop taking work
            ending = InstanceBroken(f"decode cannot step any more: {exc}")
            if not self.broken:
                self.broken = str(exc)
                for callback in self.on_broken:
                    callback(self.broken)
        with self._cond:
            for r in batch:
                if r.status is RequestStatus.RUNNING:
                    self._running.remove(r)
                    r.status = RequestStatus.ABORTED
                    self._free(r)
                    if r.emit is not None:
                        self.dispatch([(r.emit, [], ending, None)])
