"""What a Prefill request must be before anything is computed for it: a prompt the model can
hold, addresses that parse, counts of blocks and pages within the prompt, sampling the runner
can do and a grammar that compiles. Each check raises ValueError saying what to change (the
servicer answers INVALID_ARGUMENT, kvmesh.runtime.wire)."""

from __future__ import annotations

import asyncio
import random

from kvmesh.engine.grammar import GrammarState
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kvstore.block_hash import check_block_hashes
from kvmesh.kvstore.transport import parse_address
from kvmesh.protos.v1 import common_pb2, prefill_pb2
from kvmesh.runtime.served_model import ServedModel, grammar_state
from kvmesh.runtime.wire import sampling_from_pb


def check_prompt(request: prefill_pb2.PrefillRequest, model: ServedModel, page_size: int) -> None:
    """The prompt (token ids in the vocabulary, within the context), the decode and peer
    addresses, pull_blocks and decode_cached_pages (in blocks of `page_size` tokens) and the
    block hashes (kvmesh.kvstore.block_hash.check_block_hashes). Raises ValueError."""
    n = len(request.token_ids)
    if n == 0:
        raise ValueError("token_ids is empty; send at least one prompt token")
    if n > model.max_context:
        raise ValueError(f"prompt has {n} tokens, the context holds {model.max_context}")
    bad = [t for t in request.token_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"token ids must be in [0, {model.vocab_size}), got {bad[:5]}")
    if request.decode_kv_address:
        parse_address(request.decode_kv_address)  # fail before computing, not at push time
    if request.pull_from:
        try:
            parse_address(request.pull_from)  # a peer's gRPC "host:port"
        except ValueError as exc:
            raise ValueError(f"pull_from (a peer prefill's gRPC address): {exc}") from None
    if not 0 <= request.pull_blocks <= n // page_size:
        raise ValueError(f"pull_blocks must be in [0, {n // page_size}], got {request.pull_blocks}")
    held = request.decode_cached_pages
    if not 0 <= held <= (n - 1) // page_size:
        raise ValueError(
            f"decode_cached_pages must be in [0, {(n - 1) // page_size}] (the prompt's full pages "
            f"before its last token's), got {held}"
        )
    check_block_hashes(request.block_hashes, n, page_size)


async def check_sampling(
    pb: common_pb2.SamplingParams, model: ServedModel, runner
) -> tuple[SamplingParams, GrammarState | None]:
    """The request's sampling (a random seed when it sets none) and, with a grammar, its matcher
    at the answer's start, compiled off the event loop (the first one loads xgrammar). Raises
    ValueError for settings out of range, prompt logprobs from a runner without `forward_all`,
    and a grammar that does not compile or matches nothing."""
    sampling = sampling_from_pb(pb, default_seed=random.getrandbits(63))
    if sampling.prompt_logprobs is not None and not hasattr(runner, "forward_all"):
        raise ValueError("prompt logprobs are not available for this model yet")
    grammar = None
    if sampling.grammar is not None:
        grammar = await asyncio.to_thread(grammar_state, model, sampling.grammar)
    return sampling, grammar
