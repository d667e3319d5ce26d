"""One attempt's answer as the client reads it: text deltas, then the Final message.

Tokens come from prefill (the first) and decode (the rest); each batch is detokenized
incrementally (never a split multi-byte character), cut before the first stop string, and
checked against the finish rule the engines apply (kvmesh.engine.request.finish_reason: EOS, then
max_tokens) for the first token, decode's own finish reason for the rest. The Final message
gathers the request's figures (TTFT, ITL, cached tokens, the KV push) for the client, its
span and the metrics.
"""

from __future__ import annotations

import logging
import time

from kvmesh.engine.outcomes import FailureCause, FinishReason
from kvmesh.engine.request import finish_reason
from kvmesh.gateway import metrics
from kvmesh.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.requests import GenerateInput
from kvmesh.protos.v1 import decode_pb2, gateway_pb2, prefill_pb2
from kvmesh.runtime.wire import FINISH_FROM_PB, FINISH_TO_PB

logger = logging.getLogger(__name__)


class _Choice:
    """One choice's text state: its detokenizer, stop strings, tokens and ending."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStringMatcher(stop)
        self.num_tokens = 0
        self.finish: FinishReason | None = None
        self.drafted = self.accepted = 0

    def feed(self, token_ids: list[int], ended: FinishReason | None) -> str:
        """Take the choice's new tokens (`ended`: the engines' finish rule ends it there): the
        text to send, cut before a stop string, which ends the choice too."""
        self.num_tokens += len(token_ids)
        text, hit = self.stops.feed(self.detok.add(token_ids), final=ended is not None)
        if ended is not None and not hit:
            text += self.stops.feed(self.detok.flush(), final=True)[0]
        self.finish = FinishReason.STOP if hit else ended
        return text


class Answer:
    """The text of one attempt and its ending, for each of its n choices (sampling.n).

    Args:
        tokenizer: the served model's tokenizer (its `decode`).
        request: the validated request (stop strings, max_tokens, ignore_eos, n).
        eos_token_ids: the ids that end an answer unless the request ignores EOS.
        arrived: when the request reached the gateway (time.perf_counter(), seconds).
        waited: seconds it waited in the admission queue.
        retries: attempts before this one (0 or 1).
    """

    def __init__(
        self,
        tokenizer,
        request: GenerateInput,
        eos_token_ids: frozenset[int],
        arrived: float,
        waited: float,
        retries: int,
    ) -> None:
        self.request = request
        self.arrived = arrived
        self.waited = waited
        self.retries = retries
        self.token_ids: list[int] = []
        """Token ids sent to the client so far, every choice's: once there is one, the attempt
        is not retried."""
        self.first_at = 0.0
        self._choices = [_Choice(tokenizer, list(request.stop)) for _ in range(request.sampling.n)]
        self._stop_token_ids = frozenset() if request.ignore_eos else eos_token_ids
        self._decode_digest = ""

    @property
    def finish(self) -> FinishReason | None:
        """Why the answer ended (choice 0's reason) once every choice ended; None while one goes on."""
        if any(c.finish is None for c in self._choices):
            return None
        return self._choices[0].finish

    def first(self, prefill: prefill_pb2.PrefillResponse) -> list[gateway_pb2.GenerateResponse]:
        """The deltas of each choice's first token (prefill's answer, with its logprobs when
        asked for): they go out at once, even empty. A choice whose first token already ends
        it (EOS, max_tokens 1, a stop string) is finished."""
        self.first_at = time.perf_counter()
        tokens = list(prefill.choice_first_tokens) or [prefill.first_token]
        logprobs = list(prefill.choice_first_logprobs) or (
            [prefill.first_logprobs] if prefill.HasField("first_logprobs") else []
        )
        if len(tokens) != len(self._choices):
            raise RequestFailed(
                FailureCause.INTERNAL,
                f"[{self.request.request_id}] prefill sampled {len(tokens)} first tokens for {len(self._choices)} choices",
            )
        deltas = []
        for i, (choice, token) in enumerate(zip(self._choices, tokens)):
            text = choice.feed([token], finish_reason(token, 1, self.request.max_tokens, self._stop_token_ids))
            self.token_ids.append(token)
            delta = _delta(text, [token], i)
            if logprobs:
                delta.delta.logprobs.append(logprobs[i])
            if i == 0:
                delta.delta.prompt_logprobs.extend(prefill.prompt_logprobs)
                delta.delta.prompt_tokens = len(self.request.prompt_token_ids)
                delta.delta.cached_tokens = prefill.num_cached_tokens
            deltas.append(delta)
        return deltas

    def add(self, msg: decode_pb2.DecodeResponse) -> gateway_pb2.GenerateResponse | None:
        """The delta of one decode message for its choice (msg.index; None when it carries
        neither text nor tokens, or when its choice has ended here already: a stop string ends
        a choice at the gateway while decode, which matches no text, goes on with it until the
        others end). Ends the choice on its last message or on a stop string; the text ends
        before the stop string. Raises RequestFailed (INTERNAL) for a choice that is not there."""
        if not self._decode_digest:
            self._decode_digest = msg.kv_digest
        if not 0 <= msg.index < len(self._choices):
            raise RequestFailed(
                FailureCause.INTERNAL, f"[{self.request.request_id}] decode sent tokens for choice {msg.index}"
            )
        choice = self._choices[msg.index]
        if choice.finish is not None:
            return None
        choice.drafted, choice.accepted = max(choice.drafted, msg.num_drafted), max(choice.accepted, msg.num_accepted)
        token_ids = list(msg.token_ids)
        self.token_ids.extend(token_ids)
        text = choice.feed(token_ids, FINISH_FROM_PB.get(msg.finish_reason))
        if not text and not token_ids:
            return None
        delta = _delta(text, token_ids, msg.index)
        delta.delta.logprobs.extend(msg.logprobs)
        return delta

    def final(
        self, prefill: prefill_pb2.PrefillResponse, reserve: decode_pb2.ReserveResponse
    ) -> gateway_pb2.GenerateResponse:
        """The last message: why the answer ended and its figures (seconds; token counts, every
        choice's added up; with n > 1 each choice's finish and tokens too)."""
        finish = self.finish
        assert finish is not None, self.request.request_id
        done = time.perf_counter()
        n_gen = len(self.token_ids)
        first = self._choices[0]
        out = gateway_pb2.Final(
            finish_reason=finish.value,
            finish=FINISH_TO_PB[finish],
            prompt_tokens=len(self.request.prompt_token_ids),
            generated_tokens=n_gen,
            ttft_s=self.first_at - self.arrived,
            e2e_s=done - self.arrived,
            # each choice's tokens after its first, over the time after the first tokens
            itl_s=(done - self.first_at) / (first.num_tokens - 1) if first.num_tokens > 1 else 0.0,
            decode_instance=reserve.instance_id,
            request_id=self.request.request_id,
            retries=self.retries,
            admission_s=self.waited,
            drafted_tokens=sum(c.drafted for c in self._choices),
            accepted_tokens=sum(c.accepted for c in self._choices),
            stop_sequence=first.stops.matched,
        )
        _add_prefill_figures(out, prefill, reserve, self._decode_digest)
        if len(self._choices) > 1:
            out.choice_finish.extend(FINISH_TO_PB[c.finish] for c in self._choices if c.finish is not None)
            out.choice_generated_tokens.extend(c.num_tokens for c in self._choices)
        return gateway_pb2.GenerateResponse(final=out)


def _add_prefill_figures(
    out: gateway_pb2.Final,
    prefill: prefill_pb2.PrefillResponse,
    reserve: decode_pb2.ReserveResponse,
    decode_digest: str,
) -> None:
    """Fill `out` with what prefill's answer reports, read in this one place: its instance, the
    cached and pulled prompt tokens, the queue, pull and compute seconds, and the KV push
    (prefill's kv_transfer, passed on whole) with decode's part added: the leading pages its
    Reserve said it held (not pushed) and the digest of what it received."""
    out.prefill_instance = prefill.instance_id
    out.cached_tokens = prefill.num_cached_tokens
    out.pulled_tokens = prefill.num_pulled_tokens
    out.pull_s = prefill.pull_s
    out.queue_s = prefill.queue_s
    out.prefill_s = prefill.compute_s
    out.kv_transfer.CopyFrom(prefill.kv_transfer)
    out.kv_transfer.decode_digest = decode_digest
    out.kv_transfer.decode_cached_pages = reserve.num_cached_pages


def record_final(span, f: gateway_pb2.Final) -> None:
    """A whole answer's attributes on its request span, its metrics and its log line."""
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


def _delta(text: str, token_ids: list[int], index: int = 0) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(delta=gateway_pb2.TextDelta(text=text, token_ids=token_ids, index=index))
