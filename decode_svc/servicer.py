"""gRPC adapter for the decode engine: Reserve, Generate (stream), Release, GetStats."""

from __future__ import annotations

import asyncio
import logging

import grpc

from decode_svc.engine import CapacityError, DecodeEngine, deliver_all
from kvmesh.wire import sampling_from_pb
from kvstore.ucx_transfer import KVReceiver, pages_digest
from protos.kvmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Reservations map transfer ids to the KV receiver's futures; pages are freed only
    once no push can still land in them."""

    def __init__(self, engine: DecodeEngine, receiver: KVReceiver, instance_id: str,
                 stop_token_ids: frozenset[int]) -> None:
        self.engine = engine
        self.receiver = receiver
        self.instance_id = instance_id
        self.stop_token_ids = stop_token_ids
        self._landed: dict[int, asyncio.Future] = {}
        loop = asyncio.get_running_loop()
        # the engine thread hands each step's tokens to this loop in one call
        engine.dispatch = lambda deliveries: loop.call_soon_threadsafe(deliver_all, deliveries)

    async def Reserve(self, request, context):
        try:
            res = self.engine.reserve(request.request_id, request.num_prompt_tokens, request.max_tokens)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        buffers = [self.engine.runner.page_buffer(b) for b in res.block_ids[:res.num_prompt_pages]]
        self._landed[res.transfer_id] = self.receiver.expect(res.transfer_id, buffers)
        asyncio.get_running_loop().call_later(
            self.engine.config.reservation_timeout_s, self._expire, res.transfer_id, request.request_id)
        return decode_pb2.ReserveResponse(
            kv_address=self.receiver.address, transfer_id=res.transfer_id,
            num_pages=res.num_prompt_pages, page_nbytes=self.engine.runner.page_nbytes,
            instance_id=self.instance_id)

    def _expire(self, transfer_id: int, request_id: str) -> None:
        if transfer_id in self._landed:  # Generate never claimed it
            logger.warning("[%s] reservation expired unused", request_id)
            self._abort(transfer_id)

    def _abort(self, transfer_id: int) -> None:
        """Stop expecting the push, then free the pages once it can no longer land."""
        future = self._landed.pop(transfer_id, None)
        if future is None:
            self.engine.release(transfer_id)
            return
        self.receiver.cancel(transfer_id)
        if future.done():
            self.engine.release(transfer_id)
        else:
            future.add_done_callback(lambda _f: self.engine.release(transfer_id))

    async def Release(self, request, context):
        known = request.transfer_id in self._landed
        self._abort(request.transfer_id)
        return decode_pb2.ReleaseResponse(released=known)

    async def Generate(self, request, context):
        rid, tid = request.request_id, request.transfer_id
        future = self._landed.pop(tid, None)
        if future is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"[{rid}] no reservation for transfer {tid:x}")
        queue: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout=request.kv_timeout_s or 60.0)
            except asyncio.TimeoutError:
                self._landed[tid] = future
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"[{rid}] KV push did not land within {request.kv_timeout_s or 60.0:.0f} s")
            except asyncio.CancelledError:
                if not future.done():  # the client went away before the push landed
                    self._landed[tid] = future
                raise
            except Exception as exc:  # the push failed on the receiving side
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"[{rid}] KV push failed: {exc}")
            digest = ""
            if self.engine.config.kv_digest:
                seq_pages = future.result().num_buffers
                digest = pages_digest(self.engine.runner.page_buffer(b)
                                   for b in self.engine.reserved_pages(tid)[:seq_pages])
            sampling = sampling_from_pb(request.sampling)
            seed = request.sampling.seed if request.sampling.HasField("seed") else 0
            stop_ids = frozenset() if request.sampling.ignore_eos else self.stop_token_ids
            self.engine.begin(tid, list(request.prompt_token_ids), request.first_token, sampling, seed, stop_ids,
                              lambda toks, fin: queue.put_nowait((toks, fin)))  # runs on this loop
            first = True
            while True:
                tokens, finish = await queue.get()
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
                    return
        finally:
            if not finished:
                self._abort(tid)

    async def GetStats(self, request, context):
        return common_pb2.InstanceStats(instance_id=self.instance_id, **self.engine.stats())
