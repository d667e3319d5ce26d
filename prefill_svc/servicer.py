"""gRPC adapter for the prefill engine: Prefill (compute + KV push) and GetStats."""

from __future__ import annotations

import asyncio
import logging
import random

from opentelemetry.trace import Status, StatusCode

from kvmesh.engine.outcomes import FailureCause
from kvmesh.engine.request import Request
from kvmesh.kvstore.block_hash import HASH_NBYTES, check_block_hashes
from kvmesh.kvstore.block_pool import NoFreeBlocksError
from kvmesh.kvstore.transport import KVPushSender, TransferError, pages_digest, parse_address
from kvmesh.prefill_svc import metrics
from kvmesh.prefill_svc.config import PrefillConfig
from kvmesh.prefill_svc.engine import Cancelled, PrefillEngine, PrefillResult
from kvmesh.prefill_svc.kv_pull import KVPuller, Pulled, PullStuck
from kvmesh.prefill_svc.kv_push import KVPush, PushReport
from kvmesh.protos.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from kvmesh.runtime import tracing
from kvmesh.runtime.served_model import ServedModel, grammar_state
from kvmesh.runtime.wire import (
    abort,
    check_request_id,
    kv_layout_mismatch,
    logprobs_to_pb,
    page_size_mismatch,
    sampling_from_pb,
)

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Runs each prefill on the engine's worker thread and pushes the request's pages to the
    decode instance (scatter-gather, in parts as chunked prefill completes them: KVPush)."""

    def __init__(
        self,
        engine: PrefillEngine,
        sender: KVPushSender,
        model: ServedModel,
        config: PrefillConfig,
        puller: KVPuller | None = None,
    ) -> None:
        """config: its push_timeout_s bounds each part of a KV push; kv_digest hashes the pages
        pushed. puller: pulls a prefix a peer holds (PrefillRequest.pull_from); None: never."""
        self.puller = puller
        self.engine = engine
        self.sender = sender
        self.model = model
        self.config = config
        self._background: set[asyncio.Task] = set()  # connect-ahead and release tasks, kept until done

    def _validate(self, request) -> None:
        n = len(request.token_ids)
        if n == 0:
            raise ValueError("token_ids is empty; send at least one prompt token")
        if n > self.model.max_context:
            raise ValueError(f"prompt has {n} tokens, the context holds {self.model.max_context}")
        bad = [t for t in request.token_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.model.vocab_size}), got {bad[:5]}")
        if request.decode_kv_address:
            parse_address(request.decode_kv_address)  # fail before computing, not at push time
        if request.pull_from:
            try:
                parse_address(request.pull_from)  # a peer's gRPC "host:port"
            except ValueError as exc:
                raise ValueError(f"pull_from (a peer prefill's gRPC address): {exc}") from None
        if not 0 <= request.pull_blocks <= n // self.engine.page_size:
            raise ValueError(f"pull_blocks must be in [0, {n // self.engine.page_size}], got {request.pull_blocks}")
        held = request.decode_cached_pages
        if not 0 <= held <= (n - 1) // self.engine.page_size:
            raise ValueError(
                f"decode_cached_pages must be in [0, {(n - 1) // self.engine.page_size}] (the prompt's full pages "
                f"before its last token's), got {held}"
            )
        check_block_hashes(request.block_hashes, n, self.engine.page_size)

    def _connect_ahead(self, address: str) -> None:
        """Connect to the decode's KV receiver while the prompt computes, so the push finds the
        connection made (a no-op when it is). A failure here is only logged: the push itself
        connects again and reports what it meets."""
        task = asyncio.ensure_future(self.sender.connect(address))
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.debug("connecting ahead to %s failed: %r", address, t.exception())

        task.add_done_callback(done)

    async def Prefill(self, request, context):
        with tracing.server_span("prefill", context, request.request_id, self.model.instance_id) as span:
            return await self._prefill(request, context, span)

    async def _prefill(self, request, context, span):
        rid = request.request_id
        try:
            check_request_id(rid)
        except ValueError as exc:
            await abort(context, FailureCause.BAD_REQUEST, str(exc))
        mismatch = page_size_mismatch(f"prefill {self.model.instance_id}", self.engine.page_size, request.page_size)
        if mismatch:
            await abort(context, FailureCause.MISMATCH, f"[{rid}] {mismatch}")
        grammar = None
        try:
            self._validate(request)
            sampling = sampling_from_pb(request.sampling, default_seed=random.getrandbits(63))
            if sampling.prompt_logprobs is not None and not hasattr(self.engine.runner, "forward_all"):
                raise ValueError("prompt logprobs are not available for this model yet")
            if sampling.grammar is not None:  # compiled off the loop (the first one loads xgrammar)
                grammar = await asyncio.to_thread(grammar_state, self.model, sampling.grammar)
        except ValueError as exc:
            await abort(context, FailureCause.BAD_REQUEST, f"[{rid}] {exc}")
        kv_push = None
        if request.decode_kv_address:
            self._connect_ahead(request.decode_kv_address)
            kv_push = KVPush(
                self.sender,
                request.decode_kv_address,
                request.transfer_id,
                self.engine.kv_cache,
                self.config.push_timeout_s,
                request.decode_cached_pages,
            )
        job = Request(
            rid,
            request.token_ids,
            sampling,
            transfer_id=request.transfer_id,
            block_hashes=list(request.block_hashes) or None,
            on_pages_ready=kv_push.pages_ready if kv_push else None,
            grammar=grammar,
        )
        pulled = Pulled(0, 0.0)
        # a prompt whose logprobs are asked for is computed whole: nothing to pull
        if (
            request.pull_from
            and request.pull_blocks > 0
            and self.puller is not None
            and sampling.prompt_logprobs is None
        ):
            pull_ns = tracing.now_ns()
            try:
                pulled = await self.puller.pull(job, request.pull_from, request.pull_blocks)
            except PullStuck as exc:
                await abort(context, FailureCause.KV_PUSH_FAILED, str(exc))
            except asyncio.CancelledError:
                if job.block_ids:  # allocated for the pull: given back (a stuck receive gives them itself)
                    self.engine.release(job.block_ids, job.state_slot)
                raise
            tracing.record(
                span,
                "prefill.pull",
                pull_ns,
                tracing.now_ns(),
                {
                    "kvmesh.pull.peer": request.pull_from,
                    "kvmesh.pull.tokens": pulled.tokens,
                    "kvmesh.pull.why_not": pulled.why_not,
                },
            )
        submitted_ns = tracing.now_ns()
        cfut = self.engine.submit(job)
        if kv_push is not None:  # a failed or abandoned request pushes no further part
            cfut.add_done_callback(lambda f: (f.cancelled() or f.exception() is not None) and kv_push.stop())
        outcome = asyncio.wrap_future(cfut)
        push_error: BaseException | None = None
        try:
            if kv_push is not None:  # a part that fails while later chunks compute ends the request now
                await asyncio.wait({outcome, kv_push.failed}, return_when=asyncio.FIRST_COMPLETED)
                if not outcome.done():
                    push_error = kv_push.failed.result()
            if push_error is None:
                # shield: a cancelled caller must not cancel the executor future (the job
                # flag stops it instead, and a finished compute still releases its pages)
                result: PrefillResult = await asyncio.shield(outcome)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            if kv_push is not None:
                kv_push.stop()
            self._release_when_computed(cfut, kv_push)
            outcome.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no log noise
            logger.info("[%s] cancelled by the caller", rid)
            raise
        except Cancelled:
            await abort(context, FailureCause.CANCELLED, f"[{rid}] cancelled")
        except NoFreeBlocksError as exc:
            await abort(context, FailureCause.OVERLOADED, f"[{rid}] {exc}", retry_after_s=1.0)
        except ValueError as exc:
            await abort(context, FailureCause.BAD_REQUEST, f"[{rid}] {exc}")
        except Exception as exc:  # a failed forward: this request fails, the service goes on
            logger.exception("[%s] prefill failed", rid)
            await abort(context, FailureCause.INTERNAL, f"[{rid}] prefill failed: {exc!r}")
        if push_error is not None and kv_push is not None:
            # the chunks being computed finish on the worker (a running batch is not cut short)
            # and their pages are released after; nothing more is pushed
            self.engine.cancel(job)
            kv_push.stop()
            self._release_when_computed(cfut, kv_push)
            outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
            await abort(
                context,
                FailureCause.KV_PUSH_FAILED,
                f"[{rid}] KV push to decode {request.decode_kv_address} failed: {push_error}",
            )

        queued_ns = submitted_ns + int(result.queue_s * 1e9)
        tracing.record(span, "prefill.queue", submitted_ns, queued_ns)
        tracing.record(
            span,
            "prefill.forward",
            queued_ns,
            queued_ns + int(result.compute_s * 1e9),
            {
                "kvmesh.prompt_tokens": len(request.token_ids),
                "kvmesh.cached_tokens": result.num_cached_tokens,
                "kvmesh.computed_tokens": result.num_computed_tokens,
            },
        )
        metrics.observe_prefill(result)
        push_span = tracing.child(
            span,
            "prefill.kv_push",
            attributes={
                "kvmesh.kv.pages": len(result.block_ids) - request.decode_cached_pages,
                "kvmesh.kv.decode_cached_pages": request.decode_cached_pages,
                "kvmesh.decode.kv_address": request.decode_kv_address,
            },
        )
        compute_end = job.arrival_time + result.queue_s + result.compute_s
        push = asyncio.ensure_future(self._push_and_release(kv_push, result, compute_end))
        # a push that outlives its caller (cancelled, or the caller's connection died while
        # this process was stopped) fails on its own: retrieve its error so it is logged once
        push.add_done_callback(
            lambda f: (
                f.cancelled()
                or f.exception() is None
                or logger.info("[%s] KV push ended after its caller left: %s", rid, f.exception())
            )
        )
        try:
            report = await asyncio.shield(push)
        except asyncio.CancelledError:
            push_span.end()
            raise  # the push finishes (or fails) on its own and releases the pages
        except (TimeoutError, TransferError) as exc:
            push_span.set_status(Status(StatusCode.ERROR, str(exc)))
            push_span.end()
            await abort(
                context,
                FailureCause.KV_PUSH_FAILED,
                f"[{rid}] KV push to decode {request.decode_kv_address} failed: {exc}",
            )
        push_span.set_attributes(
            {
                "kvmesh.kv.bytes": report.nbytes,
                "kvmesh.kv.seconds": report.seconds,
                "kvmesh.kv.exposed_seconds": report.exposed_s,
                "kvmesh.kv.parts": report.num_parts,
            }
        )
        push_span.end()
        metrics.observe_push(report.nbytes, report.seconds)
        logger.info(
            "[%s] prefilled %d tokens (%d cached), pushed %d bytes in %d parts, %.3f s (%.3f s after the compute)",
            rid,
            len(request.token_ids),
            result.num_cached_tokens,
            report.nbytes,
            report.num_parts,
            report.seconds,
            report.exposed_s,
        )
        return prefill_pb2.PrefillResponse(
            first_token=result.first_token,
            num_cached_tokens=result.num_cached_tokens,
            num_computed_tokens=result.num_computed_tokens,
            num_pages=len(result.block_ids) - request.decode_cached_pages,
            page_nbytes=self.engine.kv_cache.page_nbytes,
            nbytes_sent=report.nbytes,
            transfer_s=report.seconds,
            exposed_transfer_s=report.exposed_s,
            queue_s=result.queue_s,
            compute_s=result.compute_s,
            num_pulled_tokens=pulled.tokens,
            pull_s=pulled.seconds,
            instance_id=self.model.instance_id,
            kv_digest=report.digest,
            traceparent=tracing.traceparent(push_span),
            first_logprobs=logprobs_to_pb(result.first_logprobs) if result.first_logprobs else None,
            choice_first_tokens=result.choice_first_tokens,
            choice_first_logprobs=[logprobs_to_pb(lp) for lp in result.choice_first_logprobs],
            prompt_logprobs=[logprobs_to_pb(lp) for lp in result.prompt_logprobs],
        )

    def _release_when_computed(self, cfut, kv_push: KVPush | None) -> None:
        """The caller left: once the compute is done and no push part reads the pages, release them
        (a compute that failed or never started released them or held none)."""

        async def release() -> None:
            try:
                result = await asyncio.wrap_future(cfut)
            except BaseException:
                return
            if kv_push is not None:
                await kv_push.wait_idle()
            self.engine.release(result.block_ids, result.state_slot)

        task = asyncio.ensure_future(release())
        self._background.add(task)  # kept until done
        task.add_done_callback(self._background.discard)

    async def _push_and_release(self, kv_push: KVPush | None, result: PrefillResult, compute_end: float) -> PushReport:
        """Push the pages not pushed yet (all of them without chunks) and the state, then drop our references."""
        try:
            if kv_push is None:
                return PushReport(0, 0.0, 0.0, 0, "")
            return await kv_push.finish(result.block_ids, result.state_slot, compute_end, self.config.kv_digest)
        finally:
            if kv_push is not None:
                await kv_push.wait_idle()
            self.engine.release(result.block_ids, result.state_slot)

    async def PushBlocks(self, request, context):
        """A peer pulls cached blocks: push the pages of the leading run of `block_hashes` this
        instance holds to its KV receiver (none when it holds fewer than asked), holding them
        against eviction meanwhile."""
        with tracing.server_span("prefill.push_blocks", context, request.request_id, self.model.instance_id) as span:
            response = await self._push_blocks(request, context)
            span.set_attributes({"kvmesh.kv.pages": response.num_blocks, "kvmesh.kv.bytes": response.nbytes})
            return response

    async def _push_blocks(self, request, context):
        rid, kv_cache = request.request_id, self.engine.kv_cache
        try:
            check_request_id(rid)
            parse_address(request.kv_address)
            if not 0 < request.transfer_id < 1 << 63:
                raise ValueError(f"transfer_id must be in [1, 2^63), got {request.transfer_id}")
            if len(request.block_hashes) > self.model.max_context // self.engine.page_size:
                raise ValueError(f"at most {self.model.max_context // self.engine.page_size} block hashes")
            if any(len(h) != HASH_NBYTES for h in request.block_hashes):
                raise ValueError(f"block hashes must be {HASH_NBYTES} bytes each")
        except ValueError as exc:
            await abort(context, FailureCause.BAD_REQUEST, f"[{rid}] {exc}")
        mismatch = page_size_mismatch(f"prefill {self.model.instance_id}", self.engine.page_size, request.page_size)
        mismatch = mismatch or kv_layout_mismatch(
            f"prefill {self.model.instance_id}", self.engine.runner.page_layout.describe(), request.kv_layout
        )
        if mismatch:
            await abort(context, FailureCause.MISMATCH, f"[{rid}] {mismatch}")
        hashes = list(request.block_hashes)
        block_ids = await asyncio.wrap_future(self.engine.call(kv_cache.hold_blocks, hashes))
        try:
            if len(block_ids) < len(hashes):  # evicted since the index said so: the puller computes
                return prefill_pb2.PushBlocksResponse(num_blocks=len(block_ids))
            buffers = await asyncio.wrap_future(self.engine.call(kv_cache.outbound, block_ids, None, False))
            try:
                sent = await asyncio.wait_for(
                    self.sender.push(request.kv_address, request.transfer_id, buffers), self.config.push_timeout_s
                )
            except (TimeoutError, TransferError) as exc:
                await abort(context, FailureCause.KV_PUSH_FAILED, f"[{rid}] push of pulled blocks failed: {exc}")
            digest = pages_digest(buffers) if self.config.kv_digest else ""
            return prefill_pb2.PushBlocksResponse(
                num_blocks=len(block_ids), nbytes=sent.nbytes, seconds=sent.seconds, kv_digest=digest
            )
        finally:
            self.engine.call(kv_cache.release_blocks, block_ids)

    async def GetStats(self, request, context):
        # a long prefill holds the worker for seconds; the gateway's poll must not wait on it
        # (it would take a busy instance for a dead one), so past 0.2 s read the counters here
        future = self.engine.call(self.engine.stats)
        try:
            stats = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=0.2)
        except TimeoutError:
            stats = self.engine.stats(check=False)
        return common_pb2.InstanceStats(
            instance_id=self.model.instance_id,
            page_size=self.engine.page_size,
            model_fingerprint=self.model.fingerprint,
            kv_layout=self.engine.runner.page_layout.describe(),
            **stats,
        )
