"""The gateway's one request path: authenticate, validate, admit, route, reserve on decode,
prefill, stream tokens back, clean up. The gRPC servicer (gateway/servicer.py) and the
OpenAI-compatible HTTP front (gateway/http_api.py) are thin adapters over `RequestPath`.

Per request: check the caller's API key; tokenize; wait for a turn in the admission queue
(a burst beyond the decode pools queues, bounded, and each key within its own bounds); pick
a decode instance (least active) and a transfer id; hash the prompt's blocks (once), ask the
prefix index and pick a prefill instance (cached prefix vs load); send Prefill (which pushes
the KV into decode's reserved pages under that id and returns the first token, sent on at
once) and, right behind it, Reserve: neither waits for the other's round trip (decode's
receiver holds a push that beats its Reserve, briefly). Until decode's KV address is known
(its stats poll reports it), Reserve goes first instead and Prefill waits for its answer.
Then stream Decode.Generate back to the client with incremental detokenization and stop
strings.
Each attempt is one gateway.request_life.RequestLife that ends exactly once. An attempt
that fails on one instance before any token reached the client is retried once on
another; every failure reaches the adapter as a RequestFailed whose cause fixes the
client's status (runtime.wire.status_of; the HTTP front maps that status on to HTTP's).
A caller that stops reading (a gRPC cancel, an HTTP client gone) closes or cancels the
generator, which aborts the attempt on both legs.

Every hop is bounded: Reserve by rpc_timeout_s, Prefill by a deadline that grows with the
tokens queued on the prefill instances (set as Reserve goes out, the reservation's KV
deadline rpc_timeout_s after it), each decode message by token_timeout_s (past the KV
deadline for the first), and every channel pings its peer (a frozen instance's calls end
within seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.outcomes import FailureCause, FinishReason
from engine.request import finish_reason
from gateway import metrics
from gateway.admission import AdmissionQueue, OverloadedError
from gateway.auth import ApiKeys
from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.pool import InstancePool, MismatchError
from gateway.request_life import RequestFailed, RequestLife, failure_from_rpc
from gateway.requests import GenerateInput, PromptBuilder, UnknownModelError
from kvstore.block_hash import hash_blocks
from protos.kvmesh.v1 import common_pb2, decode_pb2, gateway_pb2, prefill_pb2
from runtime import tracing
from runtime.logs import request_context
from runtime.wire import FINISH_FROM_PB, FINISH_TO_PB, check_request_id, status_of

logger = logging.getLogger(__name__)


def _sampling_pb(inp: GenerateInput) -> common_pb2.SamplingParams:
    s = inp.sampling
    return common_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=inp.max_tokens,
        seed=inp.seed,
        ignore_eos=inp.ignore_eos,
    )


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
    size = len(request.prompt)
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
    ) -> None:
        self.builder = builder
        self.pool = pool
        self.admission = admission
        self.eos_token_ids = eos_token_ids
        self.rpc_timeout_s = rpc_timeout_s
        self.prefill_timeout_base_s = prefill_timeout_base_s
        self.prefill_min_tokens_per_s = prefill_min_tokens_per_s
        self.token_timeout_s = token_timeout_s
        self.keys = keys or ApiKeys(())

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
        return gateway_pb2.ListModelsResponse(
            models=[self.builder.model_name],
            max_context_tokens=self.builder.max_context,
            max_tokens_limit=self.builder.max_tokens_limit,
            has_chat_template=bool(self.builder.tokenizer.chat_template),
        )

    def _to_internal(self, request: gateway_pb2.GenerateRequest) -> GenerateInput:
        b = self.builder
        check_request_id(request.request_id)
        b.check_model(request.model)
        s = request.sampling
        ids = b.tokenize(
            request.prompt, [(m.role, m.content) for m in request.messages], request.chat, request.prompt_token_ids
        )
        return b.build(
            request.request_id or uuid.uuid4().hex,
            ids,
            s.temperature,
            s.top_p if s.HasField("top_p") else None,
            s.top_k,
            s.max_tokens if s.HasField("max_tokens") else None,
            s.seed if s.HasField("seed") else None,
            list(s.stop),
            s.ignore_eos,
        )

    async def generate(
        self,
        request: gateway_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        authorization: str | None = None,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Run one request: yield its text deltas as they are decoded, then one `final`.

        One trace per request (continuing a `traceparent` in `metadata`: gRPC metadata or HTTP
        headers), its metrics and its log lines. Raises RequestFailed, before or during the
        stream, with the cause that fixes the caller's status: UNAUTHENTICATED (key),
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
            async with contextlib.aclosing(self._generate(request, key, span, arrived)) as messages:
                async for msg in messages:
                    if msg.HasField("final"):
                        # counted as it goes out: a caller may stop reading once it has it
                        self._record_finish(span, msg.final)
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

    @staticmethod
    def _record_finish(span, f: gateway_pb2.Final) -> None:
        """A whole answer's span attributes, metrics and log line."""
        span.set_attributes(
            {
                "kvmesh.finish_reason": f.finish_reason,
                "kvmesh.prompt_tokens": f.prompt_tokens,
                "kvmesh.cached_tokens": f.cached_tokens,
                "kvmesh.generated_tokens": f.generated_tokens,
                "kvmesh.ttft_s": f.ttft_s,
                "kvmesh.retries": f.retries,
                "kvmesh.drafted_tokens": f.drafted_tokens,
                "kvmesh.accepted_tokens": f.accepted_tokens,
            }
        )
        metrics.REQUESTS.labels(f.finish_reason, "OK").inc()
        metrics.TTFT.observe(f.ttft_s)
        metrics.E2E.observe(f.e2e_s)
        if f.generated_tokens > 1:
            metrics.ITL.observe(f.itl_s)
        logger.info(
            "request finished: %s, %d prompt (%d cached) + %d generated tokens, TTFT %.3f s, e2e %.3f s, "
            "prefill %s, decode %s",
            f.finish_reason,
            f.prompt_tokens,
            f.cached_tokens,
            f.generated_tokens,
            f.ttft_s,
            f.e2e_s,
            f.prefill_instance,
            f.decode_instance,
        )

    async def _generate(self, request: gateway_pb2.GenerateRequest, key: str, span, arrived: float):
        t0 = tracing.now_ns()
        try:
            if _tokenize_inline(request):
                inp = self._to_internal(request)
            else:
                inp = await asyncio.to_thread(self._to_internal, request)
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
        t0 = tracing.now_ns()
        n_prompt = len(inp.prompt_token_ids)
        try:
            waited = await self.admission.admit(n_prompt, key)
        except OverloadedError as exc:
            raise RequestFailed(FailureCause.OVERLOADED, f"[{rid}] {exc}", retry_after_s=exc.retry_after_s) from None
        unprefilled = [n_prompt]  # the key's prompt tokens still waiting for prefill

        def on_prefilled() -> None:
            self.admission.prefilled(key, unprefilled[0])
            unprefilled[0] = 0

        try:
            if waited:
                tracing.record(span, "gateway.admission", t0, tracing.now_ns())
            async for msg in self._attempts(inp, span, arrived, waited, on_prefilled):
                yield msg
        except RequestFailed as failure:
            logger.warning("%s (%s)", failure, failure.cause.value)
            raise
        finally:
            self.admission.done(key, unprefilled[0])

    async def _attempts(
        self,
        inp: GenerateInput,
        span,
        arrived: float,
        waited: float,
        on_prefilled: Callable[[], None] | None = None,
    ):
        """Route and run the request; retry once on other instances while no token was sent."""
        rid = inp.request_id
        excluded: set[str] = set()
        retries = 0
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.admission.max_queue_time_s
        hashes: Sequence[bytes] | None = None
        while True:
            life: RequestLife | None = None
            streamed: list[int] = []  # token ids sent to the client so far
            try:
                t0 = tracing.now_ns()
                exclude = frozenset(excluded)
                try:
                    decode = self.pool.pick_decode(exclude)
                except LookupError as exc:
                    raise RequestFailed(FailureCause.NO_INSTANCE, f"[{rid}] {exc}") from None
                life = RequestLife(self.pool, rid, None, decode)
                n_prompt = len(inp.prompt_token_ids)
                # bounds the prefill before it is chosen: the longest queue it can meet
                prefill_by = loop.time() + self._prefill_deadline_s(
                    self.pool.max_queued_prefill_tokens(exclude) + n_prompt
                )
                transfer_id = random.getrandbits(63) or 1
                kv_address = decode.kv_address  # as decode's stats last said; its Reserve confirms it
                reserve_call = None
                if not kv_address:
                    # Prefill needs Reserve's answer (where to push): Reserve goes first, and its
                    # round trip covers hashing the prompt, the index lookup and the prefill choice
                    reserve_call = self._reserve(
                        life, inp, span, prefill_by - loop.time() + self.rpc_timeout_s, transfer_id
                    )
                    await asyncio.sleep(0)  # let the call go out before the CPU work below
                if hashes is None:
                    # the prompt's block hashes, once per request: the index lookup, routing and
                    # prefill's cache read them
                    hashes = hash_blocks(inp.prompt_token_ids, self.pool.page_size)
                cached_blocks = await self.pool.lookup_prefix(hashes)
                try:
                    prefill, cached_hint = self.pool.pick_prefill(n_prompt, cached_blocks, hashes, exclude)
                except LookupError as exc:
                    raise RequestFailed(FailureCause.NO_INSTANCE, f"[{rid}] {exc}") from None
                # the prefill tokens this request adds to the instance's queue
                life.route_prefill(prefill, n_prompt - cached_hint)
                tracing.record(
                    span,
                    "gateway.route",
                    t0,
                    tracing.now_ns(),
                    {
                        "kvmesh.prefill.instance": prefill.instance_id or prefill.address,
                        "kvmesh.decode.instance": decode.instance_id or decode.address,
                        "kvmesh.index_cached_tokens": cached_hint,
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
                early = None
                if reserve_call is None:
                    # Prefill is TTFT's path: it leaves first, and Reserve right behind it (decode's
                    # receiver holds a push that beats its Reserve); neither waits for the other
                    early = (
                        kv_address,
                        transfer_id,
                        self._prefill(prefill, inp, hashes, kv_address, transfer_id, prefill_by, span),
                    )
                    reserve_call = self._reserve(
                        life, inp, span, prefill_by - loop.time() + self.rpc_timeout_s, transfer_id
                    )
                async for msg in self._run(
                    life,
                    reserve_call,
                    early,
                    prefill_by,
                    inp,
                    hashes,
                    span,
                    arrived,
                    waited,
                    retries,
                    streamed,
                    on_prefilled,
                ):
                    yield msg
                return
            except RequestFailed as failure:
                if life is not None:
                    life.abort(failure)
                if streamed:
                    raise
                if failure.wait_for_room and loop.time() < give_up_at:
                    # decode had no pages after all (or another gateway filled it): answers end
                    # every step, so try again shortly, within the queue's time bound
                    await asyncio.sleep(min(0.5, give_up_at - loop.time()))
                    continue
                if failure.cause.retryable and failure.instance is not None and retries == 0:
                    retries += 1
                    excluded.add(failure.instance.address)
                    logger.warning("%s; retrying on another instance", failure)
                    continue
                raise
            except BaseException:
                if life is not None:
                    life.abort(None)  # the client went away (or a bug): release both legs
                raise

    def _prefill_deadline_s(self, queued: int) -> float:
        """Base + `queued` prefill tokens (this prompt's included) at the floor rate, seconds."""
        return self.prefill_timeout_base_s + queued / self.prefill_min_tokens_per_s

    def _reserve(
        self, life: RequestLife, inp: GenerateInput, span, kv_deadline_s: float, transfer_id: int
    ) -> asyncio.Future:
        """Send Reserve to the attempt's decode instance for `transfer_id`, in the background
        (`life` releases a reservation that answers after the attempt ended); decode frees the
        pages itself when no Generate claims them within kv_deadline_s seconds."""
        call = self.pool.spawn(
            self.pool.decode_stub(life.decode).Reserve(
                decode_pb2.ReserveRequest(
                    request_id=inp.request_id,
                    num_prompt_tokens=len(inp.prompt_token_ids),
                    max_tokens=inp.max_tokens,
                    page_size=self.pool.page_size,
                    kv_deadline_s=kv_deadline_s,
                    transfer_id=transfer_id,
                ),
                timeout=self.rpc_timeout_s,
                metadata=tracing.inject(span),
            )
        )
        life.reserving(call)
        return call

    def _prefill(
        self,
        prefill,
        inp: GenerateInput,
        hashes: Sequence[bytes],
        kv_address: str,
        transfer_id: int,
        prefill_by: float,
        span,
    ) -> grpc.aio.UnaryUnaryCall:
        """Start the Prefill call (a grpc.aio call: it is on its way once made) that pushes the
        KV to `kv_address` under `transfer_id`; its deadline is `prefill_by` (loop time)."""
        return self.pool.prefill_stub(prefill).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=inp.request_id,
                token_ids=inp.prompt_token_ids,
                sampling=_sampling_pb(inp),
                decode_kv_address=kv_address,
                transfer_id=transfer_id,
                page_size=self.pool.page_size,
                block_hashes=hashes,  # hashed once, here: prefill reuses them
            ),
            timeout=prefill_by - asyncio.get_running_loop().time(),
            metadata=tracing.inject(span),
        )

    async def _run(
        self,
        life: RequestLife,
        reserve_call: asyncio.Future,
        early: tuple[str, int, grpc.aio.UnaryUnaryCall] | None,
        prefill_by: float,
        inp: GenerateInput,
        hashes: Sequence[bytes],
        span,
        arrived: float,
        waited: float,
        retries: int,
        streamed: list[int],
        on_prefilled: Callable[[], None] | None = None,
    ):
        rid, n_prompt = inp.request_id, len(inp.prompt_token_ids)
        prefill, decode = life.prefill, life.decode
        assert prefill is not None, rid
        call: grpc.aio.UnaryUnaryCall | None = early[2] if early is not None else None
        try:
            try:
                # shielded: a client that leaves now must not cut the call off mid-way, or decode
                # could reserve pages nobody releases; the life releases the late answer instead
                reserve = await asyncio.shield(reserve_call)
            except grpc.aio.AioRpcError as exc:
                failure = failure_from_rpc(exc, "decode", decode, decode, rid)
                # a full decode pool frees pages as answers end: wait for room (bounded)
                failure.wait_for_room = failure.cause == FailureCause.OVERLOADED
                raise failure from None
            life.reserved(reserve.transfer_id)
            decode.kv_address = reserve.kv_address
            if call is not None and early is not None and early[:2] != (reserve.kv_address, reserve.transfer_id):
                # decode moved its KV listener (restarted on the same gRPC address), or picked its
                # own transfer id (an older decode): push where and as it says
                logger.info(
                    "[%s] decode reserved transfer %x at %s; sending Prefill again",
                    rid,
                    reserve.transfer_id,
                    reserve.kv_address,
                )
                call.cancel()
                call = None
            if call is None:
                call = self._prefill(prefill, inp, hashes, reserve.kv_address, reserve.transfer_id, prefill_by, span)
        except BaseException:
            if call is not None:
                call.cancel()  # prefill drops the job and its pages
            raise
        try:
            pre = await call
        except grpc.aio.AioRpcError as exc:
            raise failure_from_rpc(exc, "prefill", prefill, decode, rid, slow_is_lost=False) from None
        life.prefilled()
        if on_prefilled is not None:
            on_prefilled()  # the prompt left the queue: the key's queued tokens drop
        detok = IncrementalDetokenizer(self.builder.tokenizer)
        stops = StopStringMatcher(list(inp.stop))
        first_at = time.perf_counter()
        finish = self._finish(inp, pre.first_token, 1)
        text, hit = stops.feed(detok.add([pre.first_token]), final=finish is not None)
        streamed.append(pre.first_token)
        # the first token comes with prefill's answer and goes out now: it never waits for decode
        yield gateway_pb2.GenerateResponse(delta=gateway_pb2.TextDelta(text=text, token_ids=[pre.first_token]))
        decode_digest = ""
        drafted = accepted = 0
        if hit:
            finish = FinishReason.STOP
        if finish is None:
            call = self.pool.decode_stub(decode).Generate(
                decode_pb2.DecodeRequest(
                    request_id=rid,
                    transfer_id=reserve.transfer_id,
                    prompt_token_ids=inp.prompt_token_ids,
                    first_token=pre.first_token,
                    sampling=_sampling_pb(inp),
                    kv_timeout_s=self.rpc_timeout_s,
                ),
                # decode's work continues the KV push, so its spans hang under prefill's
                metadata=[("traceparent", pre.traceparent)] if pre.traceparent else tracing.inject(span),
            )
            life.decoding(call)
            messages = call.__aiter__()
            # the first message waits for admission into decode's batch; then one step each
            bound = self.rpc_timeout_s + self.token_timeout_s
            while finish is None:
                try:
                    # a timeout scope, not wait_for: no task per token on the stream's hot path
                    async with asyncio.timeout(bound):
                        msg = await messages.__anext__()
                except TimeoutError:
                    raise RequestFailed(
                        FailureCause.INSTANCE_LOST,
                        f"[{rid}] decode {decode.instance_id or decode.address}: no token for {bound:.0f} s",
                        decode,
                    ) from None
                except StopAsyncIteration:
                    raise RequestFailed(
                        FailureCause.INTERNAL, f"[{rid}] decode stream ended without a finish reason"
                    ) from None
                except grpc.aio.AioRpcError as exc:
                    raise failure_from_rpc(exc, "decode", decode, decode, rid) from None
                bound = self.token_timeout_s
                decode_digest = decode_digest or msg.kv_digest
                drafted, accepted = max(drafted, msg.num_drafted), max(accepted, msg.num_accepted)
                streamed.extend(msg.token_ids)
                ended = FINISH_FROM_PB.get(msg.finish_reason)
                text, hit = stops.feed(detok.add(list(msg.token_ids)), final=ended is not None)
                if ended is not None and not hit:
                    text += stops.feed(detok.flush(), final=True)[0]
                if text or msg.token_ids:
                    yield gateway_pb2.GenerateResponse(
                        delta=gateway_pb2.TextDelta(text=text, token_ids=list(msg.token_ids))
                    )
                finish = FinishReason.STOP if hit else ended
        life.finish()
        done = time.perf_counter()
        n_gen = len(streamed)
        yield gateway_pb2.GenerateResponse(
            final=gateway_pb2.Final(
                finish_reason=finish.value,
                finish=FINISH_TO_PB[finish],
                prompt_tokens=n_prompt,
                cached_tokens=pre.num_cached_tokens,
                generated_tokens=n_gen,
                ttft_s=first_at - arrived,
                e2e_s=done - arrived,
                itl_s=(done - first_at) / (n_gen - 1) if n_gen > 1 else 0.0,
                prefill_instance=pre.instance_id,
                decode_instance=reserve.instance_id,
                request_id=rid,
                queue_s=pre.queue_s,
                prefill_s=pre.compute_s,
                retries=retries,
                admission_s=waited,
                drafted_tokens=drafted,
                accepted_tokens=accepted,
                kv_transfer=gateway_pb2.KVTransfer(
                    num_pages=pre.num_pages,
                    page_nbytes=pre.page_nbytes,
                    nbytes=pre.nbytes_sent,
                    seconds=pre.transfer_s,
                    exposed_seconds=pre.exposed_transfer_s,
                    prefill_digest=pre.kv_digest,
                    decode_digest=decode_digest,
                ),
            )
        )

    def _finish(self, inp: GenerateInput, token: int, num_generated: int) -> FinishReason | None:
        return finish_reason(token, num_generated, inp.max_tokens, () if inp.ignore_eos else self.eos_token_ids)
