"""One request as both roles see it (nano-vllm's `Sequence`, vLLM v1's `Request`), torch-free so
the gateway shares it.

Prefill and decode keep each request in one `Request`: its ids, its tokens and counters
(`num_computed_tokens` trails `num_tokens`: prefill is a large gap between them, decode a gap of
one), one `RequestStatus`, its `SamplingParams` (with the seed), its stop rule, and the pages
and state slot `kvmesh.engine.kv_cache.KVCacheManager` gave it. A few fields belong to one role only
(prefill's page hook, decode's reused pages, push landing, expiry and stream); they are
grouped below and stay at their defaults in the other role.

`finish_reason` is the one finish rule (EOS / stop ids / max_tokens) that the gateway's answer
stream and decode's step both apply.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.engine.outcomes import FinishReason
from kvmesh.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures

    from kvmesh.engine.sampling_params import TokenLogprobs
    from kvmesh.kvstore.block_hash import BlockHash

# How a decode request's tokens leave the engine: (new token ids, how it ended, their logprobs),
# where the end is None while it goes on, a FinishReason when it finished, the exception when a
# failure ended it; the logprobs (one per token) only when the request's sampling asks for them.
Ending = FinishReason | Exception | None
EmitFn = Callable[[list[int], Ending, "list[TokenLogprobs] | None"], None]


def finish_reason(
    token: int, num_generated: int, max_tokens: int, stop_token_ids: Container[int]
) -> FinishReason | None:
    """Why an answer ends at `token`, or None while it goes on.

    num_generated: tokens generated so far, `token` included (the first token counts 1).
    stop_token_ids: the ids that end the answer (the model's EOS ids, none with ignore_eos).
    A stop id wins over the length: an answer whose last allowed token is EOS stopped.
    """
    if token in stop_token_ids:
        return FinishReason.STOP
    if num_generated >= max_tokens:
        return FinishReason.LENGTH
    return None


class RequestStatus(enum.Enum):
    """Where a request is. Prefill: WAITING -> RUNNING -> FINISHED (computed; its pages stay held
    until the push is done), or ABORTED (cancelled before the compute). Decode: RESERVED ->
    LANDED -> CLAIMED -> WAITING -> RUNNING -> FINISHED, or ABORTED from any of them; a Generate
    call may claim before the KV landed (RESERVED -> CLAIMED)."""

    RESERVED = "reserved"
    """Decode: pages held, the prompt's KV may still be landing (vLLM's WAITING_FOR_REMOTE_KVS)."""
    LANDED = "landed"
    """Decode: every byte of the push landed; no Generate call yet (the expiry still runs)."""
    CLAIMED = "claimed"
    """Decode: a Generate call owns the request and waits for the KV to land (no expiry)."""
    WAITING = "waiting"
    """Queued for the engine: prefill's compute, decode's admission into the running batch."""
    RUNNING = "running"
    """Prefill: being computed. Decode: in the running batch."""
    FINISHED = "finished"
    """Prefill: computed. Decode: the answer ended (`Request.finish` says why), pages freed."""
    ABORTED = "aborted"
    """Released, cancelled or failed; its pages are freed (at once, or once nothing reads or
    writes them any more: the step under way, the push landing)."""


@dataclass(eq=False)
class Request:
    """One request on one engine. Counters follow vLLM v1: `token_ids` is the prompt then the
    output, `num_computed_tokens` how many of them have KV in the request's pages.

    Raises ValueError for a prompt of no tokens or max_tokens < 1.
    """

    request_id: str
    prompt_token_ids: Sequence[int] = ()
    """The prompt; decode learns it only when a Generate call begins the request (set
    num_prompt_tokens at the reservation instead)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How to sample; `sampling.seed` seeds the request's generator (prefill draws the first
    token from seed, decode the rest from seed + 1; None: torch's global RNG)."""
    max_tokens: int = 1
    """Most tokens the answer may have, the first (prefill's) included."""
    stop_token_ids: frozenset[int] = frozenset()
    """Ids that end the answer (the model's EOS ids; none with ignore_eos)."""
    transfer_id: int = 0
    """The KV push's id between prefill and decode (0: none yet)."""
    num_prompt_tokens: int = 0
    """len(prompt_token_ids), or the prompt's length before its tokens are known (decode)."""
    token_ids: list[int] = field(default_factory=list)
    """The prompt, then every token generated; set from prompt_token_ids."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (prefill) or the push (decode)."""
    num_tier_tokens: int = 0
    """Prefill: of num_cached_tokens, those loaded from the second tier (--kv-tier-blocks)."""
    status: RequestStatus = RequestStatus.WAITING
    finish: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)
    """The request's pages, in token order (kvmesh.engine.kv_cache.KVCacheManager allocates them)."""
    num_prompt_pages: int = 0
    """The leading pages that hold the prompt's KV: what a KV push sends or lands in."""
    state_slot: int | None = None
    """Its state slot, for models with per-request state beyond pages (DeepSeek-V4)."""
    arrival_time: float = field(default_factory=time.perf_counter)
    """time.perf_counter() when the request reached this engine."""
    generator: Any = None
    """The torch.Generator sampling draws from (None: greedy, or torch's global RNG)."""
    num_drafted: int = 0
    """Decode: speculative draft tokens proposed for this request."""
    num_accepted: int = 0
    """Decode: draft tokens the target kept (each one a token that cost no step of its own)."""

    block_hashes: Sequence[BlockHash] | None = None
    """The prompt's full blocks' chained hashes when the caller computed them (the gateway does,
    for routing); None: prefill hashes the prompt itself, decode caches nothing of it."""

    # --- prefill only ---
    on_pages_ready: Callable[[tuple[int, ...], int], None] | None = None
    """Called on the prefill worker when the first n of the request's pages are final before the
    compute ends (the cached prefix at once, then each chunk's); must not block."""
    future: concurrent.futures.Future | None = None
    """Prefill: resolves to the PrefillResult, or raises (set by PrefillEngine.submit)."""

    # --- decode only ---
    num_reused_pages: int = 0
    """Leading prompt pages decode held already (its prefix cache): referenced, not pushed."""
    emit: EmitFn | None = None
    """Where this request's tokens go (the Generate call's stream); set by begin()."""
    landed: asyncio.Future | None = None
    """The KV receiver's future: done once every byte of the push landed, or it broke off."""
    deadline: float = 0.0
    """Event-loop time by which a Generate call must claim the request."""
    expiry: asyncio.TimerHandle | None = None
    draft_state: Any = None
    """What the speculative drafter keeps for this request (kvmesh.engine.speculative)."""
    grammar: Any = None
    """Structured output: the kvmesh.engine.grammar.GrammarState this answer's tokens follow (None:
    free text). Prefill masks the first token with it; decode has one a choice, past the first."""
    prompt_logprobs: list | None = None
    """Prefill, with sampling.prompt_logprobs: each prompt token's TokenLogprobs as its chunk is
    computed (the first token's logprob NaN)."""
    choices: list[Request] | None = None
    """n > 1: every choice of the request, this one (choice 0, the one the push lands in and the
    transfer id names) first; the others share its prompt's full pages (KVCacheManager.fork).
    None: one choice."""
    index: int = 0
    """Which choice this is (0..n-1)."""
    freed: bool = False
    """Its pages and slot went back (decode: each choice frees its own, once)."""

    def __post_init__(self) -> None:
        if self.prompt_token_ids:
            self.prompt_token_ids = list(self.prompt_token_ids)
            self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(
                f"[{self.request_id}] the prompt's tokens and max_tokens must be >= 1, "
                f"got {self.num_prompt_tokens}, {self.max_tokens}"
            )
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def start_decoding(
        self,
        prompt_token_ids: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
        stop_token_ids: frozenset[int],
        emit: EmitFn,
    ) -> None:
        """Decode: the prompt's KV landed; continue after prefill's first_token (already the end
        when `finish` is set). Raises ValueError when the prompt's length is not the reserved one."""
        if len(prompt_token_ids) != self.num_prompt_tokens:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, reserved {self.num_prompt_tokens}")
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = [*prompt_token_ids, first_token]
        self.num_computed_tokens = self.num_cached_tokens = self.num_prompt_tokens
        self.sampling, self.stop_token_ids, self.emit = sampling, stop_token_ids, emit
        self.finish = self.finish_reason_after(first_token)

    def append_tokens(self, tokens: list[int]) -> list[int]:
        """Decode: append a step's tokens up to the first that ends the answer (`finish` says
        why, the finish rule) and count them computed; returns the tokens kept."""
        for n, token in enumerate(tokens, 1):  # stop at EOS or max_tokens, mid-run too
            self.finish = self.finish_reason_after(token, n)
            if self.finish is not None:
                tokens = tokens[:n]
                break
        self.token_ids.extend(tokens)
        self.num_computed_tokens += len(tokens)
        return tokens

    def finish_reason_after(self, token: int, n: int = 0) -> FinishReason | None:
        """Why the answer ends at `token`, the n-th token not yet appended (0: the last one
        appended already); None while it goes on."""
        return finish_reason(token, self.num_generated + n, self.max_tokens, self.stop_token_ids)
