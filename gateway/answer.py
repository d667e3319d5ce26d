"""One attempt's answer as the client reads it: text deltas, then the Final message.

Tokens come from prefill (the first) and decode (the rest); each batch is detokenized
incrementally (never a split multi-byte character), cut before the first stop string, and
checked against the finish rule the engines apply (engine.request.finish_reason: EOS, then
max_tokens) for the first token, decode's own finish reason for the rest. The Final message
gathers the request's figures (TTFT, ITL, cached tokens, the KV push) for the client, its
span and the metrics.
"""

from __future__ import annotations

import logging
import time

from engine.outcomes import FinishReason
from engine.request import finish_reason
from gateway import metrics
from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from gateway.requests import GenerateInput
from protos.kvmesh.v1 import decode_pb2, gateway_pb2, prefill_pb2
from runtime.wire import FINISH_FROM_PB, FINISH_TO_PB

logger = logging.getLogger(__name__)


class Answer:
    """The text of one attempt and its ending.

    Args:
        tokenizer: the served model's tokenizer (its `decode`).
        request: the validated request (stop strings, max_tokens, ignore_eos).
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
        """Token ids sent to the client so far: once there is one, the attempt is not retried."""
        self.finish: FinishReason | None = None
        """Why the answer ended; None while it goes on."""
        self.first_at = 0.0
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(list(request.stop))
        self._stop_token_ids = frozenset() if request.ignore_eos else eos_token_ids
        self._decode_digest = ""
        self._drafted = self._accepted = 0

    def first(self, prefill: prefill_pb2.PrefillResponse) -> gateway_pb2.GenerateResponse:
        """The delta of the first token (prefill's answer, with its logprobs when asked for): it
        goes out at once, even empty. Sets `finish` when this token already ends the answer
        (EOS, max_tokens 1, a stop string)."""
        token = prefill.first_token
        self.first_at = time.perf_counter()
        ended = finish_reason(token, 1, self.request.max_tokens, self._stop_token_ids)
        text, hit = self._stops.feed(self._detok.add([token]), final=ended is not None)
        self.token_ids.append(token)
        self.finish = FinishReason.STOP if hit else ended
        delta = _delta(text, [token])
        if prefill.HasField("first_logprobs"):
            delta.delta.logprobs.append(prefill.first_logprobs)
        return delta

    def add(self, msg: decode_pb2.DecodeResponse) -> gateway_pb2.GenerateResponse | None:
        """The delta of one decode message (None when it carries neither text nor tokens).
        Sets `finish` on decode's last message or on a stop string; the text ends before it."""
        if not self._decode_digest:
            self._decode_digest = msg.kv_digest
        self._drafted, self._accepted = max(self._drafted, msg.num_drafted), max(self._accepted, msg.num_accepted)
        token_ids = list(msg.token_ids)
        self.token_ids.extend(token_ids)
        ended = FINISH_FROM_PB.get(msg.finish_reason)
        text, hit = self._stops.feed(self._detok.add(token_ids), final=ended is not None)
        if ended is not None and not hit:
            text += self._stops.feed(self._detok.flush(), final=True)[0]
        self.finish = FinishReason.STOP if hit else ended
        if not text and not token_ids:
            return None
        delta = _delta(text, token_ids)
        delta.delta.logprobs.extend(msg.logprobs)
        return delta

    def final(
        self, prefill: prefill_pb2.PrefillResponse, reserve: decode_pb2.ReserveResponse
    ) -> gateway_pb2.GenerateResponse:
        """The last message: why the answer ended and its figures (seconds; token counts)."""
        assert self.finish is not None, self.request.request_id
        done = time.perf_counter()
        n_gen = len(self.token_ids)
        return gateway_pb2.GenerateResponse(
            final=gateway_pb2.Final(
                finish_reason=self.finish.value,
                finish=FINISH_TO_PB[self.finish],
                prompt_tokens=len(self.request.prompt_token_ids),
                cached_tokens=prefill.num_cached_tokens,
                generated_tokens=n_gen,
                ttft_s=self.first_at - self.arrived,
                e2e_s=done - self.arrived,
                itl_s=(done - self.first_at) / (n_gen - 1) if n_gen > 1 else 0.0,
                prefill_instance=prefill.instance_id,
                decode_instance=reserve.instance_id,
                request_id=self.request.request_id,
                queue_s=prefill.queue_s,
                pulled_tokens=prefill.num_pulled_tokens,
                pull_s=prefill.pull_s,
                prefill_s=prefill.compute_s,
                retries=self.retries,
                admission_s=self.waited,
                drafted_tokens=self._drafted,
                accepted_tokens=self._accepted,
                kv_transfer=gateway_pb2.KVTransfer(
                    num_pages=prefill.num_pages,
                    page_nbytes=prefill.page_nbytes,
                    nbytes=prefill.nbytes_sent,
                    seconds=prefill.transfer_s,
                    exposed_seconds=prefill.exposed_transfer_s,
                    prefill_digest=prefill.kv_digest,
                    decode_digest=self._decode_digest,
                    decode_cached_pages=reserve.num_cached_pages,
                ),
            )
        )


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


def _delta(text: str, token_ids: list[int]) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(delta=gateway_pb2.TextDelta(text=text, token_ids=token_ids))
