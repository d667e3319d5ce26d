"""The Gateway service: validate, route, reserve on decode, prefill, stream tokens back.

Per request: pick a prefill instance (cached prefix vs load) and a decode instance
(least active), Reserve pages on decode, Prefill (which pushes the KV into those pages
over UCX and returns the first token), then stream Decode.Generate back to the client
with incremental detokenization and stop strings. Whatever happens, the decode
reservation is released unless decode finished it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway import metrics
from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.pool import InstancePool
from gateway.requests import GenerateInput, PromptBuilder
from kvmesh import tracing
from kvmesh.logs import request_context
from protos.kvmesh.v1 import common_pb2, decode_pb2, gateway_pb2, gateway_pb2_grpc, prefill_pb2

logger = logging.getLogger(__name__)

# Statuses passed through from a service as they are; anything else means the peer failed.
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}


def _sampling_pb(inp: GenerateInput) -> common_pb2.SamplingParams:
    s = inp.sampling
    return common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_tokens=inp.max_tokens, seed=inp.seed, ignore_eos=inp.ignore_eos)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Thin adapter over PromptBuilder (validation) and InstancePool (routing, stubs)."""

    def __init__(self, builder: PromptBuilder, pool: InstancePool, eos_token_ids: frozenset[int],
                 rpc_timeout_s: float, prefill_timeout_s: float) -> None:
        self.builder = builder
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        self.rpc_timeout_s = rpc_timeout_s
        self.prefill_timeout_s = prefill_timeout_s

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[self.builder.model_name],
                                              max_context_tokens=self.builder.max_context,
                                              max_tokens_limit=self.builder.max_tokens_limit,
                                              has_chat_template=bool(self.builder.tokenizer.chat_template))

    def _to_internal(self, request) -> GenerateInput:
        b = self.builder
        b.check_model(request.model)
        s = request.sampling
        ids = b.tokenize(request.prompt, [(m.role, m.content) for m in request.messages], request.chat,
                         request.prompt_token_ids)
        return b.build(request.request_id or uuid.uuid4().hex, ids, s.temperature,
                       s.top_p if s.HasField("top_p") else None, s.top_k,
                       s.max_tokens if s.HasField("max_tokens") else None,
                       s.seed if s.HasField("seed") else None, list(s.stop), s.ignore_eos)

    async def Generate(self, request, context):
        """One trace per request (continuing the caller's traceparent), its metrics, its logs."""
        arrived = time.perf_counter()
        span = tracing.tracer().start_span("gateway.generate", kind=SpanKind.SERVER,
                                           context=tracing.extract(context.invocation_metadata()))
        request_context.set((request.request_id, tracing.trace_id(span)))
        final = None
        try:
            async for msg in self._generate(request, context, span, arrived):
                if msg.HasField("final"):
                    final = msg.final
                    span.set_attributes({"kvmesh.finish_reason": final.finish_reason,
                                         "kvmesh.prompt_tokens": final.prompt_tokens,
                                         "kvmesh.cached_tokens": final.cached_tokens,
                                         "kvmesh.generated_tokens": final.generated_tokens,
                                         "kvmesh.ttft_s": final.ttft_s})
                yield msg
        except BaseException as exc:
            code = context.code() if hasattr(context, "code") else None
            status = getattr(code, "name", None) or ("CANCELLED" if isinstance(exc, asyncio.CancelledError)
                                                      else "UNKNOWN")
            span.set_status(Status(StatusCode.ERROR, status))
            metrics.REQUESTS.labels("error", status).inc()
            logger.info("request ended: %s", status)
            raise
        finally:
            span.end()
        f = final
        metrics.REQUESTS.labels(f.finish_reason, "OK").inc()
        metrics.TTFT.observe(f.ttft_s)
        metrics.E2E.observe(f.e2e_s)
        if f.generated_tokens > 1:
            metrics.ITL.observe(f.itl_s)
        logger.info("request finished: %s, %d prompt (%d cached) + %d generated tokens, TTFT %.3f s, e2e %.3f s",
                    f.finish_reason, f.prompt_tokens, f.cached_tokens, f.generated_tokens, f.ttft_s, f.e2e_s)

    async def _generate(self, request, context, span, arrived: float):
        t0 = tracing.now_ns()
        try:
            inp = await asyncio.to_thread(self._to_internal, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = inp.request_id
        request_context.set((rid, tracing.trace_id(span)))
        span.set_attribute("kvmesh.request_id", rid)
        tracing.record(span, "gateway.tokenize", t0, tracing.now_ns(),
                       {"kvmesh.prompt_tokens": len(inp.prompt_token_ids)})
        t0 = tracing.now_ns()
        try:
            route = await self.pool.route(inp.prompt_token_ids)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"[{rid}] {exc}")
        prefill, decode, cached_hint = route
        tracing.record(span, "gateway.route", t0, tracing.now_ns(), {
            "kvmesh.prefill.instance": prefill.instance_id or prefill.address,
            "kvmesh.decode.instance": decode.instance_id or decode.address,
            "kvmesh.index_cached_tokens": cached_hint, "kvmesh.routing_policy": self.pool.router.policy})
        logger.info("[%s] %d prompt tokens -> prefill %s (index: %d cached), decode %s", rid,
                    len(inp.prompt_token_ids), prefill.address, cached_hint, decode.address)
        n_prompt = len(inp.prompt_token_ids)
        n_queued = n_prompt - cached_hint  # the prefill tokens this request adds to the instance's queue
        self.pool.begin(prefill, decode, n_queued)
        where = f"decode {decode.address}"
        reserve = None
        decode_done = False
        call = None
        prefill_done = False
        try:
            reserve = await self.pool.decode_stub(decode).Reserve(
                decode_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=n_prompt, max_tokens=inp.max_tokens),
                timeout=self.rpc_timeout_s, metadata=tracing.inject(span))
            where = f"prefill {prefill.address}"
            pre = await self.pool.prefill_stub(prefill).Prefill(
                prefill_pb2.PrefillRequest(request_id=rid, token_ids=inp.prompt_token_ids,
                                           sampling=_sampling_pb(inp), decode_kv_address=reserve.kv_address,
                                           transfer_id=reserve.transfer_id),
                timeout=self.prefill_timeout_s, metadata=tracing.inject(span))
            self.pool.end_prefill(prefill, n_queued)
            prefill_done = True
            detok = IncrementalDetokenizer(self.builder.tokenizer)
            stops = StopStringMatcher(list(inp.stop))
            first_at = time.perf_counter()
            generated = [pre.first_token]
            finish = self._finish(inp, pre.first_token, 1)
            text, hit = stops.feed(detok.add([pre.first_token]), final=finish is not None)
            yield gateway_pb2.GenerateResponse(delta=gateway_pb2.TextDelta(text=text, token_ids=[pre.first_token]))
            decode_digest = ""
            if hit:
                finish = "stop"
            if finish is None:
                where = f"decode {decode.address}"
                call = self.pool.decode_stub(decode).Generate(decode_pb2.DecodeRequest(
                    request_id=rid, transfer_id=reserve.transfer_id, prompt_token_ids=inp.prompt_token_ids,
                    first_token=pre.first_token, sampling=_sampling_pb(inp), kv_timeout_s=self.rpc_timeout_s),
                    # decode's work continues the KV push, so its spans hang under prefill's
                    metadata=[("traceparent", pre.traceparent)] if pre.traceparent else tracing.inject(span))
                async for msg in call:
                    decode_digest = decode_digest or msg.kv_digest
                    generated.extend(msg.token_ids)
                    final = bool(msg.finish_reason)
                    text, hit = stops.feed(detok.add(list(msg.token_ids)), final=final)
                    if final:
                        decode_done = True
                        text += stops.feed(detok.flush(), final=True)[0] if not hit else ""
                    if text or msg.token_ids:
                        yield gateway_pb2.GenerateResponse(
                            delta=gateway_pb2.TextDelta(text=text, token_ids=list(msg.token_ids)))
                    if hit:
                        finish = "stop"
                        break
                    if final:
                        finish = msg.finish_reason
                        break
                if finish is None:
                    raise RuntimeError("decode stream ended without a finish reason")
            done = time.perf_counter()
            n_gen = len(generated)
            yield gateway_pb2.GenerateResponse(final=gateway_pb2.Final(
                finish_reason=finish, prompt_tokens=n_prompt, cached_tokens=pre.num_cached_tokens,
                generated_tokens=n_gen, ttft_s=first_at - arrived, e2e_s=done - arrived,
                itl_s=(done - first_at) / (n_gen - 1) if n_gen > 1 else 0.0,
                prefill_instance=pre.instance_id, decode_instance=reserve.instance_id, request_id=rid,
                queue_s=pre.queue_s, prefill_s=pre.compute_s,
                kv_transfer=gateway_pb2.KVTransfer(num_pages=pre.num_pages, page_nbytes=pre.page_nbytes,
                                                   nbytes=pre.nbytes_sent, seconds=pre.transfer_s,
                                                   prefill_digest=pre.kv_digest, decode_digest=decode_digest)))
        except grpc.aio.AioRpcError as exc:
            code = exc.code() if exc.code() in _PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
            if exc.code() == grpc.StatusCode.UNAVAILABLE and "KV push" not in (exc.details() or ""):
                # the instance itself is unreachable (a failed push blames decode, not prefill;
                # the stats poller finds out about decode within stats_interval_s)
                self.pool.mark_failed(where)
            logger.warning("[%s] %s failed: %s %s", rid, where, exc.code().name, exc.details())
            await context.abort(code, f"[{rid}] {where}: {exc.details()}")
        finally:
            if call is not None and not decode_done:
                call.cancel()
            if not prefill_done:
                self.pool.end_prefill(prefill, n_queued)
            self.pool.end_decode(decode)
            if reserve is not None and not decode_done and call is None:
                # decode never started streaming: give the pages back now
                asyncio.ensure_future(self.pool.release(decode, rid, reserve.transfer_id))

    def _finish(self, inp: GenerateInput, token: int, num_generated: int) -> str | None:
        if token in self.eos_token_ids and not inp.ignore_eos:
            return "stop"
        if num_generated >= inp.max_tokens:
            return "length"
        return None
