# B=requests of the batch, V=vocab
"""The compute of one prefill batch, chunk by chunk.

A prompt longer than `chunk_size` tokens is computed in chunks (kvmesh.engine.forward.chunk_ends), one
forward a round over a chunk of each request still computing, and after each chunk the
request's `on_pages_ready` hears how many of its pages are final, so the service pushes them to
decode while the next chunk computes (the overlap Mooncake and SGLang get from layer- or
chunk-wise transfer). The last chunk is short, so little of the push is left after the compute
ends. kvmesh.prefill_svc.engine runs this on its one worker thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from kvmesh.engine.forward import ForwardItem, Runner, chunk_ends, last_chunk_tokens, whole_pages
from kvmesh.engine.kv_cache import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import sample, token_logprobs
from kvmesh.engine.sampling_params import SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


def prefill_batch(
    runner: Runner,
    kv_cache: KVCacheManager,
    batch: list[Request],
    chunk_size: int,
    forward_mark: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    forward_budget: Callable[[], int] | None = None,
    short_last: bool = True,
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None], list[int]]:
    """Compute the uncached prompt of every request in `batch` (pages allocated, num_computed_tokens
    at its cached prefix) and sample each one's first token (its sampling params; a seeded
    generator unless greedy). chunk_size: tokens a chunk (0 = the whole prompt at once);
    forward_mark: entered around each forward (kvmesh.runtime.cpu_share); forward_budget: asked before
    each forward, the most tokens it may compute in all (0: no bound but chunk_size), split evenly
    over the requests still computing, whole pages each (a page at least); short_last: each
    prompt's last chunk short (chunk_ends). Advances num_computed_tokens.

    Returns (the first token of each request's choices (sampling.n of them, choice i drawn with
    sampling.for_choice(i)), their logprobs when its sampling asks for them
    (kvmesh.engine.sampler.token_logprobs) else None, the chunks each took). Raises what the forward or
    the sampler raises; the caller frees the batch then.
    """
    size = kv_cache.page_size
    plan = _ChunkPlan(batch, chunk_size, size, short_last)
    num_chunks = [0] * len(batch)
    last_logits: list[torch.Tensor | None] = [None] * len(batch)
    for r in batch:
        pages_ready(r, r.num_cached_tokens // size)  # the cached prefix: at once
    while rows := plan.computing():
        if forward_budget is not None:  # the rest of a prompt replanned while the budget binds, and once after
            plan.fit(rows, forward_budget())
        last = _forward(runner, kv_cache, batch, [(k, plan.ends[k][0]) for k in rows], forward_mark)
        for row, k in enumerate(rows):
            r = batch[k]
            r.num_computed_tokens = plan.ends[k].pop(0)
            num_chunks[k] += 1
            if plan.ends[k]:
                pages_ready(r, r.num_computed_tokens // size)
            else:
                last_logits[k] = last[row]
    logits = torch.stack([t for t in last_logits if t is not None])  # [B, V]
    first_tokens, first_logprobs = sample_first_tokens(batch, logits)
    return first_tokens, first_logprobs, num_chunks


def short_last_chunk_pays(
    push_fit: Sequence[float] | None, compute_fit: Sequence[float] | None, chunk_size: int, page_size: int
) -> bool:
    """Whether a chunked prompt should end with a short chunk (kvmesh.engine.forward.chunk_ends):
    the push left after the compute shrinks from a whole chunk's pages to a quarter's, for one
    forward more. By the instance's own profiles (kvmesh.prefill_svc.engine): the seconds the
    push saves (push_fit: seconds on [1, pages]) against a forward's fixed seconds (compute_fit:
    on [forwards, requests, tokens, attention]); True while either is unmeasured. On one host's
    cores a forward's fixed cost is tens of ms and a page's push tens of us, so the short chunk
    costs a forward for nothing; over a slow link it pays."""
    if not push_fit or not compute_fit or chunk_size <= 0:
        return True
    chunk = whole_pages(chunk_size, page_size)
    pages_saved = (chunk - last_chunk_tokens(chunk, page_size)) // page_size
    return push_fit[1] * pages_saved > compute_fit[0]


class _ChunkPlan:
    """Where each request's chunks still to compute end (kvmesh.engine.forward.chunk_ends: token
    counts, whole pages but the last), and which plans a forward budget cut smaller."""

    def __init__(self, batch: list[Request], chunk_size: int, page_size: int, short_last: bool = True) -> None:
        self.batch, self.chunk_size, self.page_size, self.short_last = batch, chunk_size, page_size, short_last
        self.ends = [self._ends(r, r.num_cached_tokens, _chunk_tokens(r, chunk_size)) for r in batch]
        self.shrunk: set[int] = set()  # requests whose plan a forward budget cut smaller than their own chunks

    def computing(self) -> list[int]:
        """The requests (indexes into the batch) with chunks left to compute."""
        return [k for k, ends in enumerate(self.ends) if ends]

    def fit(self, rows: list[int], budget: int) -> None:
        """Replan the rest of each request of `rows` for a forward of at most `budget` tokens in
        all (0: no bound but its own chunks), split evenly, whole pages each (a page at least);
        a plan the budget cut goes back to the request's own chunks once the budget no longer binds."""
        share = whole_pages(budget // len(rows), self.page_size) if budget > 0 else 0
        for k in rows:
            r, own = self.batch[k], _chunk_tokens(self.batch[k], self.chunk_size)
            if share and (not own or share < own):
                self.ends[k] = self._ends(r, r.num_computed_tokens, share)
                self.shrunk.add(k)
            elif k in self.shrunk:  # back to its own chunks
                self.ends[k] = self._ends(r, r.num_computed_tokens, own)
                self.shrunk.discard(k)

    def _ends(self, r: Request, start: int, chunk_tokens: int) -> list[int]:
        return chunk_ends(start, r.num_prompt_tokens, chunk_tokens, self.page_size, self.short_last)


def _forward(
    runner: Runner,
    kv_cache: KVCacheManager,
    batch: list[Request],
    chunks: list[tuple[int, int]],
    forward_mark: Callable[[], contextlib.AbstractContextManager],
) -> dict[int, torch.Tensor]:
    """One forward over the next chunk of each request `chunks` names ((index into the batch,
    where the chunk ends), one a row), inside forward_mark(). Returns row -> the logits after its
    last new token [V]."""
    items = []
    for k, end in chunks:
        r = batch[k]
        new = r.prompt_token_ids[r.num_computed_tokens : end]
        pages = r.block_ids[: kv_cache.num_pages_for(end)]
        items.append(ForwardItem(new, r.num_computed_tokens, pages, r.state_slot))
    # a request that asks for its prompt's logprobs computes alone, every position's logits
    every = {row for row, (k, _) in enumerate(chunks) if batch[k].sampling.prompt_logprobs is not None}
    rest = [row for row in range(len(chunks)) if row not in every]
    last: dict[int, torch.Tensor] = {}
    with forward_mark():
        if rest:
            logits = runner.forward([items[row] for row in rest])  # [rest, V]
            last = {row: logits[i] for i, row in enumerate(rest)}
        for row in sorted(every):
            last[row] = _prompt_logprobs(runner, items[row], batch[chunks[row][0]])
    return last


def sample_first_tokens(
    batch: list[Request], logits: torch.Tensor
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Each request's first tokens from the logits after its prompt (`logits` [B, V]), one a
    choice: a request with n choices draws n from its logits, choice i as a request of its own
    seeded seed + i (a seeded generator unless greedy), a grammar's first mask applied. Returns
    (each request's first tokens, their logprobs when its sampling asks for them else None)."""
    owner = [k for k, r in enumerate(batch) for _ in range(r.sampling.n)]
    params = [r.sampling.for_choice(i) if r.sampling.n > 1 else r.sampling for r in batch for i in range(r.sampling.n)]
    choice_logits = logits if len(owner) == len(batch) else logits[owner]  # [choices, V]
    _mask_first_tokens(batch, owner, choice_logits)
    drawn = sample(
        choice_logits,
        params,
        [torch.Generator().manual_seed(p.seed) if not p.greedy and p.seed is not None else None for p in params],
    )
    first_tokens: list[list[int]] = [[] for _ in batch]
    for k, token in zip(owner, drawn):
        first_tokens[k].append(token)
    first_logprobs: list[list[TokenLogprobs] | None] = [None] * len(batch)
    want = [j for j, p in enumerate(params) if p.logprobs is not None]
    if want:
        found = token_logprobs(choice_logits[want], [drawn[j] for j in want], [params[j] for j in want])
        for j, lp in zip(want, found):
            first_logprobs[owner[j]] = [*(first_logprobs[owner[j]] or []), lp]
    return first_tokens, first_logprobs


PROMPT_LOGPROBS_CHUNK = 512
"""Most prompt tokens one forward computes for a request that asks for its prompt's logprobs:
its logits are [tokens, V] fp32 (100 MB for 512 tokens of a 49K vocabulary)."""


def _chunk_tokens(r: Request, chunk_size: int) -> int:
    """Tokens a chunk of r's prompt: chunk_size, at most PROMPT_LOGPROBS_CHUNK with prompt logprobs."""
    if r.sampling.prompt_logprobs is None:
        return chunk_size
    return min(chunk_size, PROMPT_LOGPROBS_CHUNK) if chunk_size > 0 else PROMPT_LOGPROBS_CHUNK


def _prompt_logprobs(runner: Runner, item: ForwardItem, r: Request) -> torch.Tensor:
    """Compute one chunk of r's prompt with every position's logits (runner.forward_all), add
    the logprobs of the prompt tokens they predict to r.prompt_logprobs (the prompt's first
    token, which nothing predicts, gets NaN), and return the chunk's last row [V] (the first
    token's logits when the chunk ends the prompt). Raises ValueError for a runner without
    forward_all."""
    forward_all = getattr(runner, "forward_all", None)
    if forward_all is None:
        raise ValueError("this model's runner gives no prompt logprobs")
    logits = forward_all([item])  # [n, V]
    start, n = item.num_computed_tokens, len(item.token_ids)
    if r.prompt_logprobs is None:
        r.prompt_logprobs = [TokenLogprobs(r.prompt_token_ids[0], float("nan"))]
    targets = list(r.prompt_token_ids[start + 1 : start + n + 1])  # what each row predicts
    if targets:  # of the raw logits, as vLLM's prompt logprobs: no temperature for a given text
        params = [SamplingParams(logprobs=r.sampling.prompt_logprobs)] * len(targets)
        r.prompt_logprobs += token_logprobs(logits[: len(targets)], targets, params)
    return logits[n - 1]


def _mask_first_tokens(batch: list[Request], owner: list[int], logits: torch.Tensor) -> None:
    """Structured output: each choice row of a request with a grammar keeps only the tokens
    that can start its answer (the grammar's first mask, the same for every choice), in place.
    logits [choices, V]; owner[j]: the request of row j."""
    for k, r in enumerate(batch):
        if r.grammar is None:
            continue
        mask = r.grammar.grammars.new_bitmask(1)
        r.grammar.fill(mask, 0)
        rows = [j for j, o in enumerate(owner) if o == k]
        r.grammar.grammars.apply(logits, mask.expand(len(rows), -1).contiguous(), rows)


def pages_ready(r: Request, n: int) -> None:
    """Tell r.on_pages_ready (when set) that its first n pages are final."""
    if r.on_pages_ready is None or n <= 0:
        return
    try:
        r.on_pages_ready(tuple(r.block_ids), n)
    except Exception:  # the caller's hook must not fail the compute of the whole batch
        logger.exception("[%s] on_pages_ready failed", r.request_id)
