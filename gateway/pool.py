"""The gateway's view of the mesh: channels to every instance, their health and load
(polled GetStats plus the gateway's own in-flight accounting), and the prefix index.

If Redis is unreachable the gateway keeps routing by load alone, logs it once, and goes
back to prefix routing when Redis answers again; no request fails because of the index.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gateway import metrics
from gateway.router import InstanceLoad, PrefillRouter, pick_decode
from kvmesh.service import GRPC_OPTIONS
from kvstore.block_hash import hash_blocks
from kvstore.redis_index import AsyncRedisKVIndexReader
from protos.kvmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class InstancePool:
    """Stubs, load and health of the prefill and decode instances, and the routing calls."""

    def __init__(self, prefill_addresses, decode_addresses, page_size: int, index: AsyncRedisKVIndexReader | None,
                 cache_threshold: float, load_weight: float, rpc_timeout_s: float,
                 routing_policy: str = "cache_aware") -> None:
        self.page_size = page_size
        self.index = index
        self.index_ok = True
        metrics.PREFIX_INDEX_UP.set(1 if index is not None else 0)
        self.rpc_timeout_s = rpc_timeout_s
        self.prefills = [InstanceLoad(a) for a in prefill_addresses]
        self.decodes = [InstanceLoad(a) for a in decode_addresses]
        self.router = PrefillRouter(self.prefills, cache_threshold=cache_threshold, load_weight=load_weight,
                                    policy=routing_policy)
        self._channels = {a: grpc.aio.insecure_channel(a, options=GRPC_OPTIONS)
                          for a in (*prefill_addresses, *decode_addresses)}
        self._prefill_stubs = {a: prefill_pb2_grpc.PrefillStub(self._channels[a]) for a in prefill_addresses}
        self._decode_stubs = {a: decode_pb2_grpc.DecodeStub(self._channels[a]) for a in decode_addresses}
        self._rr = 0
        self._poller: asyncio.Task | None = None

    def prefill_stub(self, inst: InstanceLoad) -> prefill_pb2_grpc.PrefillStub:
        return self._prefill_stubs[inst.address]

    def decode_stub(self, inst: InstanceLoad) -> decode_pb2_grpc.DecodeStub:
        return self._decode_stubs[inst.address]

    async def route(self, prompt_token_ids) -> tuple[InstanceLoad, InstanceLoad, int]:
        """(prefill, decode, cached tokens the index reports on that prefill). LookupError if none is healthy."""
        cached_blocks: dict[str, int] = {}
        ids = [i.instance_id for i in self.prefills if i.healthy and i.instance_id]
        hashes = hash_blocks(prompt_token_ids, self.page_size)
        if self.index is not None and ids:
            try:
                cached_blocks = await asyncio.wait_for(self.index.longest_prefix(hashes, ids), timeout=1.0)
                if not self.index_ok:
                    logger.info("prefix index reachable again; routing by cached prefix")
                self.index_ok = True
            except Exception as exc:
                if self.index_ok:
                    logger.warning("prefix index unreachable (%s); routing by load alone", exc)
                self.index_ok = False
            metrics.PREFIX_INDEX_UP.set(1 if self.index_ok else 0)
        decision = self.router.choose(len(prompt_token_ids), cached_blocks, self.page_size, hashes)
        prefill = next(i for i in self.prefills if i.address == decision.address)
        informed = self.index is not None and self.index_ok
        metrics.ROUTED_REQUESTS.labels(self.router.policy, "prefix" if informed else "load_only").inc()
        metrics.INDEX_CACHED_TOKENS.inc(decision.cached_tokens)
        self._rr += 1
        decode = pick_decode(self.decodes, self._rr)
        return prefill, decode, decision.cached_tokens

    def begin(self, prefill: InstanceLoad, decode: InstanceLoad, num_tokens: int) -> None:
        """Count a routed request as in flight before any report can show it (bursts spread)."""
        prefill.in_flight_requests += 1
        prefill.in_flight_tokens += num_tokens
        prefill.total_routed_tokens += num_tokens
        prefill.total_routed_requests += 1
        decode.in_flight_requests += 1
        decode.total_routed_requests += 1

    def end_prefill(self, prefill: InstanceLoad, num_tokens: int) -> None:
        prefill.in_flight_requests -= 1
        prefill.in_flight_tokens -= num_tokens

    def end_decode(self, decode: InstanceLoad) -> None:
        decode.in_flight_requests -= 1

    def mark_failed(self, where: str) -> None:
        """An RPC to `where` ("prefill host:port" / "decode host:port") was UNAVAILABLE."""
        address = where.split(" ", 1)[-1]
        for inst in (*self.prefills, *self.decodes):
            if inst.address == address:
                inst.healthy = False

    async def release(self, decode: InstanceLoad, request_id: str, transfer_id: int) -> None:
        try:
            await self.decode_stub(decode).Release(
                decode_pb2.ReleaseRequest(request_id=request_id, transfer_id=transfer_id), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("[%s] release on %s failed: %s", request_id, decode.address, exc.code().name)

    async def poll_once(self) -> None:
        """GetStats on every instance: learn instance ids, reported load and health."""
        async def one(inst: InstanceLoad, stub) -> None:
            try:
                stats = await stub.GetStats(common_pb2.StatsRequest(), timeout=min(self.rpc_timeout_s, 2.0))
            except grpc.aio.AioRpcError as exc:
                # a slow answer is a busy instance, not a dead one: only an unreachable one is down
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    inst.healthy = False
                return
            inst.healthy = True
            inst.instance_id = stats.instance_id
            inst.reported_queued_tokens = stats.num_queued_tokens
            inst.reported_active_requests = stats.num_active_requests

        await asyncio.gather(*[one(i, self._prefill_stubs[i.address]) for i in self.prefills],
                             *[one(i, self._decode_stubs[i.address]) for i in self.decodes])

    async def reap_index(self) -> None:
        """Drop the index entries of prefill instances whose lease lapsed (any gateway may)."""
        if self.index is None:
            return
        try:
            dead = await asyncio.wait_for(self.index.reap_expired(), timeout=2.0)
        except Exception as exc:  # the index is down: route() already says so
            logger.debug("index reap skipped: %s", exc)
            return
        for instance_id in dead:
            logger.warning("prefill %s stopped renewing its index lease; its index entries are removed", instance_id)

    def start_polling(self, interval_s: float, reap_every_s: float = 5.0) -> None:
        async def loop() -> None:
            since_reap = reap_every_s
            while True:
                await self.poll_once()
                if since_reap >= reap_every_s:
                    await self.reap_index()
                    since_reap = 0.0
                await asyncio.sleep(interval_s)
                since_reap += interval_s
        self._poller = asyncio.ensure_future(loop())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for ch in self._channels.values():
            await ch.close()
        if self.index is not None:
            await self.index.close()
