"""One Generate RPC on a decode instance, as one object whose methods are its steps.

    call = GenerateCall(parts, request, context, span)
    async for message in call.run():
        claim()          the request id (BAD_REQUEST) and the reservation, CLAIMED (NOT_FOUND)
        check()          first tokens, kv_timeout_s and sampling (BAD_REQUEST)
        receive_kv()     wait until the KV push landed, within the reservation's deadline
        admit()          each choice's grammar, then engine.begin_choices: into the batch's queue
        next_message()   a step's tokens (or several, when the stream fell behind), one choice
        _finish()        the last choice ended: the request's figures on its span
    (whatever ended it: release the transfer, exactly once)

Each step ends the RPC with the status its failure maps to (kvmesh.runtime.wire.abort). The
engine thread hands the stream's tokens to the event loop (kvmesh.decode_svc.delivery); they wait
on the call's queue, one (choice, tokens, ending, logprobs) entry a step.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator

import grpc
from opentelemetry.trace import Status, StatusCode

from kvmesh.decode_svc.delivery import InstanceBroken, RequestReleased
from kvmesh.decode_svc.parts import DecodeParts
from kvmesh.engine.grammar import GrammarState
from kvmesh.engine.outcomes import FailureCause, FinishReason
from kvmesh.engine.request import EmitFn, Ending, Request
from kvmesh.engine.sampling_params import SamplingParams, TokenLogprobs
from kvmesh.kvstore.transport import pages_digest
from kvmesh.protos.v1 import decode_pb2
from kvmesh.runtime import tracing
from kvmesh.runtime.served_model import ServedModel, grammar_state
from kvmesh.runtime.wire import FINISH_TO_PB, abort, check_request_id, logprobs_to_pb, sampling_from_pb

logger = logging.getLogger(__name__)

Emitted = tuple[int, list[int], Ending, list[TokenLogprobs] | None]
"""What one engine step hands one choice's stream: (choice index, token ids, ending, their logprobs)."""


