"""The gateway's one request path: authenticate, validate, admit, route, and the retry loop
over attempts. The gRPC servicer (gateway/servicer.py) and the OpenAI-compatible HTTP front
(gateway/http_api.py) are thin adapters over `RequestPath`.

Per request: check the caller's API key; tokenize; wait for a turn in the admission queue
(a burst beyond the decode pools queues, bounded, and each key within its own bounds); hash
the prompt's blocks (once, salted by the key's tenant) and ask the prefix index which
instances hold how much of them; pick a decode instance (least active, or near it the one
holding the most of the prompt) and open an attempt on it (gateway/attempt.py: it decides
the order of Reserve and Prefill and may send Reserve now); pick a prefill instance (cached
prefix vs load); send what the attempt has not sent yet, and stream its answer
(gateway/answer.py: incremental detokenization, stop strings, the Final message).
Each attempt ends exactly once. An attempt that fails on one instance before any token
reached the client is retried once on another; every failure reaches the adapter as a
RequestFailed whose cause fixes the client's status (kvmesh.runtime.wire.status_of; the HTTP front
maps that status on to HTTP's). A caller that stops reading (a gRPC cancel, an HTTP client
gone) closes or cancels the generator, which aborts the attempt on both legs.

Every hop is bounded: Reserve by rpc_timeout_s, Prefill by a deadline that grows with the
tokens queued on the prefill instances (set before the prefill instance is chosen, the
reservation's KV deadline rpc_timeout_s after it), each decode message by token_timeout_s
(past the KV deadline for the first), and every channel pings its peer (a frozen instance's
calls end within seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence

from opentelemetry.trace import SpanKind, Status, StatusCode

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway import metrics, wire
from kvmesh.gateway.admission import AdmissionQueue, OverloadedError
from kvmesh.gateway.answer import Answer, record_final
from kvmesh.gateway.attempt import Attempt, Hops
from kvmesh.gateway.auth import ApiKeys
from kvmesh.gateway.config import Deadlines
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.pool import InstancePool, MismatchError
from kvmesh.gateway.requests import GenerateInput, PromptBuilder, UnknownModelError
from kvmesh.gateway.sessions import SessionTable
from kvmesh.kvstore.block_hash import hash_blocks, tenant_root
from kvmesh.protos.v1 import gateway_pb2
from kvmesh.runtime import tracing
from kvmesh.runtime.logs import request_context
from kvmesh.runtime.wire import status_of

logger = logging.getLogger(__name__)


SESSION_HEADER = "x-session-id"
"""The header (HTTP) or metadata key (gRPC) that names a request's conversation."""

INLINE_PROMPT_BYTES = 1024
"""Prompts of at most this many bytes of text (prompt plus message contents) are tokenized on
the event loop: ~0.1 ms for 32 tokens (0.4 ms through the chat template), less than the hop
to a worker thread and back (~0.4 ms on a busy 2-core machine). Longer ones go to a thread
(a 2K-token text takes the tokenizer ~4 ms), so the loop serves other requests meanwhile."""
INLINE_PROMPT_TOKEN_IDS = 8192
"""prompt_token_ids of at most this many ids are checked on the event loop (~20 us for 2K)."""


def _tokenize_inline(request: gateway_pb2.GenerateRequest) -> bool:
    """Whether `request` is small enough to validate and tokenize on the event loop."""
    if len(request.prompt_token_ids) > INLINE_PROMPT_TOKEN_IDS:
        return False
    size = len(request.prompt) + len(request.tools)
    for m in request.messages:
        size += len(m.content)  # characters: the tokenizer's work grows with them as with bytes
        if size > INLINE_PROMPT_BYTES:
            return False
    return size <= INLINE_PROMPT_BYTES


