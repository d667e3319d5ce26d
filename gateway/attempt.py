"""One attempt of one request at the gateway: the calls of both legs, as one object.

An `Attempt` holds one try's decode instance (and its reservation) and prefill instance
(joined by `route_prefill` once the prefix index answered) and makes the calls to them; the
stages they move it through and the accounting on the instances are gateway/accounting.py's
(`finish()` and `abort(failure)` end it exactly once). The order of the legs is decided once,
in `open`: while decode's KV address is unknown (no stats poll said it), or when the prefix
index says decode holds some of the prompt's blocks, Reserve goes first (Prefill needs its
answer: the address, and how many leading pages decode holds, which the push then skips) and
its round trip covers the prefill choice; otherwise Prefill (TTFT's path) leaves first under a
transfer id the gateway picks and Reserve right behind it, neither waiting for the other. A Reserve that
answers another address or id (a restarted KV listener, an older decode) gets Prefill again.
What every attempt of a request shares, `Hops`, holds the bounds on each hop (`Deadlines`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway import wire
from kvmesh.gateway.accounting import AttemptAccounting
from kvmesh.gateway.answer import Answer
from kvmesh.gateway.failure import RequestFailed, failure_from_rpc
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.requests import GenerateInput
from kvmesh.gateway.slo import NO_SLO, Slo
from kvmesh.protos.v1 import decode_pb2, gateway_pb2, prefill_pb2
from kvmesh.runtime import tracing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefilled:
    """Both legs ready: decode reserved the pages and prefill pushed the KV into them."""

    reserve: decode_pb2.ReserveResponse
    prefill: prefill_pb2.PrefillResponse


GRAMMAR_COMPILE_ALLOWANCE_S = 60.0
"""More time for decode's first message when the answer follows a grammar: decode compiles it
before its first step, and an instance's first grammar also builds xgrammar's table of the
vocabulary (seconds on a quiet host, 30 s seen on a busy 2-core one). A decode that died or froze
meanwhile is still caught by the channel's keepalive pings (kvmesh.runtime.service, 5 s)."""


@dataclass(frozen=True)
class Deadlines:
    """The bounds on a request's hops (seconds), the same for every request of a gateway."""

    rpc_timeout_s: float
    """Deadline of Reserve; past the KV deadline, the bound on decode's first message."""
    token_timeout_s: float
    """Longest wait for the next message of the decode stream."""
    prefill_timeout_base_s: float
    """A Prefill call's deadline is this plus the tokens queued before it at the floor rate."""
    prefill_min_tokens_per_s: float
    """The floor rate of prefill (tokens a second) the Prefill deadline allows for."""

    def prefill_s(self, queued_tokens: int) -> float:
        """A Prefill call's deadline: base + `queued_tokens` (on the instance, this prompt's
        included) at the floor rate, seconds."""
        return self.prefill_timeout_base_s + queued_tokens / self.prefill_min_tokens_per_s


@dataclass(frozen=True)
class Hops:
    """What every attempt of one request sends, and the bounds on its hops."""

    request: GenerateInput
    span: Any
    """The request's trace span (its context rides in each call's metadata); None: no tracing."""
    deadlines: Deadlines
    """The gateway's bounds on each hop."""
    slo: Slo = NO_SLO
    """The request's latency targets (kvmesh.gateway.slo; none by default)."""


