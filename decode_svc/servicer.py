"""gRPC adapter for the decode engine: Reserve, Generate (stream), Release, GetStats.

A request's life on this side is one `kvmesh.engine.request.Request` in the engine's table (its pages,
its stream) with its landing and expiry kept by kvmesh.decode_svc.transfers.Transfers; this adapter
validates, maps errors to statuses (kvmesh.runtime.wire.abort with a FailureCause) and streams tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
from opentelemetry.trace import Status, StatusCode

from kvmesh.decode_svc.delivery import CapacityError, InstanceBroken, RequestReleased
from kvmesh.decode_svc.engine import DecodeEngine
from kvmesh.decode_svc.transfers import Transfers
from kvmesh.engine.grammar import GrammarState
from kvmesh.engine.outcomes import FailureCause, FinishReason
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kvstore.transport import KVPushReceiver, pages_digest
from kvmesh.protos.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from kvmesh.runtime import tracing
from kvmesh.runtime.served_model import ServedModel, grammar_state
from kvmesh.runtime.wire import (
    FINISH_TO_PB,
    abort,
    check_request_id,
    kv_layout_mismatch,
    logprobs_to_pb,
    page_size_mismatch,
    sampling_from_pb,
)

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Reservations live in the engine's table (landing and expiry: Transfers); pages are freed
    only once no push can still land in them."""

    def __init__(self, engine: DecodeEngine, receiver: KVPushReceiver, model: ServedModel) -> None:
        self.engine = engine
        self.receiver = receiver
        self.model = model
        self.transfers = Transfers(engine, receiver)
        self.draining = False

    async def drain(self, timeout_s: float) -> None:
        """Shutting down: refuse new reservations (UNAVAILABLE: the gateway reserves on another
        decode), then wait up to timeout_s seconds until every reservation made is claimed by its
        Generate or ended, so that no request whose first token prefill already sent finds the
        server closed."""
        self.draining = True
        left = await self.transfers.wait_claimed(timeout_s)
        if left:
            logger.warning("%d reservations still unclaimed after the drain grace", left)

    async def Reserve(self, request, context):
        with tracing.server_span("decode.reserve", context, request.request_id, self.model.instance_id) as span:
            response = await self._reserve(request, context)
            span.set_attributes(
                {
                    "kvmesh.kv.prompt_pages": response.num_pages,
                    "kvmesh.kv.decode_cached_pages": response.num_cached_pages,
                    "kvmesh.transfer_id": format(response.transfer_id, "x"),
                }
            )
            return response

    async def _reserve(self, request, context):
        if self.draining:
            await abort(
                context,
                FailureCause.INSTANCE_LOST,
                f"[{request.request_id}] decode {self.model.instance_id} is draining (shutting down): reserve elsewhere",
            )
        if self.engine.broken:
            await abort(
                context,
                FailureCause.INSTANCE_LOST,
                f"[{request.request_id}] decode {self.model.instance_id} cannot step ({self.engine.broken}): "
                "reserve elsewhere",
            )
        n, m, page_size = request.num_prompt_tokens, request.max_tokens, self.engine.config.page_size
        try:
            check_request_id(request.request_id)
        except ValueError as exc:
            await abort(context, FailureCause.BAD_REQUEST, str(exc))
        mismatch = page_size_mismatch(f"decode {self.model.instance_id}", page_size, request.page_size)
        mismatch = mismatch or kv_layout_mismatch(
            f"decode {self.model.instance_id}", self.engine.runner.page_layout.describe(), request.kv_layout
        )
        if mismatch:
            await abort(context, FailureCause.MISMATCH, f"[{request.request_id}] {mismatch}")
        try:
            if n + m > self.model.max_context:
                raise ValueError(
                    f"num_prompt_tokens ({n}) + max_tokens ({m}) exceeds the context of {self.model.max_context} tokens"
                )
            kv_deadline = request.kv_deadline_s or self.engine.config.reservation_timeout_s
            if not (math.isfinite(kv_deadline) and kv_deadline > 0):
                raise ValueError(f"kv_deadline_s must be a finite number > 0, got {request.kv_deadline_s}")
            t = self.transfers.reserve(
                request.request_id,
                n,
                m,
                min(kv_deadline, 24 * 3600.0),
                request.transfer_id,
                list(request.block_hashes),
                request.reuse_cached,
                request.n or 1,
            )
        except ValueError as exc:
            self._refuse(request.transfer_id)
            await abort(context, FailureCause.BAD_REQUEST, str(exc))
        except CapacityError as exc:
            self._refuse(request.transfer_id)
            await abort(context, FailureCause.OVERLOADED, str(exc), retry_after_s=1.0)
        return decode_pb2.ReserveResponse(
            kv_address=self.receiver.address,
            transfer_id=t.transfer_id,
            num_pages=t.num_prompt_pages,
            page_nbytes=self.engine.runner.page_nbytes,
            instance_id=self.model.instance_id,
            num_cached_pages=t.num_reused_pages,
        )

    def _refuse(self, transfer_id: int) -> None:
        """A Reserve that named its transfer id was refused: a push for that id (the caller may
        have sent Prefill already) is refused at once instead of waiting for a reservation.
        An id already open here belongs to another request and is left alone."""
        if transfer_id and not self.transfers.is_open(transfer_id):
            self.receiver.refuse(transfer_id)

    async def Release(self, request, context):
        return decode_pb2.ReleaseResponse(released=self.transfers.release(request.transfer_id, "Release"))

    def _check(self, request) -> SamplingParams:
        """Sampling settings of a Generate call (an unset seed is 0); ValueError says what is wrong."""
        for token in [request.first_token, *request.choice_first_tokens]:
            if not 0 <= token < self.model.vocab_size:
                raise ValueError(f"first tokens must be in [0, {self.model.vocab_size}), got {token}")
        if not (math.isfinite(request.kv_timeout_s) and request.kv_timeout_s >= 0):
            raise ValueError(f"kv_timeout_s must be a finite number >= 0, got {request.kv_timeout_s}")
        return sampling_from_pb(request.sampling, default_seed=0)  # checks the seed's range too

    async def Generate(self, request, context):
        """The request's decode span continues the caller's trace (prefill's KV push)."""
        with tracing.server_span("decode.generate", context, request.request_id, self.model.instance_id) as span:
            async for msg in self._generate(request, context, span):
                yield msg

    async def _generate(self, request, context, span):
        rid, tid = request.request_id, request.transfer_id
        started_ns = tracing.now_ns()
        try:
            check_request_id(rid)
        except ValueError as exc:
            await abort(context, FailureCause.BAD_REQUEST, str(exc))
        try:
            t = self.transfers.claim(tid)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"[{rid}] {exc}")
        queue: asyncio.Queue = asyncio.Queue()
        try:
            try:
                sampling = self._check(request)
            except ValueError as exc:  # the reservation is released below: a bad call holds no page
                await abort(context, FailureCause.BAD_REQUEST, f"[{rid}] {exc}")
            loop = asyncio.get_running_loop()
            timeout = max(0.0, t.deadline - loop.time())
            if request.kv_timeout_s:
                timeout = min(timeout, request.kv_timeout_s)
            try:
                landed = await asyncio.wait_for(asyncio.shield(t.landed), timeout=timeout)
            except TimeoutError:
                await abort(context, FailureCause.DEADLINE, f"[{rid}] KV push did not land within {timeout:.1f} s")
            except asyncio.CancelledError:
                if t.landed.cancelled():  # released while waiting, not a cancelled call
                    await abort(context, FailureCause.CANCELLED, f"[{rid}] reservation released")
                raise
            except Exception as exc:  # the push failed on the receiving side
                await abort(context, FailureCause.KV_PUSH_FAILED, f"[{rid}] KV push failed: {exc}")
            landed_ns = tracing.now_ns()
            tracing.record(
                span,
                "decode.kv_receive",
                started_ns,
                landed_ns,
                {"kvmesh.kv.buffers": landed.num_buffers, "kvmesh.kv.bytes": landed.nbytes},
            )
            digest = (
                pages_digest(self.engine.transfer_buffers(tid, landing=False)) if self.engine.config.kv_digest else ""
            )
            stop_ids = frozenset() if request.ignore_eos else self.model.eos_token_ids
            first_tokens = list(request.choice_first_tokens) or [request.first_token]
            try:
                grammars = None
                if sampling.grammar is not None:  # each choice's matcher, past its first token
                    grammars = await asyncio.to_thread(_choice_grammars, self.model, sampling.grammar, first_tokens)
                self.engine.begin_choices(
                    tid,
                    list(request.prompt_token_ids),
                    first_tokens,
                    sampling,
                    stop_ids,
                    [_emit_to(queue, i) for i in range(len(first_tokens))],
                    grammars,
                )  # runs on this loop
            except ValueError as exc:
                await abort(context, FailureCause.BAD_REQUEST, f"[{rid}] {exc}")
            except KeyError:  # released in the moment between landing and here
                await abort(context, FailureCause.CANCELLED, f"[{rid}] reservation released")
            first = True
            generated = 0
            open_choices = len(first_tokens)
            held = None  # a message taken from the queue for another choice: the next one out
            while True:
                index, tokens, end, logprobs = held or await queue.get()
                held = None
                # steps that went out while this stream waited for the loop go in one message a
                # choice: a loaded loop sends fewer, larger messages instead of falling behind
                while end is None and not queue.empty():
                    more = queue.get_nowait()
                    if more[0] != index:
                        held = more
                        break
                    _, more_tokens, end, more_logprobs = more
                    tokens = tokens + more_tokens
                    if logprobs is not None and more_logprobs is not None:
                        logprobs = logprobs + more_logprobs
                if first:  # waiting for admission into the running batch, then the first step
                    tracing.record(span, "decode.admission", landed_ns, tracing.now_ns())
                    span.add_event("first_token")
                generated += len(tokens)
                if isinstance(end, RequestReleased):
                    await abort(context, FailureCause.CANCELLED, str(end))
                if isinstance(end, InstanceBroken):
                    await abort(context, FailureCause.INSTANCE_LOST, f"[{rid}] {end}")
                if isinstance(end, Exception):
                    await abort(context, FailureCause.INTERNAL, f"[{rid}] {end}")
                msg = decode_pb2.DecodeResponse(token_ids=tokens, index=index)
                if logprobs:
                    msg.logprobs.extend(logprobs_to_pb(lp) for lp in logprobs)
                if end is not None:
                    choice = (t.choices or [t])[index]
                    msg.finish_reason = FINISH_TO_PB[FinishReason(end)]
                    msg.num_drafted, msg.num_accepted = choice.num_drafted, choice.num_accepted
                    open_choices -= 1
                if first:
                    msg.kv_digest = digest
                    first = False
                if end is not None and not open_choices:
                    # per-step work summarized on the request's span, not a span per token; set
                    # before the last message goes out: the gateway cancels the call once it has
                    # it, and on a busy machine that cancel closes this generator at its yield
                    span.set_attributes(
                        {
                            "kvmesh.finish_reason": str(end),
                            "kvmesh.decode.generated_tokens": generated,
                            "kvmesh.prompt_tokens": len(request.prompt_token_ids),
                            "kvmesh.decode.seconds": (tracing.now_ns() - landed_ns) / 1e9,
                            "kvmesh.decode.drafted_tokens": t.num_drafted,
                            "kvmesh.decode.accepted_tokens": t.num_accepted,
                        }
                    )
                    # final (OK is never overwritten): that cancel is no error of this request
                    span.set_status(Status(StatusCode.OK))
                    logger.info("[%s] decode finished: %s after %d tokens", rid, end, generated)
                yield msg
                if end is not None and not open_choices:
                    return
        finally:
            # finished: the engine freed the pages already and this only forgets the transfer;
            # otherwise (cancelled, failed) the pages come back here, exactly once
            self.transfers.release(tid, "Generate ended")

    async def GetStats(self, request, context):
        if self.engine.broken:  # gateways stop routing here, as to an instance that does not answer
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode cannot step any more: {self.engine.broken}")
        stats = self.engine.stats()
        return common_pb2.InstanceStats(
            instance_id=self.model.instance_id,
            page_size=self.engine.config.page_size,
            model_fingerprint=self.model.fingerprint,
            max_requests=self.engine.config.max_batch_size,
            kv_address=self.receiver.address,
            kv_layout=self.engine.runner.page_layout.describe(),
            num_kv_pushes_sent=self.receiver.num_sent,
            num_kv_pushes_pulled=self.receiver.num_pulled,
            **stats,
        )


def _emit_to(queue: asyncio.Queue, index: int):
    """Choice `index`'s EmitFn: its (tokens, ending, logprobs) onto the Generate call's queue."""
    return lambda toks, end, lps: queue.put_nowait((index, toks, end, lps))


def _choice_grammars(model: ServedModel, spec, first_tokens: list[int]) -> list:
    """Each choice's kvmesh.engine.grammar.GrammarState, past its first token (prefill sampled it under
    the same grammar). Raises ValueError when the grammar does not compile or refuses a first
    token."""
    first = grammar_state(model, spec)  # compiled and checked once; a matcher a choice
    states: list[GrammarState] = []
    for token in first_tokens:
        state = first if not states else GrammarState(first.grammars, first.grammars.matcher(spec))
        if not state.accept([token]):
            raise ValueError(f"grammar: the first token {token} is outside the grammar")
        states.append(state)
    return states
