"""gRPC adapter for the prefill engine: Prefill (compute + KV push: kvmesh.prefill_svc.prefill_call),
PushBlocks (a peer pulls cached blocks) and GetStats."""

from __future__ import annotations

import asyncio
import logging

from kvmesh.engine.outcomes import FailureCause
from kvmesh.engine.precision import dtype_name
from kvmesh.kvstore.block_hash import HASH_NBYTES
from kvmesh.kvstore.transport import KVPushSender, TransferError, pages_digest, parse_address
from kvmesh.prefill_svc.config import PrefillConfig
from kvmesh.prefill_svc.engine import PrefillEngine
from kvmesh.prefill_svc.kv_pull import KVPuller
from kvmesh.prefill_svc.parts import PrefillParts
from kvmesh.prefill_svc.prefill_call import PrefillCall
from kvmesh.protos.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from kvmesh.runtime import tracing
from kvmesh.runtime.served_model import ServedModel
from kvmesh.runtime.wire import abort, check_request_id, kv_layout_mismatch, page_size_mismatch

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
        self.parts = PrefillParts(engine, sender, model, config, puller)

    async def Prefill(self, request, context):
        """Compute the prompt's uncached part, answer its first token and push its KV to decode
        (kvmesh.prefill_svc.prefill_call.PrefillCall: the steps)."""
        with tracing.server_span("prefill", context, request.request_id, self.model.instance_id) as span:
            return await PrefillCall(self.parts, request, context, span).run()

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
            layout = self.engine.runner.page_layout.describe()
            digest = pages_digest(buffers, layout) if self.config.kv_digest else ""
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
            dtype=dtype_name(self.engine.runner.dtype),
            **stats,
        )