class GenerateCall:
    """One Generate RPC: `run` takes it through its steps (the module docstring) and yields its
    DecodeResponse messages, or ends the RPC with the status of what failed."""

    def __init__(self, parts: DecodeParts, request: decode_pb2.DecodeRequest, context, span) -> None:
        """request: the DecodeRequest; context: its grpc.aio context; span: the RPC's server span
        (kvmesh.runtime.tracing.server_span), parent of the steps' spans."""
        self.parts, self.engine = parts, parts.engine
        self.request, self.context, self.span = request, context, span
        self.rid, self.tid = request.request_id, request.transfer_id
        self.first_tokens = list(request.choice_first_tokens) or [request.first_token]
        self._queue: asyncio.Queue[Emitted] = asyncio.Queue()
        self._held: Emitted | None = None  # taken from the queue for another choice: the next one out
        self._started_ns = self._landed_ns = 0
        self._digest = ""  # of the landed pages, on the first message (config.kv_digest)
        self._num_open = len(self.first_tokens)  # choices not ended yet
        self._num_sent = 0  # messages made (the first carries the digest)
        self._generated = 0  # tokens sent, every choice's

    async def run(self) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        """The steps, in the order they run; one message a call of next_message until every
        choice ended."""
        self._started_ns = tracing.now_ns()
        reserved = await self.claim()
        try:
            sampling = await self.check()  # a bad call holds no page: the finally releases it
            await self.receive_kv(reserved)
            await self.admit(sampling)
            while self._num_open:
                yield await self.next_message(reserved)
        finally:
            # finished: the engine freed the pages already and this only forgets the transfer;
            # otherwise (cancelled, failed) the pages come back here, exactly once
            self.parts.transfers.release(self.tid, "Generate ended")

    async def claim(self) -> Request:
        """Check the request id (BAD_REQUEST) and attach this call to its reservation: CLAIMED,
        no longer expiring (NOT_FOUND when no reservation is open for the transfer). Returns the
        reserved request (choice 0 of its choices)."""
        try:
            check_request_id(self.rid)
        except ValueError as exc:
            await abort(self.context, FailureCause.BAD_REQUEST, str(exc))
        try:
            reserved = self.parts.transfers.claim(self.tid)
        except LookupError as exc:
            await self.context.abort(grpc.StatusCode.NOT_FOUND, f"[{self.rid}] {exc}")
        return reserved

    async def check(self) -> SamplingParams:
        """The call's sampling settings (an unset seed is 0), its first tokens in the vocabulary
        and kv_timeout_s a finite number >= 0; BAD_REQUEST says what is wrong."""
        request, vocab_size = self.request, self.parts.model.vocab_size
        try:
            for token in [request.first_token, *request.choice_first_tokens]:
                if not 0 <= token < vocab_size:
                    raise ValueError(f"first tokens must be in [0, {vocab_size}), got {token}")
            if not (math.isfinite(request.kv_timeout_s) and request.kv_timeout_s >= 0):
                raise ValueError(f"kv_timeout_s must be a finite number >= 0, got {request.kv_timeout_s}")
            sampling = sampling_from_pb(request.sampling, default_seed=0)  # checks the seed's range too
        except ValueError as exc:
            await abort(self.context, FailureCause.BAD_REQUEST, f"[{self.rid}] {exc}")
        return sampling

    async def receive_kv(self, reserved: Request) -> None:
        """Wait until the KV push landed in the reserved pages, until the reservation's deadline
        (and at most kv_timeout_s when set): DEADLINE past it, CANCELLED when the reservation
        was released meanwhile, KV_PUSH_FAILED when the push failed on the receiving side. The
        wait is the request's decode.kv_receive span."""
        assert reserved.landed is not None, f"[{self.rid}] Transfers.reserve expects the push"
        timeout = max(0.0, reserved.deadline - asyncio.get_running_loop().time())
        if self.request.kv_timeout_s:
            timeout = min(timeout, self.request.kv_timeout_s)
        try:
            landed = await asyncio.wait_for(asyncio.shield(reserved.landed), timeout=timeout)
        except TimeoutError:
            await abort(
                self.context, FailureCause.DEADLINE, f"[{self.rid}] KV push did not land within {timeout:.1f} s"
            )
        except asyncio.CancelledError:
            if reserved.landed.cancelled():  # released while waiting, not a cancelled call
                await abort(self.context, FailureCause.CANCELLED, f"[{self.rid}] reservation released")
            raise
        except Exception as exc:  # the push failed on the receiving side
            await abort(self.context, FailureCause.KV_PUSH_FAILED, f"[{self.rid}] KV push failed: {exc}")
        self._landed_ns = tracing.now_ns()
        tracing.record(
            self.span,
            "decode.kv_receive",
            self._started_ns,
            self._landed_ns,
            {"kvmesh.kv.buffers": landed.num_buffers, "kvmesh.kv.bytes": landed.nbytes},
        )
        if self.engine.config.kv_digest:
            buffers = self.engine.transfer_buffers(self.tid, landing=False)
            self._digest = pages_digest(buffers, self.engine.runner.page_layout.describe())

    async def admit(self, sampling: SamplingParams) -> None:
        """Queue every choice for the engine's batch (DecodeEngine.begin_choices), each past its
        first token, its grammar compiled first (off the event loop). BAD_REQUEST for a grammar
        that does not compile or refuses a first token, or a prompt not the reserved length;
        CANCELLED when the reservation was released in the moment between landing and here."""
        model = self.parts.model
        stop_ids = frozenset() if self.request.ignore_eos else model.eos_token_ids
        try:
            grammars = None
            if sampling.grammar is not None:  # each choice's matcher, past its first token
                grammars = await asyncio.to_thread(_choice_grammars, model, sampling.grammar, self.first_tokens)
            self.engine.begin_choices(
                self.tid,
                list(self.request.prompt_token_ids),
                self.first_tokens,
                sampling,
                stop_ids,
                [_emit_to(self._queue, i) for i in range(len(self.first_tokens))],
                grammars,
            )  # runs on this loop
        except ValueError as exc:
            await abort(self.context, FailureCause.BAD_REQUEST, f"[{self.rid}] {exc}")
        except KeyError:  # released in the moment between landing and here
            await abort(self.context, FailureCause.CANCELLED, f"[{self.rid}] reservation released")

    async def next_message(self, reserved: Request) -> decode_pb2.DecodeResponse:
        """The next message of the stream: one choice's tokens (with their logprobs, and its
        finish reason and speculation figures once it ends); the first carries the KV digest.
        A step that failed ends the RPC: CANCELLED (released), INSTANCE_LOST (this instance
        cannot step any more) or INTERNAL."""
        index, tokens, end, logprobs = await self._take()
        if not self._num_sent:  # waiting for admission into the running batch, then the first step
            tracing.record(self.span, "decode.admission", self._landed_ns, tracing.now_ns())
            self.span.add_event("first_token")
        self._generated += len(tokens)
        await self._end_if_failed(end)
        msg = decode_pb2.DecodeResponse(token_ids=tokens, index=index)
        if logprobs:
            msg.logprobs.extend(logprobs_to_pb(lp) for lp in logprobs)
        if isinstance(end, FinishReason):  # any other ending ended the RPC above
            choice = (reserved.choices or [reserved])[index]
            msg.finish_reason = FINISH_TO_PB[end]
            msg.num_drafted, msg.num_accepted = choice.num_drafted, choice.num_accepted
            self._num_open -= 1
        if not self._num_sent:
            msg.kv_digest = self._digest
        self._num_sent += 1
        if isinstance(end, FinishReason) and not self._num_open:
            self._finish(end, reserved)
        return msg

    async def _take(self) -> Emitted:
        """One choice's next step from the queue, with the steps of the same choice queued right
        behind it: steps that went out while this stream waited for the loop go in one message a
        choice, so a loaded loop sends fewer, larger messages instead of falling behind."""
        index, tokens, end, logprobs = self._held or await self._queue.get()
        self._held = None
        while end is None and not self._queue.empty():
            more = self._queue.get_nowait()
            if more[0] != index:
                self._held = more
                break
            _, more_tokens, end, more_logprobs = more
            tokens = tokens + more_tokens
            if logprobs is not None and more_logprobs is not None:
                logprobs = logprobs + more_logprobs
        return index, tokens, end, logprobs

    async def _end_if_failed(self, end: Ending) -> None:
        """End the RPC when the choice's stream ended with an error rather than a finish reason."""
        if isinstance(end, RequestReleased):
            await abort(self.context, FailureCause.CANCELLED, str(end))
        if isinstance(end, InstanceBroken):
            await abort(self.context, FailureCause.INSTANCE_LOST, f"[{self.rid}] {end}")
        if isinstance(end, Exception):
            await abort(self.context, FailureCause.INTERNAL, f"[{self.rid}] {end}")

    def _finish(self, end: FinishReason, reserved: Request) -> None:
        """The last choice ended: per-step work summarized on the request's span, not a span per
        token. Set before the last message goes out: the gateway cancels the call once it has
        it, and on a busy machine that cancel closes this generator at its yield."""
        self.span.set_attributes(
            {
                "kvmesh.finish_reason": str(end),
                "kvmesh.decode.generated_tokens": self._generated,
                "kvmesh.prompt_tokens": len(self.request.prompt_token_ids),
                "kvmesh.decode.seconds": (tracing.now_ns() - self._landed_ns) / 1e9,
                "kvmesh.decode.drafted_tokens": reserved.num_drafted,
                "kvmesh.decode.accepted_tokens": reserved.num_accepted,
            }
        )
        # final (OK is never overwritten): that cancel is no error of this request
        self.span.set_status(Status(StatusCode.OK))
        logger.info("[%s] decode finished: %s after %d tokens", self.rid, end, self._generated)


def _emit_to(queue: asyncio.Queue[Emitted], index: int) -> EmitFn:
    """Choice `index`'s EmitFn: its (tokens, ending, logprobs) onto the Generate call's queue."""
    return lambda toks, end, lps: queue.put_nowait((index, toks, end, lps))


def _choice_grammars(model: ServedModel, spec, first_tokens: list[int]) -> list[GrammarState]:
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
