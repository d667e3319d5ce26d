"""One admitted request's tries at the gateway: route it, open an attempt, stream it, retry.

`Tries.run` is what gateway/request_path.py runs once a request is admitted. Each try looks up
which instances hold how much of the prompt (its block hashes, once per request, chained from
the key's tenant root; a session's last turn added), picks a decode instance and opens an
attempt on it (gateway/attempt.py: it decides the order of Reserve and Prefill and may send
Reserve now), picks a prefill instance (cached prefix vs load) and a peer it may pull from,
sends what the attempt has not sent yet, and streams its answer (gateway/answer.py).
Each attempt ends exactly once. A try that fails before any token reached the client is tried
again: after a short wait when decode had no room (within the admission queue's time bound),
or once on other instances when a retry can fix the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.answer import Answer
from kvmesh.gateway.attempt import Attempt, Hops
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.pool import InstancePool
from kvmesh.gateway.router import RouteDecision
from kvmesh.gateway.sessions import SessionTable
from kvmesh.gateway.slo_watch import SloWatch
from kvmesh.kvstore.block_hash import hash_blocks, tenant_root
from kvmesh.protos.v1 import gateway_pb2
from kvmesh.runtime import tracing

logger = logging.getLogger(__name__)

ROOM_RETRY_S = 0.5
"""Seconds between tries while decode has no room (answers end every step, freeing pages)."""


@dataclass(frozen=True)
class GatewayParts:
    """What every request's tries read of the gateway (RequestPath's, as the request starts)."""

    pool: InstancePool
    sessions: SessionTable
    tokenizer: Any
    """The tokenizer answers are detokenized with (kvmesh.gateway.answer.Answer)."""
    eos_token_ids: frozenset[int]
    max_queue_time_s: float
    """How long the tries may keep waiting for room on a full decode (seconds; the admission
    queue's bound)."""
    slo_shed: bool = False
    """Refuse a request no instance is predicted to serve within its SLO (--slo-miss shed)."""


class Tries:
    """The tries of one admitted request; `run()` yields its messages (module docstring).

    Args:
        parts: the gateway's.
        hops: the request, its trace span and the deadlines of its hops.
        arrived: time.perf_counter() when the request arrived; waited: seconds it spent in the
            admission queue (both go to the answer's timings).
        tenant: the key's cache namespace: the block hashes chain from its root ("" without keys).
        session_key: SessionTable.key of its session (b"": none): adds the session's last turn
            to what the index says its instances hold, and remembers this turn's.
    """

    def __init__(
        self, parts: GatewayParts, hops: Hops, arrived: float, waited: float, tenant: str = "", session_key: bytes = b""
    ) -> None:
        self.parts, self.pool, self.hops = parts, parts.pool, hops
        self.arrived, self.waited = arrived, waited
        self.tenant, self.session_key = tenant, session_key
        self.request_id = hops.request.request_id
        self.num_prompt_tokens = len(hops.request.prompt_token_ids)
        self.retries = 0
        self.excluded: frozenset[str] = frozenset()
        """Addresses of instances a failed try was blamed on: the retry goes elsewhere."""
        self.hashes: Sequence[bytes] | None = None
        """The prompt's block hashes, once per request: the index lookup, routing and both
        legs' caches read them."""
        self.waited_for_room = False  # decode was full: Reserve goes first from then on (no Prefill wasted)
        self.watch = SloWatch(self.pool, hops.slo, self.request_id, self.num_prompt_tokens, arrived)
        self._give_up_at = 0.0  # event-loop time the waits for room end; set by run()

    async def run(self) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Try until an attempt streams the whole answer, yielding its messages.

        Raises RequestFailed when a try fails and no retry is left (or a token was already sent).
        Closing the generator aborts the attempt on both legs."""
        self._give_up_at = asyncio.get_running_loop().time() + self.parts.max_queue_time_s
        while True:
            attempt: Attempt | None = None
            answer = Answer(
                self.parts.tokenizer,
                self.hops.request,
                self.parts.eos_token_ids,
                self.arrived,
                self.waited,
                self.retries,
            )
            try:
                t0 = tracing.now_ns()
                cached_blocks, tiered_blocks = await self._look_up()
                if self.parts.slo_shed and self.hops.slo:
                    self.watch.check(cached_blocks, self.excluded)  # before any page or slot is taken
                attempt = self._pick_decode(cached_blocks)
                decode_blocks = await self._open(attempt, cached_blocks)
                prefill, decision = self._pick_prefill(attempt, cached_blocks, tiered_blocks, decode_blocks)
                if self.parts.slo_shed and self.hops.slo:
                    self.watch.check_route(decision)  # the queues may have grown while decode reserved
                self._record_route(attempt, prefill, t0, decision, decode_blocks)
                attempt.send()
                async with contextlib.aclosing(attempt.stream(answer)) as messages:
                    async for msg in messages:
                        self.watch.first_token()
                        if msg.HasField("final"):
                            self.watch.final(msg.final)
                        yield msg
                return
            except RequestFailed as failure:
                if attempt is not None:
                    attempt.abort(failure)
                if answer.token_ids or not await self._may_try_again(failure):
                    raise
            except BaseException:
                if attempt is not None:
                    attempt.abort(None)  # the client went away (or a bug): release both legs
                raise

    async def _look_up(self) -> tuple[dict[str, int], dict[str, int]]:
        """(cached_blocks, tiered_blocks): instance_id -> leading prompt blocks it holds in its
        pool, and in its pool or second tier (kvmesh.gateway.pool.InstancePool.lookup_prefix_tiered),
        with the session's last turn added."""
        if self.hashes is None:
            self.hashes = hash_blocks(self.hops.request.prompt_token_ids, self.pool.page_size, tenant_root(self.tenant))
        # one lookup for both roles: which prefill and which decode hold how much of it
        cached_blocks, tiered_blocks = await self.pool.lookup_prefix_tiered(self.hashes)
        if self.session_key:
            cached_blocks, tiered_blocks = dict(cached_blocks), dict(tiered_blocks)
            self.parts.sessions.add_held(self.session_key, self.hashes, cached_blocks, tiered_blocks)
        return cached_blocks, tiered_blocks

    def _pick_decode(self, cached_blocks: dict[str, int]) -> Attempt:
        """A new attempt on the decode instance picked for this try (counted on it at once)."""
        try:
            decode = self.pool.pick_decode(self.excluded, cached_blocks, self.hops.slo.itl_s, self.num_prompt_tokens)
        except LookupError as exc:
            raise RequestFailed(FailureCause.NO_INSTANCE, f"[{self.request_id}] {exc}") from None
        return Attempt(self.pool, self.request_id, None, decode)

    async def _open(self, attempt: Attempt, cached_blocks: dict[str, int]) -> int:
        """Open `attempt` (Reserve may leave now); returns the leading prompt blocks its decode
        holds and reuses (0: none worth a Reserve before Prefill)."""
        loop = asyncio.get_running_loop()
        # bounds the prefill before it is chosen: the longest queue it can meet
        queued = self.pool.max_queued_prefill_tokens(self.excluded) + self.num_prompt_tokens
        prefill_by = loop.time() + self.hops.deadlines.prefill_s(queued)
        decode_blocks = self.pool.decode_reuse(attempt.decode, cached_blocks)
        # Reserve first (Prefill waits for it) when decode holds some of the prompt, when
        # a full decode was waited for, or for n choices (a larger reservation)
        reserve_first = decode_blocks > 0 or self.waited_for_room or self.hops.request.sampling.n > 1
        assert self.hashes is not None, self.request_id
        await attempt.open(self.hops, prefill_by, self.hashes, decode_hit=reserve_first)
        return decode_blocks

    def _pick_prefill(
        self, attempt: Attempt, cached_blocks: dict[str, int], tiered_blocks: dict[str, int], decode_blocks: int
    ) -> tuple[InstanceLoad, RouteDecision]:
        """Route `attempt`'s prefill leg (within what is left of the TTFT SLO, when the request
        has one), and name a peer it may pull from; returns (the prefill instance, the decision:
        prompt tokens the index says it holds, the TTFT predicted there)."""
        try:
            prefill, decision = self.pool.pick_prefill(
                self.num_prompt_tokens,
                cached_blocks,
                self.hashes,
                self.excluded,
                tiered_blocks,
                self.watch.ttft_budget_s,
                decode_blocks,
            )
        except LookupError as exc:
            raise RequestFailed(FailureCause.NO_INSTANCE, f"[{self.request_id}] {exc}") from None
        # a peer holding more of the prompt: prefill may pull from it instead of computing
        attempt.pull = self.pool.pull_source(prefill, cached_blocks, self.excluded)
        # the prefill tokens this request adds to the instance's queue
        attempt.route_prefill(prefill, self.num_prompt_tokens - decision.cached_tokens)
        if self.session_key:
            assert self.hashes is not None, self.request_id
            self.parts.sessions.remember(self.session_key, prefill.instance_id, attempt.decode.instance_id, self.hashes)
        return prefill, decision

    def _record_route(
        self, attempt: Attempt, prefill: InstanceLoad, t0: int, decision: RouteDecision, decode_blocks: int
    ) -> None:
        """The route's span (from t0, ns), with what was predicted there, and its log line."""
        decode, page_size, cached_hint = attempt.decode, self.pool.page_size, decision.cached_tokens
        predicted = self.watch.routed(prefill, decision, decode, decode_blocks)
        tracing.record(
            self.hops.span,
            "gateway.route",
            t0,
            tracing.now_ns(),
            {
                "kvmesh.prefill.instance": prefill.instance_id or prefill.address,
                "kvmesh.decode.instance": decode.instance_id or decode.address,
                "kvmesh.index_cached_tokens": cached_hint,
                "kvmesh.index_decode_cached_tokens": decode_blocks * page_size,
                "kvmesh.pull.peer": attempt.pull[0],
                "kvmesh.pull.index_tokens": attempt.pull[1] * page_size,
                "kvmesh.routing_policy": self.pool.router.policy,
                **predicted,
            },
        )
        logger.debug(
            "[%s] %d prompt tokens -> prefill %s (index: %d cached), decode %s",
            self.request_id,
            self.num_prompt_tokens,
            prefill.address,
            cached_hint,
            decode.address,
        )

    async def _may_try_again(self, failure: RequestFailed) -> bool:
        """Whether to try again after `failure` (no token reached the client yet): after a short
        wait when decode had no room, within the queue's time bound; on other instances, once,
        when a retry can fix the cause."""
        loop = asyncio.get_running_loop()
        if failure.wait_for_room and loop.time() < self._give_up_at:
            # decode had no pages after all (or another gateway filled it): answers end
            # every step, so try again shortly, within the queue's time bound
            self.waited_for_room = True
            await asyncio.sleep(min(ROOM_RETRY_S, self._give_up_at - loop.time()))
            return True
        if failure.cause.retryable and failure.instance is not None and self.retries == 0:
            self.retries += 1
            self.excluded |= {failure.instance.address}
            logger.warning("%s; retrying on another instance", failure)
            return True
        return False
