"""The gateway's one request path: authenticate, validate, admit, route, and the retry loop
over attempts (the routing and the retries are gateway/tries.py's). The gRPC servicer
(gateway/servicer.py) and the OpenAI-compatible HTTP front (gateway/http/) are thin adapters
over `RequestPath`.

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
from kvmesh.gateway.answer import record_final
from kvmesh.gateway.attempt import Deadlines, Hops
from kvmesh.gateway.auth import ApiKeys
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.pool import InstancePool, MismatchError
from kvmesh.gateway.requests import GenerateInput, PromptBuilder, UnknownModelError
from kvmesh.gateway.sessions import SessionTable
from kvmesh.gateway.slo import NO_SLO, Slo, slo_of
from kvmesh.gateway.tries import GatewayParts, Tries
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
        slo: the latency targets of requests that set none (kvmesh.gateway.slo); slo_shed: refuse
            a request no instance is predicted to serve within its SLO (else queue it).
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
        slo: Slo = NO_SLO,
        slo_shed: bool = False,
    ) -> None:
        self.builder = builder
        self.pool = pool
        self.admission = admission
        self.eos_token_ids = eos_token_ids
        self.deadlines = Deadlines(rpc_timeout_s, token_timeout_s, prefill_timeout_base_s, prefill_min_tokens_per_s)
        self.keys = keys or ApiKeys(())
        self.sessions = sessions or SessionTable(0)
        self.slo = slo
        self.slo_shed = slo_shed

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
            try:
                slo = slo_of((request.slo_ttft_ms, request.slo_itl_ms), metadata, self._band_slo(key))
            except ValueError as exc:
                raise RequestFailed(FailureCause.BAD_REQUEST, str(exc)) from None
            async with contextlib.aclosing(self._generate(request, key, span, arrived, session, slo)) as messages:
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

    def _band_slo(self, key: str) -> Slo:
        """The SLO of a request of the key labelled `key` that sets none: its key's (the key file's
        slo_ttft_ms / slo_itl_ms), field by field, else the gateway's."""
        ttft_ms, itl_ms = self.keys.slo_ms_of(key)
        return Slo(ttft_ms / 1000 if ttft_ms else self.slo.ttft_s, itl_ms / 1000 if itl_ms else self.slo.itl_s)

    async def _generate(
        self, request: gateway_pb2.GenerateRequest, key: str, span, arrived: float, session: str, slo: Slo
    ):
        """The request's steps once its key is known: check and tokenize it, check the mesh can
        serve it, wait for its turn in the admission queue, then run its tries."""
        inp, session_key = await self._checked_input(request, key, span, session)
        self._check_servable(inp)
        t0 = tracing.now_ns()
        waited = await self._admit(inp, key)
        unprefilled = len(inp.prompt_token_ids)  # the key's prompt tokens still waiting for prefill
        try:
            if waited:
                tracing.record(span, "kvmesh.gateway.admission", t0, tracing.now_ns())
            # closed here, not whenever the garbage collector finds it: a caller that leaves
            # mid-answer must abort the attempt (and release its reservation) at once
            attempts = self._attempts(inp, span, arrived, waited, self.keys.tenant_of(key), session_key, slo)
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

    async def _checked_input(
        self, request: gateway_pb2.GenerateRequest, key: str, span, session: str
    ) -> tuple[GenerateInput, bytes]:
        """(the request checked and tokenized, its session's key: SessionTable.key, b"" without
        a session). Small requests are tokenized on the event loop, larger ones in a thread
        (_tokenize_inline); the request id goes on log lines and the span from here on.

        Raises RequestFailed: UNKNOWN_MODEL, or BAD_REQUEST for input a caller can fix."""
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
        return inp, session_key

    def _check_servable(self, inp: GenerateInput) -> None:
        """Refuse, before any leg runs, what no instance can serve. Raises RequestFailed: MISMATCH
        (every instance of a role disagrees with the gateway), NO_INSTANCE (none routable),
        BAD_REQUEST (more choices than the largest decode batch)."""
        rid = inp.request_id
        try:
            self.pool.check_usable()
        except MismatchError as exc:
            raise RequestFailed(FailureCause.MISMATCH, f"[{rid}] {exc}") from None
        except LookupError as exc:
            raise RequestFailed(FailureCause.NO_INSTANCE, f"[{rid}] {exc}") from None
        largest = self.pool.max_decode_batch()
        if largest and inp.sampling.n > largest:  # no decode could hold it
            raise RequestFailed(
                FailureCause.BAD_REQUEST,
                f"[{rid}] n is {inp.sampling.n}, more than the largest decode batch ({largest} sequences); "
                f"ask for at most {largest} choices",
                param="n",
            )

    async def _admit(self, inp: GenerateInput, key: str) -> float:
        """Wait for the request's turn in the admission queue, in its key's class; returns the
        seconds it waited. Raises RequestFailed(OVERLOADED, retry_after_s set) past a bound."""
        try:
            priority, weight = self.keys.class_of(key)
            return await self.admission.admit(len(inp.prompt_token_ids), key, priority, weight)
        except OverloadedError as exc:
            rid = inp.request_id
            raise RequestFailed(FailureCause.OVERLOADED, f"[{rid}] {exc}", retry_after_s=exc.retry_after_s) from None

    def _attempts(
        self,
        inp: GenerateInput,
        span,
        arrived: float,
        waited: float,
        tenant: str = "",
        session_key: bytes = b"",
        slo: Slo = NO_SLO,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Route and run the request; retry once on other instances while no token was sent
        (kvmesh.gateway.tries.Tries). Its block hashes chain from `tenant`'s root (the key's
        cache namespace; "" without keys); session_key (SessionTable.key; b"": none) adds the
        session's last turn to what the index says its instances hold, and remembers this turn's."""
        parts = GatewayParts(
            self.pool,
            self.sessions,
            self.builder.tokenizer,
            self.eos_token_ids,
            self.admission.max_queue_time_s,
            self.slo_shed,
        )
        return Tries(parts, Hops(inp, span, self.deadlines, slo), arrived, waited, tenant, session_key).run()
