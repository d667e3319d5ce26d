"""The gateway's view of the mesh: channels to every instance, their health and load
(polled GetStats, gateway/stats_poll.py, plus the gateway's own in-flight accounting), the
prefix index (gateway/prefix_lookup.py), and the routing calls over them.

The instances are the static ones the gateway was started with plus those the instance
registry lists (gateway/discovery.py calls `add_instance` and `retire_instance`). A retired
instance takes no new request at once; its channel closes once the requests it still
serves have ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import grpc

from kvmesh.gateway import metrics
from kvmesh.gateway.prefix_lookup import PrefixLookup
from kvmesh.gateway.router import InstanceLoad, PrefillRouter, pick_decode, queued_tokens
from kvmesh.gateway.stats_poll import poll_instance
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader
from kvmesh.protos.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from kvmesh.runtime.service import GRPC_OPTIONS

logger = logging.getLogger(__name__)


# Requests a decode instance is assumed to take before its first stats report says.
DEFAULT_DECODE_SLOTS = 64


class InstancePool:
    """Stubs, load and health of the prefill and decode instances, and the routing calls."""

    def __init__(
        self,
        prefill_addresses,
        decode_addresses,
        page_size: int,
        index: AsyncRedisKVIndexReader | None,
        cache_threshold: float,
        load_weight: float,
        rpc_timeout_s: float,
        routing_policy: str = "cache_aware",
        model_fingerprint: str = "",
        decode_hit_slack: int = 0,
        decode_reuse_min_blocks: int = 1,
        pull_min_blocks: int = 0,
        tier_hit_weight: float = 0.5,
    ) -> None:
        self.pull_min_blocks = pull_min_blocks
        self.page_size = page_size
        self.decode_hit_slack = decode_hit_slack
        self.decode_reuse_min_blocks = decode_reuse_min_blocks
        self.model_fingerprint = model_fingerprint
        self.prefix = PrefixLookup(index)
        self.rpc_timeout_s = rpc_timeout_s
        self.prefills = [InstanceLoad(a) for a in prefill_addresses]
        self.decodes = [InstanceLoad(a) for a in decode_addresses]
        self.router = PrefillRouter(
            self.prefills,
            cache_threshold=cache_threshold,
            load_weight=load_weight,
            policy=routing_policy,
            tier_hit_weight=tier_hit_weight,
        )
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
        self._rr = 0
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

    def decode_capacity(self) -> int:
        """Requests the routable decode instances take at once (their reported slots)."""
        return sum(d.max_requests or DEFAULT_DECODE_SLOTS for d in self.decodes if d.routable)

    def max_decode_batch(self) -> int:
        """The largest batch a routable decode instance reported (sequences at once); 0 while
        none has reported one."""
        return max((d.max_requests for d in self.decodes if d.routable), default=0)

    def check_usable(self) -> None:
        """Raises MismatchError when every prefill or every decode instance disagrees with
        this gateway (page size, model), LookupError when none of one kind is routable."""
        for kind, insts in (("prefill", self.prefills), ("decode", self.decodes)):
            if insts and all(i.mismatch for i in insts):
                raise MismatchError("; ".join(i.mismatch for i in insts))
            if not any(i.routable for i in insts):
                why = self._why_down(insts) or "none listed, none registered in Redis yet"
                raise LookupError(f"no healthy {kind} instance ({why})")

    @staticmethod
    def _why_down(insts: list[InstanceLoad]) -> str:
        return ", ".join(
            f"{i.address}: "
            + (
                "unreachable"
                if not i.reachable
                else i.mismatch or f"circuit {i.breaker.state.value} after {i.breaker.consecutive_failures} failures"
            )
            for i in insts
        )

    async def route(
        self, prompt_token_ids, block_hashes, exclude: frozenset[str] = frozenset()
    ) -> tuple[InstanceLoad, InstanceLoad, int]:
        """(prefill, decode, cached tokens the index reports on that prefill), skipping the
        addresses in `exclude`. LookupError if none is routable.

        The gateway's own requests call the parts apart (`pick_decode`, then `lookup_prefix`
        and `pick_prefill` while decode's Reserve is in flight); this is them in one call."""
        cached_blocks = await self.lookup_prefix(block_hashes)
        prefill, cached_tokens = self.pick_prefill(len(prompt_token_ids), cached_blocks, block_hashes, exclude)
        return prefill, self.pick_decode(exclude, cached_blocks), cached_tokens

    def pick_decode(
        self, exclude: frozenset[str] = frozenset(), cached_blocks: Mapping[str, int] | None = None
    ) -> InstanceLoad:
        """The decode instance to reserve on (router.pick_decode: the fewest active requests, or
        within decode_hit_slack of them the one holding the most of the prompt by
        `cached_blocks`, lookup_prefix's answer), not one in `exclude`. Raises LookupError when
        none is routable, or when no prefill instance is (a reservation would be wasted)."""
        if not any(i.routable and i.address not in exclude for i in self.prefills):
            raise LookupError("no healthy prefill instance")
        self._rr += 1
        return pick_decode(self.decodes, self._rr, exclude, cached_blocks or {}, self.decode_hit_slack)

    def decode_reuse(self, decode: InstanceLoad, cached_blocks: Mapping[str, int]) -> int:
        """Leading prompt blocks `decode` holds by `lookup_prefix`'s answer, when they are worth
        a Reserve before Prefill (at least decode_reuse_min_blocks); else 0."""
        held = cached_blocks.get(decode.instance_id, 0) if decode.instance_id else 0
        return held if held >= self.decode_reuse_min_blocks else 0

    async def lookup_prefix(self, block_hashes) -> dict[str, int]:
        """instance_id -> leading blocks of `block_hashes` it holds in its page pool, from the
        prefix index, for the routable prefill and decode instances; {} without an index or
        while it is unreachable (never raises)."""
        return (await self.lookup_prefix_tiered(block_hashes))[0]

    async def lookup_prefix_tiered(self, block_hashes) -> tuple[dict[str, int], dict[str, int]]:
        """(lookup_prefix's answer, instance_id -> leading blocks in its pool or its second tier);
        the second is {} (and the index is asked of the pools alone) while no instance reports
        a second tier. Never raises."""
        insts = [i for i in (*self.prefills, *self.decodes) if i.routable and i.instance_id]
        tiered = any(i.kv_tier_medium for i in insts)
        return await self.prefix.leading_blocks_tiered(block_hashes, [i.instance_id for i in insts], tiered)

    def pick_prefill(
        self,
        num_prompt_tokens: int,
        cached_blocks,
        block_hashes,
        exclude: frozenset[str] = frozenset(),
        tiered_blocks: Mapping[str, int] | None = None,
    ) -> tuple[InstanceLoad, int]:
        """(prefill instance, prompt tokens the index says it holds in its pool or second tier)
        by the routing policy, from `lookup_prefix_tiered`'s answer (cached_blocks,
        tiered_blocks). Raises LookupError when none is routable.

        Synchronous: the caller counts the request on the instance before its next await, so
        concurrent requests see each other."""
        decision = self.router.choose(
            num_prompt_tokens, cached_blocks, self.page_size, block_hashes, exclude, tiered_blocks
        )
        prefill = next(i for i in self.prefills if i.address == decision.address)
        metrics.ROUTED_REQUESTS.labels(self.router.policy, "prefix" if self.prefix.informed else "load_only").inc()
        metrics.INDEX_CACHED_TOKENS.inc(decision.cached_tokens)
        return prefill, decision.cached_tokens

    def pull_source(
        self, prefill: InstanceLoad, cached_blocks: Mapping[str, int], exclude: frozenset[str] = frozenset()
    ) -> tuple[str, int]:
        """(gRPC address, leading prompt blocks) of the routable prefill instance other than
        `prefill` (and not in `exclude`) that holds the most of the prompt in its pool, when that
        is at least pull_min_blocks more than `prefill` holds: where `prefill` may pull them
        from instead of computing them. ("", 0) when none qualifies or pulls are off."""
        if not self.pull_min_blocks:
            return "", 0
        own = cached_blocks.get(prefill.instance_id, 0) if prefill.instance_id else 0
        best: tuple[str, int] = ("", 0)
        for inst in self.prefills:
            if inst is prefill or not inst.routable or inst.address in exclude or not inst.instance_id:
                continue
            held = cached_blocks.get(inst.instance_id, 0)
            if held >= own + self.pull_min_blocks and held > best[1]:
                best = (inst.address, held)
        return best

    def max_queued_prefill_tokens(self, exclude: frozenset[str] = frozenset()) -> int:
        """The most prefill tokens queued on any routable prefill instance (not in `exclude`):
        a bound on the queue a request meets before its prefill instance is chosen."""
        return max((queued_tokens(i) for i in self.prefills if i.routable and i.address not in exclude), default=0)

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
        differ ('' when it can)."""
        name = stats.instance_id or inst.address
        if stats.page_size and stats.page_size != self.page_size:
            return f"{name} has page_size {stats.page_size}, the gateway {self.page_size}"
        if stats.model_fingerprint and self.model_fingerprint and stats.model_fingerprint != self.model_fingerprint:
            return (
                f"{name} serves model {stats.model_fingerprint}, the gateway {self.model_fingerprint} "
                "(kvmesh.engine.loader.model_fingerprint)"
            )
        return ""

    def start_polling(self, interval_s: float, reap_every_s: float = 5.0) -> None:
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


class MismatchError(Exception):
    """Instances disagree with the gateway on page size or model (FAILED_PRECONDITION)."""
