"""One Prefill RPC on a prefill instance, as one object whose methods are its steps.

    await PrefillCall(parts, request, context, span).run()
        check()         the request id, page size, prompt, sampling, grammar (kvmesh.prefill_svc.checks)
        open_push()     decode's KV receiver: connect ahead, and a KVPush that chunks feed in parts
        _to_internal()  the request as the engine takes it
        pull()          a prefix a peer holds (pull_from), when pulling is cheaper than computing
        compute()       the engine's worker: queue, forward, first token; a failed push part ends it
        push()          what is left of the KV (all of it without chunks), then the pages released
        _to_pb()        the first token and the figures: the PrefillResponse

Each step ends the RPC with the status its failure maps to (kvmesh.runtime.wire.abort). A caller
that leaves (the RPC cancelled) releases the request's pages once no compute and no push part
reads them: the engine's worker and the push go on without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from opentelemetry.trace import Status, StatusCode

from kvmesh.engine.grammar import GrammarState
from kvmesh.engine.outcomes import FailureCause
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kvstore.block_pool import NoFreeBlocksError
from kvmesh.kvstore.transport import TransferError
from kvmesh.prefill_svc import metrics
from kvmesh.prefill_svc.checks import check_prompt, check_sampling
from kvmesh.prefill_svc.kv_pull import Pulled, PullStuck
from kvmesh.prefill_svc.kv_push import KVPush, PushReport
from kvmesh.prefill_svc.parts import PrefillParts
from kvmesh.prefill_svc.result import Cancelled, PrefillResult
from kvmesh.protos.v1 import gateway_pb2, prefill_pb2
from kvmesh.runtime import tracing
from kvmesh.runtime.wire import abort, check_request_id, logprobs_to_pb, page_size_mismatch

logger = logging.getLogger(__name__)


class PrefillCall:
    """One Prefill RPC: `run` takes it through its steps (the module docstring) and returns the
    PrefillResponse, or ends the RPC with the status of what failed."""

    def __init__(self, parts: PrefillParts, request: prefill_pb2.PrefillRequest, context, span) -> None:
        """request: the PrefillRequest; context: its grpc.aio context; span: the RPC's server span
        (kvmesh.runtime.tracing.server_span), parent of the steps' spans."""
        self.parts, self.engine = parts, parts.engine
        self.request, self.context, self.span = request, context, span
        self.rid = request.request_id
        self.kv_push: KVPush | None = None  # None: prefill only, nothing pushed
        self._traceparent = ""  # of the KV push span: decode's spans continue from it

    async def run(self) -> prefill_pb2.PrefillResponse:
        """The steps, in the order they run."""
        sampling, grammar = await self.check()
        self.kv_push = self.open_push()
        job = self._to_internal(sampling, grammar)
        pulled = await self.pull(job)
        result = await self.compute(job)
        report = await self.push(job, result)
        return self._to_pb(result, report, pulled)

    async def check(self) -> tuple[SamplingParams, GrammarState | None]:
        """Refuse what this instance cannot serve: a bad request id or prompt, sampling or grammar
        (BAD_REQUEST), another page size (MISMATCH). Returns the request's sampling and its
        grammar's matcher (None without one)."""
        request, model = self.request, self.parts.model
        try:
            check_request_id(self.rid)
        except ValueError as exc:
            await abort(self.context, FailureCause.BAD_REQUEST, str(exc))
        mismatch = page_size_mismatch(f"prefill {model.instance_id}", self.engine.page_size, request.page_size)
        if mismatch:
            await abort(self.context, FailureCause.MISMATCH, f"[{self.rid}] {mismatch}")
        try:
            check_prompt(request, model, self.engine.page_size)
            checked = await check_sampling(request.sampling, model, self.engine.runner)
        except ValueError as exc:
            await abort(self.context, FailureCause.BAD_REQUEST, f"[{self.rid}] {exc}")
        return checked

    def _to_internal(self, sampling: SamplingParams, grammar: GrammarState | None) -> Request:
        """The request as the engine takes it; its pages go to the push as chunks complete them."""
        return Request(
            self.rid,
            self.request.token_ids,
            sampling,
            transfer_id=self.request.transfer_id,
            block_hashes=list(self.request.block_hashes) or None,
            on_pages_ready=self.kv_push.pages_ready if self.kv_push else None,
            grammar=grammar,
        )

    def open_push(self) -> KVPush | None:
        """The push to decode's KV receiver (None for a prefill-only request), connecting ahead
        while the prompt computes."""
        address = self.request.decode_kv_address
        if not address:
            return None
        self.parts.connect_ahead(address)
        return KVPush(
            self.parts.sender,
            address,
            self.request.transfer_id,
            self.engine.kv_cache,
            self.parts.config.push_timeout_s,
            self.request.decode_cached_pages,
        )

    async def pull(self, job: Request) -> Pulled:
        """Pull the prompt's leading blocks a peer holds (pull_from) into the job's pages, when the
        puller estimates it cheaper than computing them. A prompt whose logprobs are asked for is
        computed whole: nothing to pull. KV_PUSH_FAILED when a cancelled receive keeps the pages."""
        request, puller = self.request, self.parts.puller
        if not (request.pull_from and request.pull_blocks > 0 and puller is not None):
            return Pulled(0, 0.0)
        if job.sampling.prompt_logprobs is not None:
            return Pulled(0, 0.0)
        started_ns = tracing.now_ns()
        try:
            pulled = await puller.pull(job, request.pull_from, request.pull_blocks)
        except PullStuck as exc:
            logger.warning("%s; the request fails (KV_PUSH_FAILED)", exc)
            await abort(self.context, FailureCause.KV_PUSH_FAILED, str(exc))
        except asyncio.CancelledError:
            if job.block_ids:  # allocated for the pull: given back (a stuck receive gives them itself)
                self.engine.release(job.block_ids, job.state_slot)
            raise
        attributes = {
            "kvmesh.pull.peer": request.pull_from,
            "kvmesh.pull.tokens": pulled.tokens,
            "kvmesh.pull.why_not": pulled.why_not,
        }
        tracing.record(self.span, "prefill.pull", started_ns, tracing.now_ns(), attributes)
        metrics.PULLED_TOKENS.inc(pulled.tokens)
        return pulled

    async def compute(self, job: Request) -> PrefillResult:
        """Queue the job on the engine's worker and wait for its first token. A push part that
        fails meanwhile ends the request at once: the chunks being computed finish on the worker
        (a running batch is not cut short), their pages are released after, nothing more is pushed."""
        submitted_ns = tracing.now_ns()
        computing = self.engine.submit(job)
        kv_push = self.kv_push
        if kv_push is not None:  # a failed or abandoned request pushes no further part

            def stop_pushing(f: concurrent.futures.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    kv_push.stop()

            computing.add_done_callback(stop_pushing)
        outcome = asyncio.wrap_future(computing)
        push_error: BaseException | None = None
        try:
            push_error = await self._push_failure_first(outcome)
            if push_error is None:
                # shield: a cancelled caller must not cancel the executor future (the job
                # flag stops it instead, and a finished compute still releases its pages)
                result: PrefillResult = await asyncio.shield(outcome)
        except asyncio.CancelledError:
            self._abandon(job, computing, outcome)
            logger.info("[%s] cancelled by the caller", self.rid)
            raise
        except Exception as exc:
            await self._compute_failed(exc)
        if push_error is not None:
            self._abandon(job, computing, outcome)
            await self._push_failed(push_error)
        self._record_compute(result, submitted_ns)
        return result

    async def _push_failure_first(self, outcome: asyncio.Future) -> BaseException | None:
        """With a push in parts: the error of a part that failed before the compute ended (None:
        the compute ended first, or nothing is pushed in parts)."""
        if self.kv_push is None:
            return None
        await asyncio.wait({outcome, self.kv_push.failed}, return_when=asyncio.FIRST_COMPLETED)
        return None if outcome.done() else self.kv_push.failed.result()

    async def _compute_failed(self, exc: Exception) -> None:
        """End the RPC with the status of what the compute raised."""
        if isinstance(exc, Cancelled):
            await abort(self.context, FailureCause.CANCELLED, f"[{self.rid}] cancelled")
        elif isinstance(exc, NoFreeBlocksError):
            await abort(self.context, FailureCause.OVERLOADED, f"[{self.rid}] {exc}", retry_after_s=1.0)
        elif isinstance(exc, ValueError):
            await abort(self.context, FailureCause.BAD_REQUEST, f"[{self.rid}] {exc}")
        else:  # a failed forward: this request fails, the service goes on
            logger.error("[%s] prefill failed", self.rid, exc_info=exc)
            await abort(self.context, FailureCause.INTERNAL, f"[{self.rid}] prefill failed: {exc!r}")

    async def _push_failed(self, error: BaseException) -> None:
        """End the RPC: the KV push to decode failed (KV_PUSH_FAILED)."""
        address = self.request.decode_kv_address
        metrics.KV_PUSH_FAILURES.inc()
        await abort(
            self.context, FailureCause.KV_PUSH_FAILED, f"[{self.rid}] KV push to decode {address} failed: {error}"
        )

    def _abandon(self, job: Request, computing: concurrent.futures.Future, outcome: asyncio.Future) -> None:
        """The request goes no further: stop its compute if it has not started, push no further
        part, and release its pages once the compute (`computing`, the engine's future; `outcome`
        wraps it) is done and no part reads them."""
        self.engine.cancel(job)
        if self.kv_push is not None:
            self.kv_push.stop()
        self.parts.release_when_computed(computing, self.kv_push)
        outcome.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no log noise

    def _record_compute(self, result: PrefillResult, submitted_ns: int) -> None:
        """The queue and forward spans (timed on the worker) and the prefill metrics."""
        queued_ns = submitted_ns + int(result.queue_s * 1e9)
        tracing.record(self.span, "prefill.queue", submitted_ns, queued_ns)
        attributes = {
            "kvmesh.prompt_tokens": len(self.request.token_ids),
            "kvmesh.cached_tokens": result.num_cached_tokens,
            "kvmesh.computed_tokens": result.num_computed_tokens,
        }
        tracing.record(self.span, "prefill.forward", queued_ns, queued_ns + int(result.compute_s * 1e9), attributes)
        metrics.observe_prefill(result)

    async def push(self, job: Request, result: PrefillResult) -> PushReport:
        """Push the pages not pushed yet and the state, then release the pages. A push that
        outlives its caller finishes (or fails) on its own and releases them; KV_PUSH_FAILED
        when it fails or times out."""
        span = tracing.child(
            self.span,
            "prefill.kv_push",
            attributes={
                "kvmesh.kv.pages": len(result.block_ids) - self.request.decode_cached_pages,
                "kvmesh.kv.decode_cached_pages": self.request.decode_cached_pages,
                "kvmesh.decode.kv_address": self.request.decode_kv_address,
            },
        )
        self._traceparent = tracing.traceparent(span)
        compute_end = job.arrival_time + result.queue_s + result.compute_s
        pushing = self.parts.finish_push(self.rid, self.kv_push, result, compute_end)
        try:
            report = await asyncio.shield(pushing)
        except asyncio.CancelledError:
            span.end()
            raise  # the push finishes (or fails) on its own and releases the pages
        except (TimeoutError, TransferError) as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            span.end()
            await self._push_failed(exc)
        span.set_attributes(
            {
                "kvmesh.kv.bytes": report.nbytes,
                "kvmesh.kv.seconds": report.seconds,
                "kvmesh.kv.exposed_seconds": report.exposed_s,
                "kvmesh.kv.parts": report.num_parts,
            }
        )
        span.end()
        self._record_push(result, report)
        return report

    def _record_push(self, result: PrefillResult, report: PushReport) -> None:
        """The push metrics and the request's log line."""
        metrics.observe_push(report.nbytes, report.seconds)
        self.engine.push_fit.add((1, len(result.block_ids) - self.request.decode_cached_pages), report.exposed_s)
        logger.info(
            "[%s] prefilled %d tokens (%d cached), pushed %d bytes in %d parts, %.3f s (%.3f s after the compute)",
            self.rid,
            len(self.request.token_ids),
            result.num_cached_tokens,
            report.nbytes,
            report.num_parts,
            report.seconds,
            report.exposed_s,
        )

    def _to_pb(self, result: PrefillResult, report: PushReport, pulled: Pulled) -> prefill_pb2.PrefillResponse:
        """The first token (each choice's, with logprobs when asked for) and the request's figures:
        the one place prefill's statistics are written (the gateway passes them on in Final)."""
        kv_transfer = gateway_pb2.KVTransfer(
            num_pages=len(result.block_ids) - self.request.decode_cached_pages,
            page_nbytes=self.engine.kv_cache.page_nbytes,
            nbytes=report.nbytes,
            seconds=report.seconds,
            exposed_seconds=report.exposed_s,
            prefill_digest=report.digest,
        )
        return prefill_pb2.PrefillResponse(
            first_token=result.first_token,
            num_cached_tokens=result.num_cached_tokens,
            num_computed_tokens=result.num_computed_tokens,
            queue_s=result.queue_s,
            compute_s=result.compute_s,
            num_pulled_tokens=pulled.tokens,
            pull_s=pulled.seconds,
            instance_id=self.parts.model.instance_id,
            kv_transfer=kv_transfer,
            traceparent=self._traceparent,
            first_logprobs=logprobs_to_pb(result.first_logprobs) if result.first_logprobs else None,
            choice_first_tokens=result.choice_first_tokens,
            choice_first_logprobs=[logprobs_to_pb(lp) for lp in result.choice_first_logprobs],
            prompt_logprobs=[logprobs_to_pb(lp) for lp in result.prompt_logprobs],
        )
