"""The instances a gateway talks to: their channels and stubs, joining and leaving, their
stats polls (gateway/stats_poll.py) and the pool's background tasks. `InstanceSet` is the
base of kvmesh.gateway.pool.InstancePool, which adds the routing calls over them.

The instances are the static ones the gateway was started with plus those the instance
registry lists (gateway/discovery.py calls `add_instance` and `retire_instance`). A retired
instance takes no new request at once; its channel closes once the requests it still
serves have ended.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.prefix_lookup import PrefixLookup
from kvmesh.gateway.stats_poll import poll_instance
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader
from kvmesh.protos.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from kvmesh.runtime.service import GRPC_OPTIONS

logger = logging.getLogger(__name__)


class InstanceSet:
    """Channels, stubs, membership and health of the prefill and decode instances.

    Args:
        prefill_addresses, decode_addresses: the static instances (host:port), never retired.
        page_size: tokens per block; an instance reporting another one is a mismatch.
        index: the Redis prefix index (None: routing by load alone); the polling loop reaps
            the entries of instances whose lease lapsed.
        rpc_timeout_s: deadline of Release (seconds); GetStats gets at most 2 s of it.
        model_fingerprint: the gateway's model (kvmesh.engine.loader.model_fingerprint; '':
            not compared).
    """

    def __init__(
        self,
        prefill_addresses,
        decode_addresses,
        page_size: int,
        index: AsyncRedisKVIndexReader | None,
        rpc_timeout_s: float,
        model_fingerprint: str = "",
    ) -> None:
        self.page_size = page_size
        self.model_fingerprint = model_fingerprint
        self.prefix = PrefixLookup(index)
        self.rpc_timeout_s = rpc_timeout_s
        self.prefills = [InstanceLoad(a) for a in prefill_addresses]
        self.decodes = [InstanceLoad(a) for a in decode_addresses]
        self.static_addresses = frozenset((*prefill_addresses, *decode_addresses))
        """The instances given on the command line: never retired."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill_stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._decode_stubs: dict[str, decode_pb2_grpc.DecodeStub] = {}
        for a in prefill_addresses:
            self._connect("prefill", a)
        for a in decode_addresses:
            self._connect("decode", a)
        self._retired: dict[str, tuple[InstanceLoad, float]] = {}
        """address -> (instance, monotonic time it was retired), until its channel closes."""
        self._poller: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.on_capacity: list = []
        """Called (no arguments) after each poll: capacity may have grown (admission pumps)."""

    def _connect(self, role: str, address: str) -> None:
        channel = self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        if role == "prefill":
            self._prefill_stubs[address] = prefill_pb2_grpc.PrefillStub(channel)
        else:
            self._decode_stubs[address] = decode_pb2_grpc.DecodeStub(channel)

    def instances_of(self, role: str) -> list[InstanceLoad]:
        """The routing list of `role` (prefill or decode); ValueError for another role."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        return self.prefills if role == "prefill" else self.decodes

    def add_instance(self, role: str, address: str) -> InstanceLoad | None:
        """Start routing to the `role` instance at `address` (host:port) once a stats poll has
        answered (it starts unreachable); brings back one retired with its channel still open.
        Returns the new instance, or None when the gateway has it already."""
        insts = self.instances_of(role)
        if any(i.address == address for i in (*self.prefills, *self.decodes)):
            return None
        retired = self._retired.pop(address, None)
        if retired is not None and address in self.instance_stubs(role):
            inst = retired[0]  # back (a lease renewed after a pause): its accounting is still right
        else:
            old = self._close_channel(address)  # retired as the other role: a new channel
            if old is not None:
                self.spawn(old)
            self._connect(role, address)
            inst = InstanceLoad(address, reachable=False)
        insts.append(inst)  # in place: the router holds this list
        return inst

    def instance_stubs(self, role: str) -> dict:
        """address -> stub of every `role` instance with an open channel (retired ones too)."""
        return self._prefill_stubs if role == "prefill" else self._decode_stubs

    def retire_instance(self, address: str) -> InstanceLoad | None:
        """Stop routing new requests to the instance at `address` (it drained, or its lease
        lapsed); requests it serves run on. Static instances are never retired. Returns the
        instance, or None when there is none to retire."""
        if address in self.static_addresses:
            return None
        for insts in (self.prefills, self.decodes):
            for inst in insts:
                if inst.address == address:
                    insts.remove(inst)
                    self._retired[address] = (inst, time.monotonic())
                    for callback in self.on_capacity:
                        callback()  # decode capacity shrank: admission re-reads it
                    return inst
        return None

    async def close_retired(self, linger_s: float) -> list[str]:
        """Close the channels of retired instances that serve no request of this gateway and
        were retired at least linger_s seconds ago (a Release may follow a request's end).
        Returns their addresses."""
        now = time.monotonic()
        done = [
            a for a, (inst, since) in self._retired.items() if inst.in_flight_requests == 0 and now - since >= linger_s
        ]
        for a in done:
            del self._retired[a]
            closing = self._close_channel(a)
            if closing is not None:
                await closing
        return done

    def _close_channel(self, address: str):
        """Forget the stubs of `address`; the channel's close() coroutine, or None without one."""
        self._prefill_stubs.pop(address, None)
        self._decode_stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        return channel.close() if channel is not None else None

    def prefill_stub(self, inst: InstanceLoad) -> prefill_pb2_grpc.PrefillStub:
        return self._prefill_stubs[inst.address]

    def decode_stub(self, inst: InstanceLoad) -> decode_pb2_grpc.DecodeStub:
        return self._decode_stubs[inst.address]

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` in the background, holding a reference until it ends (the event loop
        keeps only weak ones: an unreferenced task can vanish mid-way, and a Release with it)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def release(self, decode: InstanceLoad, request_id: str, transfer_id: int) -> None:
        try:
            await self.decode_stub(decode).Release(
                decode_pb2.ReleaseRequest(request_id=request_id, transfer_id=transfer_id), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            # a frozen or dead decode frees the pages itself when its reservation expires
            logger.warning("[%s] release on %s failed: %s", request_id, decode.address, exc.code().name)

    async def poll_once(self) -> None:
        """GetStats on every instance (gateway/stats_poll.py), then the capacity callbacks."""
        await self.poll([*self.prefills, *self.decodes])

    async def poll(self, insts: list[InstanceLoad]) -> None:
        """poll_once for `insts` alone (instances of this pool)."""
        timeout_s = min(self.rpc_timeout_s, 2.0)
        stubs = [self._prefill_stubs.get(i.address) or self._decode_stubs.get(i.address) for i in insts]
        # an instance without a stub was retired and closed while the poll was on its way
        await asyncio.gather(
            *[poll_instance(s, i, timeout_s, self._mismatch) for s, i in zip(stubs, insts) if s is not None]
        )
        for callback in self.on_capacity:
            callback()

    def _mismatch(self, inst: InstanceLoad, stats) -> str:
        """Why `inst` cannot serve with this gateway, from its `stats`: its page size or model
        differ from the gateway's, or its dtype from the instances already serving (the first
        to report one sets the mesh's: KV pages of one dtype cannot land in the other's) ('' when it can)."""
        name = stats.instance_id or inst.address
        if stats.page_size and stats.page_size != self.page_size:
            return f"{name} has page_size {stats.page_size}, the gateway {self.page_size}"
        other = next(
            (
                o
                for o in (*self.prefills, *self.decodes)
                if o is not inst and o.dtype and o.reachable and not o.mismatch
            ),
            None,
        )
        if stats.dtype and other is not None and other.dtype != stats.dtype:
            return (
                f"{name} computes in {stats.dtype}, {other.instance_id or other.address} already serving in "
                f"{other.dtype}: every prefill and decode of a mesh needs the same --dtype"
            )
        if stats.model_fingerprint and self.model_fingerprint and stats.model_fingerprint != self.model_fingerprint:
            return (
                f"{name} serves model {stats.model_fingerprint}, the gateway {self.model_fingerprint} "
                "(kvmesh.engine.loader.model_fingerprint)"
            )
        return ""

    def start_polling(self, interval_s: float, reap_every_s: float = 5.0) -> None:
        """Poll every instance each interval_s seconds, and every reap_every_s drop the index
        entries of instances whose lease lapsed, in the background until close()."""

        async def loop() -> None:
            since_reap = reap_every_s
            while True:
                await self.poll_once()
                if since_reap >= reap_every_s:
                    await self.prefix.reap()
                    since_reap = 0.0
                await asyncio.sleep(interval_s)
                since_reap += interval_s

        self._poller = asyncio.ensure_future(loop())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for ch in self._channels.values():
            await ch.close()
        await self.prefix.close()