class RequestPath:
    """The one place a request is checked, admitted, routed, run and cleaned up.

    Args:
        builder: validation and tokenization (PromptBuilder).
        pool: the instances, their stubs and the router.
        admission: the admission queue (total and per-key bounds).
        eos_token_ids: tokens that end an answer (unless ignore_eos).
        rpc_timeout_s: deadline of Reserve and Release (seconds).
        prefill_timeout_base_s, prefill_min_tokens_per_s: a Prefill call's deadline is
            base + (tokens queued on the instance, this prompt's included) / rate.
        token_timeout_s: longest wait for the next message of a decode stream.
        keys: the API keys callers must present (None or empty: the gateway is open).
        sessions: where each session's last turn went (kvmesh.gateway.sessions; None: no affinity).
    """

    def __init__(
        self,
        builder: PromptBuilder,
        pool: InstancePool,
        admission: AdmissionQueue,
        eos_token_ids: frozenset[int],
        rpc_timeout_s: float,
        prefill_timeout_base_s: float,
        prefill_min_tokens_per_s: float,
        token_timeout_s: float,
        keys: ApiKeys | None = None,
        sessions: SessionTable | None = None,
    ) -> None:
        self.builder = builder
        self.pool = pool
        self.admission = admission
        self.eos_token_ids = eos_token_ids
        self.deadlines = Deadlines(rpc_timeout_s, token_timeout_s, prefill_timeout_base_s, prefill_min_tokens_per_s)
        self.keys = keys or ApiKeys(())
        self.sessions = sessions or SessionTable(0)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key label ("" on an open gateway) from its `authorization` value
        ("Bearer <key>", from the HTTP header or the gRPC metadata of that name).

        Raises RequestFailed(UNAUTHENTICATED) when keys are set and none of them is given."""
        try:
            return self.keys.identify(authorization)
        except PermissionError as exc:
            raise RequestFailed(FailureCause.UNAUTHENTICATED, str(exc)) from None

    def models(self, authorization: str | None) -> gateway_pb2.ListModelsResponse:
        """What this gateway serves; raises RequestFailed(UNAUTHENTICATED) as `authenticate`."""
        self.authenticate(authorization)
        return wire.models_response(self.builder)

    async def generate(
        self,
        request: gateway_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        authorization: str | None = None,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Run one request: yield its text deltas as they are decoded, then one `final`.

        One trace per request (continuing a `traceparent` in `metadata`: gRPC metadata or HTTP
        headers), its metrics and its log lines. An `x-session-id` in `metadata` names the
        conversation (kvmesh.gateway.sessions: its next turn goes back to the instances of the last).
        Raises RequestFailed, before or during the stream, with the cause that fixes the
        caller's status: UNAUTHENTICATED (key),
        BAD_REQUEST / UNKNOWN_MODEL (input), OVERLOADED (a bound; `retry_after_s` set),
        NO_INSTANCE / INSTANCE_LOST / KV_PUSH_FAILED (retry later), MISMATCH, DEADLINE,
        INTERNAL. Closing or cancelling the generator aborts the request on both legs.
        """
        arrived = time.perf_counter()
        span = tracing.tracer().start_span("gateway.generate", kind=SpanKind.SERVER, context=tracing.extract(metadata))
        request_context.set(("", tracing.trace_id(span)))  # the id goes on log lines once it is checked
        finished = False
        try:
            key = self.authenticate(authorization)
            session = next((str(v) for k, v in metadata if k.lower() == SESSION_HEADER), "")
            async with contextlib.aclosing(self._generate(request, key, span, arrived, session)) as messages:
                async for msg in messages:
                    if msg.HasField("final"):
                        # counted as it goes out: a caller may stop reading once it has it
                        record_final(span, msg.final)
                        finished = True
                    yield msg
        except BaseException as exc:
            if finished and isinstance(exc, GeneratorExit | asyncio.CancelledError):
                raise  # the answer was whole; the caller stopped reading after it
            if isinstance(exc, RequestFailed):
                status = status_of(exc.cause).name
            elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
                status = "CANCELLED"  # the caller went away
            else:
                status = "UNKNOWN"
            span.set_status(Status(StatusCode.ERROR, status))
            metrics.REQUESTS.labels("error", status).inc()
            logger.info("request ended: %s", status)
            raise
        finally:
            span.end()

    async def _generate(self, request: gateway_pb2.GenerateRequest, key: str, span, arrived: float, session: str):
        t0 = tracing.now_ns()
        try:
            session_key = self.sessions.key(self.keys.tenant_of(key), session) if session else b""
            if _tokenize_inline(request):
                inp = wire.generate_input(self.builder, request)
            else:
                inp = await asyncio.to_thread(wire.generate_input, self.builder, request)
        except UnknownModelError as exc:
            raise RequestFailed(FailureCause.UNKNOWN_MODEL, str(exc)) from None
        except ValueError as exc:
            raise RequestFailed(FailureCause.BAD_REQUEST, str(exc)) from None
        rid = inp.request_id
        request_context.set((rid, tracing.trace_id(span)))
        span.set_attribute("kvmesh.request_id", rid)
        tracing.record(
            span, "gateway.tokenize", t0, tracing.now_ns(), {"kvmesh.prompt_tokens": len(inp.prompt_token_ids)}
        )
        try:
            self.pool.check_usable()
        except MismatchError as exc:
            raise RequestFailed(FailureCause.MISMATCH, f"[{rid}] {exc}") from None
        except LookupError as exc:
            raise RequestFailed(FailureCause.NO_INSTANCE, f"[{rid}] {exc}") from None
        largest = self.pool.max_decode_batch()
        if largest and inp.sampling.n > largest:  # refused before any leg runs: no decode could hold it
            raise RequestFailed(
                FailureCause.BAD_REQUEST,
                f"[{rid}] n is {inp.sampling.n}, more than the largest decode batch ({largest} sequences); "
                f"ask for at most {largest} choices",
                param="n",
            )
        t0 = tracing.now_ns()
        n_prompt = len(inp.prompt_token_ids)
        try:
            priority, weight = self.keys.class_of(key)
            waited = await self.admission.admit(n_prompt, key, priority, weight)
        except OverloadedError as exc:
            raise RequestFailed(FailureCause.OVERLOADED, f"[{rid}] {exc}", retry_after_s=exc.retry_after_s) from None
        unprefilled = n_prompt  # the key's prompt tokens still waiting for prefill
        try:
            if waited:
                tracing.record(span, "kvmesh.gateway.admission", t0, tracing.now_ns())
            # closed here, not whenever the garbage collector finds it: a caller that leaves
            # mid-answer must abort the attempt (and release its reservation) at once
            attempts = self._attempts(inp, span, arrived, waited, self.keys.tenant_of(key), session_key)
            async with contextlib.aclosing(attempts):
                async for msg in attempts:
                    if unprefilled:
                        # the first token came with prefill's answer: the prompt left the queue and
                        # the key's queued tokens drop
                        self.admission.prefilled(key, unprefilled)
                        unprefilled = 0
                    yield msg
        except RequestFailed as failure:
            logger.warning("%s (%s)", failure, failure.cause.value)
            raise
        finally:
            self.admission.done(key, unprefilled)

    async def _attempts(
        self, inp: GenerateInput, span, arrived: float, waited: float, tenant: str = "", session_key: bytes = b""
    ):
        """Route and run the request; retry once on other instances while no token was sent.
        Its block hashes chain from `tenant`'s root (the key's cache namespace; "" without keys);
        session_key (SessionTable.key; b"": none) adds the session's last turn to what the index
        says its instances hold, and remembers this turn's."""
        rid, n_prompt = inp.request_id, len(inp.prompt_token_ids)
        hops = Hops(inp, span, self.deadlines)
        excluded: set[str] = set()
        retries = 0
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.admission.max_queue_time_s
        hashes: Sequence[bytes] | None = None
        waited_for_room = False  # decode was full: Reserve goes first from then on (no Prefill wasted)
        while True:
            attempt: Attempt | None = None
            answer = Answer(self.builder.tokenizer, inp, self.eos_token_ids, arrived, waited, retries)
            try:
                t0 = tracing.now_ns()
                exclude = frozenset(excluded)
                if hashes is None:
                    # the prompt's block hashes, once per request: the index lookup, routing and
                    # both legs' caches read them
                    hashes = hash_blocks(inp.prompt_token_ids, self.pool.page_size, tenant_root(tenant))
                # one lookup for both roles: which prefill and which decode hold how much of it
                cached_blocks, tiered_blocks = await self.pool.lookup_prefix_tiered(hashes)
                if session_key:
                    cached_blocks, tiered_blocks = dict(cached_blocks), dict(tiered_blocks)
                    self.sessions.add_held(session_key, hashes, cached_blocks, tiered_blocks)
                try:
                    decode = self.pool.pick_decode(exclude, cached_blocks)
                except LookupError as exc:
                    raise RequestFailed(FailureCause.NO_INSTANCE, f"[{rid}] {exc}") from None
                attempt = Attempt(self.pool, rid, None, decode)
                # bounds the prefill before it is chosen: the longest queue it can meet
                prefill_by = loop.time() + self.deadlines.prefill_s(
                    self.pool.max_queued_prefill_tokens(exclude) + n_prompt
                )
                decode_blocks = self.pool.decode_reuse(decode, cached_blocks)
                # Reserve first (Prefill waits for it) when decode holds some of the prompt, when
                # a full decode was waited for, or for n choices (a larger reservation)
                reserve_first = decode_blocks > 0 or waited_for_room or inp.sampling.n > 1
                await attempt.open(hops, prefill_by, hashes, decode_hit=reserve_first)
                try:
                    prefill, cached_hint = self.pool.pick_prefill(
                        n_prompt, cached_blocks, hashes, exclude, tiered_blocks
                    )
                except LookupError as exc:
                    raise RequestFailed(FailureCause.NO_INSTANCE, f"[{rid}] {exc}") from None
                # a peer holding more of the prompt: prefill may pull from it instead of computing
                attempt.pull = self.pool.pull_source(prefill, cached_blocks, exclude)
                # the prefill tokens this request adds to the instance's queue
                attempt.route_prefill(prefill, n_prompt - cached_hint)
                if session_key:
                    self.sessions.remember(session_key, prefill.instance_id, decode.instance_id, hashes)
                tracing.record(
                    span,
                    "gateway.route",
                    t0,
                    tracing.now_ns(),
                    {
                        "kvmesh.prefill.instance": prefill.instance_id or prefill.address,
                        "kvmesh.decode.instance": decode.instance_id or decode.address,
                        "kvmesh.index_cached_tokens": cached_hint,
                        "kvmesh.index_decode_cached_tokens": decode_blocks * self.pool.page_size,
                        "kvmesh.pull.peer": attempt.pull[0],
                        "kvmesh.pull.index_tokens": attempt.pull[1] * self.pool.page_size,
                        "kvmesh.routing_policy": self.pool.router.policy,
                    },
                )
                logger.debug(
                    "[%s] %d prompt tokens -> prefill %s (index: %d cached), decode %s",
                    rid,
                    n_prompt,
                    prefill.address,
                    cached_hint,
                    decode.address,
                )
                attempt.send()
                async with contextlib.aclosing(attempt.stream(answer)) as messages:
                    async for msg in messages:
                        yield msg
                return
            except RequestFailed as failure:
                if attempt is not None:
                    attempt.abort(failure)
                if answer.token_ids:
                    raise
                if failure.wait_for_room and loop.time() < give_up_at:
                    # decode had no pages after all (or another gateway filled it): answers end
                    # every step, so try again shortly, within the queue's time bound
                    waited_for_room = True
                    await asyncio.sleep(min(0.5, give_up_at - loop.time()))
                    continue
                if failure.cause.retryable and failure.instance is not None and retries == 0:
                    retries += 1
                    excluded.add(failure.instance.address)
                    logger.warning("%s; retrying on another instance", failure)
                    continue
                raise
            except BaseException:
                if attempt is not None:
                    attempt.abort(None)  # the client went away (or a bug): release both legs
                raise
