"""gRPC adapter for the decode engine: Reserve, Generate (stream), Release, GetStats."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
from decode_svc.engine import CapacityError, DecodeEngine, deliver_all
from kvmesh import tracing
from kvmesh.wire import sampling_from_pb
from kvstore.ucx_transfer import KVReceiver, pages_digest
from protos.kvmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Reservations map transfer ids to the KV receiver's futures; pages are freed only
    once no push can still land in them."""

    def __init__(self, engine: DecodeEngine, receiver: KVReceiver, instance_id: str,
                 stop_token_ids: frozenset[int], vocab_size: int, max_context: int) -> None:
        self.engine = engine
        self.receiver = receiver
        self.instance_id = instance_id
        self.stop_token_ids = stop_token_ids
        self.vocab_size = vocab_size
        self.max_context = max_context
        # transfers whose KV may still land: their pages are freed only once it cannot
        self._landed: dict[int, asyncio.Future] = {}
        self._claimed: set[int] = set()  # transfers a Generate call is attached to
        loop = asyncio.get_running_loop()
        # the engine thread hands each step's tokens to this loop in one call
        engine.dispatch = lambda deliveries: loop.call_soon_threadsafe(deliver_all, deliveries)

    async def Reserve(self, request, context):
        with tracing.server_span("decode.reserve", context, request.request_id, self.instance_id) as span:
            response = await self._reserve(request, context)
            span.set_attributes({"kvmesh.kv.prompt_pages": response.num_pages,
                                 "kvmesh.transfer_id": format(response.transfer_id, "x")})
            return response

    async def _reserve(self, request, context):
        n, m = request.num_prompt_tokens, request.max_tokens
        try:
            if n + m > self.max_context:
                raise ValueError(f"num_prompt_tokens ({n}) + max_tokens ({m}) exceeds the context of "
                                 f"{self.max_context} tokens")
            res = self.engine.reserve(request.request_id, n, m)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        self._landed[res.transfer_id] = self.receiver.expect(res.transfer_id,
                                                             self.engine.transfer_buffers(res.transfer_id))
        asyncio.get_running_loop().call_later(
            self.engine.config.reservation_timeout_s, self._expire, res.transfer_id, request.request_id)
        return decode_pb2.ReserveResponse(
            kv_address=self.receiver.address, transfer_id=res.transfer_id,
            num_pages=res.num_prompt_pages, page_nbytes=self.engine.runner.page_nbytes,
            instance_id=self.instance_id)

    def _expire(self, transfer_id: int, request_id: str) -> None:
        if transfer_id in self._landed and transfer_id not in self._claimed:
            logger.warning("[%s] reservation expired unused", request_id)
            self._abort(transfer_id)

    def _abort(self, transfer_id: int) -> None:
        """Stop expecting the push, then free the pages once it can no longer land."""
        future = self._landed.pop(transfer_id, None)
        if future is None:  # the KV landed already (or was never expected): free now
            self.engine.release(transfer_id)
            return
        self.receiver.cancel(transfer_id)
        if future.done():
            self.engine.release(transfer_id)
        else:
            future.add_done_callback(lambda _f: self.engine.release(transfer_id))

    async def Release(self, request, context):
        known = request.transfer_id in self._landed or request.transfer_id in self._claimed
        self._abort(request.transfer_id)
        return decode_pb2.ReleaseResponse(released=known)

    def _check(self, request) -> tuple:
        """Sampling settings of a Generate call; ValueError says what is wrong."""
        if not 0 <= request.first_token < self.vocab_size:
            raise ValueError(f"first_token must be in [0, {self.vocab_size}), got {request.first_token}")
        if not (math.isfinite(request.kv_timeout_s) and request.kv_timeout_s >= 0):
            raise ValueError(f"kv_timeout_s must be a finite number >= 0, got {request.kv_timeout_s}")
        sampling = sampling_from_pb(request.sampling)  # checks the seed's range too
        return sampling, request.sampling.seed if request.sampling.HasField("seed") else 0

    async def Generate(self, request, context):
        """The request's decode span continues the caller's trace (prefill's KV push)."""
        with tracing.server_span("decode.generate", context, request.request_id, self.instance_id) as span:
            async for msg in self._generate(request, context, span):
                yield msg

    async def _generate(self, request, context, span):
        rid, tid = request.request_id, request.transfer_id
        started_ns = tracing.now_ns()
        future = self._landed.get(tid)
        if future is None or tid in self._claimed:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"[{rid}] no reservation for transfer {tid:x}")
        self._claimed.add(tid)
        queue: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            try:
                sampling, seed = self._check(request)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[{rid}] {exc}")
            timeout = request.kv_timeout_s or 60.0
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout=timeout)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"[{rid}] KV push did not land within {timeout:.0f} s")
            except asyncio.CancelledError:
                if future.cancelled():  # released while waiting, not a cancelled call
                    await context.abort(grpc.StatusCode.CANCELLED, f"[{rid}] reservation released")
                raise
            except Exception as exc:  # the push failed on the receiving side
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"[{rid}] KV push failed: {exc}")
            self._landed.pop(tid, None)  # landed: nothing can write into these pages any more
            landed_ns = tracing.now_ns()
            landed = future.result()
            tracing.record(span, "decode.kv_receive", started_ns, landed_ns,
                           {"kvmesh.kv.buffers": landed.num_buffers, "kvmesh.kv.bytes": landed.nbytes})
            digest = ""
            if self.engine.config.kv_digest:
                digest = pages_digest(self.engine.transfer_buffers(tid))
            stop_ids = frozenset() if request.sampling.ignore_eos else self.stop_token_ids
            try:
                self.engine.begin(tid, list(request.prompt_token_ids), request.first_token, sampling, seed,
                                  stop_ids, lambda toks, fin: queue.put_nowait((toks, fin)))  # runs on this loop
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[{rid}] {exc}")
            except KeyError:  # released in the moment between landing and here
                await context.abort(grpc.StatusCode.CANCELLED, f"[{rid}] reservation released")
            first = True
            generated = 0
            while True:
                tokens, finish = await queue.get()
                if first:  # waiting for admission into the running batch, then the first step
                    tracing.record(span, "decode.admission", landed_ns, tracing.now_ns())
                    span.add_event("first_token")
                generated += len(tokens)
                if finish is not None and finish.startswith("error"):
                    finished = True
                    await context.abort(grpc.StatusCode.INTERNAL, f"[{rid}] {finish}")
                msg = decode_pb2.DecodeResponse(token_ids=tokens, finish_reason=finish or "")
                if first:
                    msg.kv_digest = digest
                    first = False
                yield msg
                if finish is not None:
                    finished = True
                    # per-step work summarized on the request's span, not a span per token
                    span.set_attributes({"kvmesh.finish_reason": finish, "kvmesh.decode.generated_tokens": generated,
                                         "kvmesh.prompt_tokens": len(request.prompt_token_ids),
                                         "kvmesh.decode.seconds": (tracing.now_ns() - landed_ns) / 1e9})
                    logger.info("[%s] decode finished: %s after %d tokens", rid, finish, generated)
                    return
        finally:
            self._claimed.discard(tid)
            if not finished:
                self._abort(tid)

    async def GetStats(self, request, context):
        return common_pb2.InstanceStats(instance_id=self.instance_id, **self.engine.stats())