class Attempt(AttemptAccounting):
    """One try of one request: its two legs and their calls. `open` starts its calls;
    `route_prefill`, `send` and `stream` follow. The arguments are AttemptAccounting's (the
    pool gives the instances' stubs too: kvmesh.gateway.pool.InstancePool)."""

    def __init__(
        self, pool, request_id: str, prefill: InstanceLoad | None, decode: InstanceLoad, queued_tokens: int = 0
    ) -> None:
        super().__init__(pool, request_id, prefill, decode, queued_tokens)
        self._prefill_by = 0.0  # and _hops: set by open()
        self._prefill_call: grpc.aio.UnaryUnaryCall | None = None
        self._push_to: tuple[str, int] = ("", 0)  # (decode's KV address, transfer id) Prefill pushes to
        self._reserve_first = False
        self._block_hashes: Sequence[bytes] = ()
        self._decode_cached_pages = 0  # leading prompt pages decode holds (its Reserve said): not pushed
        self.pull: tuple[str, int] = ("", 0)
        """(a peer prefill's gRPC address, leading prompt blocks it holds): Prefill may pull them
        from there (kvmesh.gateway.pool.InstancePool.pull_source); set before send()."""

    async def open(self, hops: Hops, prefill_by: float, block_hashes: Sequence[bytes], decode_hit: bool) -> None:
        """Decide the order of the legs (module docstring) and send Reserve now if it goes first.

        prefill_by: Prefill's deadline (event-loop time), set before the prefill instance is chosen.
        block_hashes: the prompt's chained block hashes (prefill reuses them; decode caches the
        finished request's blocks under them). decode_hit: the index says decode holds some of
        them: Reserve goes first, reuses what decode holds, and Prefill pushes only the rest.
        """
        self._hops, self._prefill_by, self._block_hashes = hops, prefill_by, block_hashes
        # as decode's stats last said; its Reserve confirms it
        self._push_to = (self.decode.kv_address, random.getrandbits(63) or 1)
        self._reserve_first = not self.decode.kv_address or decode_hit
        if self._reserve_first:
            self._send_reserve()
            await asyncio.sleep(0)  # let the call go out before the caller's CPU work

    def send(self) -> None:
        """Once routed to prefill: send the calls not yet sent (Prefill, then Reserve behind it)."""
        if not self._reserve_first:
            self._send_prefill()
            self._send_reserve()

    async def stream(self, answer: Answer) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Run the attempt to its end, yielding `answer`'s messages: the first token as soon as
        prefill answers, decode's as they come, then the Final one.

        Raises RequestFailed (the caller aborts the attempt): a leg refused or failed, or decode
        sent nothing for rpc_timeout_s + token_timeout_s (the first message; plus
        GRAMMAR_COMPILE_ALLOWANCE_S with a grammar) or token_timeout_s."""
        deadlines = self._hops.deadlines
        legs = await self._both_legs()
        # the first token comes with prefill's answer and goes out now: it never waits for decode
        for first in answer.first(legs.prefill):
            yield first
        if answer.finish is None:
            messages = self._generate(legs).__aiter__()
            # the first message waits for admission into decode's batch; then one step each
            bound = deadlines.rpc_timeout_s + deadlines.token_timeout_s
            if self._hops.request.sampling.grammar is not None:
                bound += GRAMMAR_COMPILE_ALLOWANCE_S  # decode compiles it before its first step
            while answer.finish is None:
                msg = await self._next_decode_message(messages, bound)
                bound = deadlines.token_timeout_s
                delta = answer.add(msg)
                if delta is not None:
                    yield delta
        self.finish()
        yield answer.final(legs.prefill, legs.reserve)

    def _send_reserve(self) -> None:
        """Reserve on decode for the gateway's transfer id, in the background (an answer that
        comes after the attempt ended is released); decode frees the pages itself when no
        Generate claims them by the KV deadline (Prefill's deadline + rpc_timeout_s)."""
        hops, timeout_s = self._hops, self._hops.deadlines.rpc_timeout_s
        kv_deadline_s = self._prefill_by - asyncio.get_running_loop().time() + timeout_s
        layout = self.prefill.kv_layout if self.prefill is not None else ""
        request = wire.reserve_request(
            hops.request,
            self._push_to[1],
            kv_deadline_s,
            self.pool.page_size,
            layout,
            self._block_hashes,
            # only a Reserve whose answer Prefill waits for may reuse pages: Prefill must skip them
            reuse_cached=self._reserve_first,
        )
        stub = self.pool.decode_stub(self.decode)
        metadata = tracing.inject(hops.span)
        self.reserving(self.pool.spawn(stub.Reserve(request, timeout=timeout_s, metadata=metadata)))

    def _send_prefill(self) -> None:
        """Start the Prefill call (a grpc.aio call is on its way once made) that pushes the KV
        to `_push_to`; its deadline is the attempt's prefill_by."""
        hops = self._hops
        assert self.prefill is not None, self.request_id
        address, transfer_id = self._push_to
        request = wire.prefill_request(
            hops.request,
            self._block_hashes,
            address,
            transfer_id,
            self.pool.page_size,
            self._decode_cached_pages,
            self.pull,
        )
        timeout = self._prefill_by - asyncio.get_running_loop().time()
        stub = self.pool.prefill_stub(self.prefill)
        self._prefill_call = stub.Prefill(request, timeout=timeout, metadata=tracing.inject(hops.span))

    async def _both_legs(self) -> Prefilled:
        """Reserve's answer (sending Prefill now, or again where decode says), then Prefill's."""
        assert self._reserve_call is not None and self.prefill is not None, self.request_id
        try:
            try:
                # shielded: a client that leaves now must not cut the call off mid-way, or decode
                # could reserve pages nobody releases; the abort releases the late answer instead
                reserve = await asyncio.shield(self._reserve_call)
            except grpc.aio.AioRpcError as exc:
                failure = failure_from_rpc(exc, "decode", self.decode, self.decode, self.request_id)
                # a full decode pool frees pages as answers end: wait for room (bounded)
                failure.wait_for_room = failure.cause == FailureCause.OVERLOADED
                raise failure from None
            self.reserved(reserve.transfer_id)
            self.decode.kv_address = reserve.kv_address
            if self._prefill_call is not None and self._push_to != (reserve.kv_address, reserve.transfer_id):
                # decode moved its KV listener (restarted on the same gRPC address), or picked its
                # own transfer id (an older decode): push where and as it says
                logger.info(
                    "[%s] decode reserved transfer %x at %s; sending Prefill again",
                    self.request_id,
                    reserve.transfer_id,
                    reserve.kv_address,
                )
                self._prefill_call.cancel()
                self._prefill_call = None
            if self._prefill_call is None:
                self._push_to = (reserve.kv_address, reserve.transfer_id)
                self._decode_cached_pages = reserve.num_cached_pages
                self._send_prefill()
        except BaseException:
            if self._prefill_call is not None:
                self._prefill_call.cancel()  # prefill drops the job and its pages
            raise
        assert self._prefill_call is not None, self.request_id
        try:
            prefilled = await self._prefill_call
        except grpc.aio.AioRpcError as exc:
            raise failure_from_rpc(
                exc, "prefill", self.prefill, self.decode, self.request_id, slow_is_lost=False
            ) from None
        self.prefilled()
        return Prefilled(reserve, prefilled)

    def _generate(self, legs: Prefilled):
        """Open decode's stream of the tokens after the first."""
        hops = self._hops
        request = wire.decode_request(
            hops.request, legs.reserve.transfer_id, legs.prefill, hops.deadlines.rpc_timeout_s
        )
        # decode's work continues the KV push, so its spans hang under prefill's
        traceparent = legs.prefill.traceparent
        metadata = [("traceparent", traceparent)] if traceparent else tracing.inject(hops.span)
        call = self.pool.decode_stub(self.decode).Generate(request, metadata=metadata)
        self.decoding(call)
        return call

    async def _next_decode_message(self, messages, bound: float) -> decode_pb2.DecodeResponse:
        try:
            # a timeout scope, not wait_for: no task per token on the stream's hot path
            async with asyncio.timeout(bound):
                return await messages.__anext__()
        except TimeoutError:
            name = self.decode.instance_id or self.decode.address
            raise RequestFailed(
                FailureCause.INSTANCE_LOST,
                f"[{self.request_id}] decode {name}: no token for {bound:.0f} s",
                self.decode,
            ) from None
        except StopAsyncIteration:
            raise RequestFailed(
                FailureCause.INTERNAL, f"[{self.request_id}] decode stream ended without a finish reason"
            ) from None
        except grpc.aio.AioRpcError as exc:
            raise failure_from_rpc(exc, "decode", self.decode, self.decode, self.request_id) from None
