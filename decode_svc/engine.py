"""The decode engine: one table of requests by transfer id, and the continuous-batching loop.

Each request is one `kvmesh.engine.request.Request` in `_requests`, from Reserve until its pages are
freed; decode_svc/transfers.py adds its landing and expiry on the event loop. One thread runs
the loop: each step it admits at most `max_admit_per_step` requests whose KV has landed, runs
ONE forward over every running request (one new token each, or k + 1 rows with k speculative
drafts: kvmesh.engine.speculative), samples, hands the step's tokens to `dispatch` in one call, and
frees the pages of finished requests. Requests join and leave between steps (Orca-style
iteration-level scheduling, as in vLLM's v1 scheduler). Everything the gRPC side calls is
guarded by one lock; the forward itself runs outside it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvmesh.decode_svc import metrics
from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.decode_svc.delivery import (
    CapacityError,
    Delivery,
    DispatchFn,
    InstanceBroken,
    RequestReleased,
    StepFailed,
    deliver_all,
)
from kvmesh.engine.ep.eplb import expert_stats, runner_ep_stats
from kvmesh.engine.ep.ranks import EPWorldError
from kvmesh.engine.forward import Runner
from kvmesh.engine.grammar import GrammarState, fill_draft_masks
from kvmesh.engine.kv_cache import KVCacheManager
from kvmesh.engine.outcomes import FinishReason
from kvmesh.engine.request import EmitFn, Request, RequestStatus
from kvmesh.engine.sampler import token_logprobs
from kvmesh.engine.sampling_params import MAX_CHOICES, SamplingParams, TokenLogprobs
from kvmesh.engine.speculative import create_speculator
from kvmesh.kvstore.block_hash import BlockHash, check_block_hashes
from kvmesh.kvstore.kv_events import KVEvent
from kvmesh.kvstore.kv_publisher import KVEventPublisher
from kvmesh.kvstore.kv_tier import KVTier
from kvmesh.runtime.cpu_share import open_cpu_share

logger = logging.getLogger(__name__)


class DecodeEngine:
    """Owns the decode KV cache, the request table and the batch loop over a Runner.

    dispatch: runs each step's deliveries (deliver_all: on the engine thread; the service
    passes deliver_on(its loop)). on_events: hears the KV events of decode's prefix cache
    (config.enable_prefix_caching: finished requests' full blocks stay cached, and a Reserve
    may reuse them), under the engine's lock; it must not block. tier: the second tier decode's
    evicted blocks go to (kvmesh.kvstore.kv_tier; None: none). Raises ValueError as kvmesh.engine.speculative.create_speculator
    does (too few state slots for config.num_state_slots, mtp without an MTP module).
    """

    def __init__(
        self,
        config: DecodeConfig,
        runner: Runner,
        dispatch: DispatchFn = deliver_all,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        tier: KVTier | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.dispatch = dispatch
        self._cpu_share = open_cpu_share(config.cpu_share, config.cpu_share_max_wait_s)
        self.kv_cache = KVCacheManager(
            runner,
            config.num_pages,
            config.page_size,
            config.enable_prefix_caching,
            on_events,
            push_path=config.kv_push_path,
            tier=tier,
        )
        self.speculator = create_speculator(
            config.speculative,
            runner,
            self.kv_cache,
            config.max_batch_size,
            config.num_scratch_slots,
            config.num_draft_tokens,
            config.max_verify_rows,
            config.draft_row_cost,
        )
        self._cond = threading.Condition()
        self._requests: dict[int, Request] = {}
        """Every request from its reservation until its pages are freed, by transfer id."""
        self._num_sequences = 0
        """Choices reserved, waiting or running (a request with n choices counts n)."""
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._stopping = False
        self.max_batch_size_seen = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        """Wall seconds spent in steps (the batch's forward and sampling) since start."""
        self.num_generated_tokens = 0
        """Tokens the steps sampled since start (num_generated_tokens / num_steps: the mean batch)."""
        self.cpu_share_wait_seconds = 0.0
        """Seconds steps waited for a prefill forward on the same cores (--cpu-share), since start."""
        self._loop_done: concurrent.futures.Future | None = None
        self.broken = ""
        """Why this instance cannot step any more ('' while it can): its expert-parallel world
        lost a rank (kvmesh.engine.ep.ranks.EPWorldError). Reservations are refused from then on."""
        self.on_broken: list[Callable[[str], None]] = []
        """Called once, on the engine thread, with the reason when the instance breaks."""

    @property
    def pool(self):
        """The page pool (kvmesh.kvstore.block_pool.BlockPool) under the KV cache."""
        return self.kv_cache.pool

    def start(self, executor: concurrent.futures.Executor | None = None) -> None:
        """Run the batch loop on `executor` (the service passes the main-thread executor,
        where torch is fastest) or, without one, on a thread of its own."""
        if executor is None:
            own = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-loop")
            self._loop_done = own.submit(self.run_loop)
            own.shutdown(wait=False)  # its thread ends when the loop returns
        else:
            self._loop_done = executor.submit(self.run_loop)

    def shutdown(self) -> None:
        """Stop the loop after its current step and wait for it (30 s at most)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._loop_done is not None:
            self._loop_done.result(timeout=30)

    # --- called from the gRPC side -------------------------------------------------

    def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        transfer_id: int = 0,
        block_hashes: Sequence[BlockHash] = (),
        reuse_cached: bool = False,
        n: int = 1,
    ) -> Request:
        """Reserve pages for the prompt's KV and every token the answer can add: a RESERVED request.
        With n > 1 choices, each further choice gets its own pages for the answer (and a copy of
        the prompt's partial last page) and shares the prompt's full pages once it begins; the
        choices count n against the batch (`Request.choices`).

        The last sampled token never has KV, so the request needs pages for
        num_prompt_tokens + max_tokens - 1 tokens; the push lands in its prompt pages after the
        `num_reused_pages` leading ones this instance held already (reuse_cached: the leading
        `block_hashes` found in the prefix cache, short of the last prompt token's page; those
        pages are referenced, never written).
        block_hashes: the prompt's full blocks' chained hashes (16 bytes each, one a full block,
        or none); the finished request's blocks are cached under them. `transfer_id` is the
        caller's id for the push (in [1, 2^63), so it can tell prefill before this answers); 0
        picks one here. Raises CapacityError when the batch is full or the pool lacks pages or
        state slots, ValueError on bad counts or hashes, or a transfer_id out of range or in use.
        """
        if not 0 <= transfer_id < 1 << 63:
            raise ValueError(f"transfer_id must be in [0, 2^63), got {transfer_id}")
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
        check_block_hashes(block_hashes, num_prompt_tokens, self.config.page_size)
        request = Request(
            request_id,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            status=RequestStatus.RESERVED,
            block_hashes=list(block_hashes) or None,
        )
        with self._cond:
            if transfer_id in self._requests:
                raise ValueError(f"transfer_id {transfer_id:x} is in use; pick another")
            if self._num_sequences + n > self.config.max_batch_size:
                if n > self.config.max_batch_size:
                    raise ValueError(f"n is {n}, more than this decode's batch of {self.config.max_batch_size}")
                raise CapacityError(f"decode batch is full ({self.config.max_batch_size} sequences); retry later")
            self.kv_cache.allocate(
                request,
                num_prompt_tokens + max_tokens - 1,
                CapacityError,
                # never the page of the last prompt token: the push always carries it (as prefill
                # recomputes that token rather than reuse its block)
                reuse=block_hashes[: (num_prompt_tokens - 1) // self.config.page_size] if reuse_cached else (),
            )
            if n > 1:
                self._reserve_choices(request, n)
            while not transfer_id or transfer_id in self._requests:
                transfer_id = random.getrandbits(63)
            request.transfer_id = transfer_id
            for c in request.choices or ():
                c.transfer_id = transfer_id
            self._requests[transfer_id] = request
            self._num_sequences += n
        logger.info(
            "[%s] reserved %d pages, %d of them held already (transfer %x)",
            request_id,
            len(request.block_ids),
            request.num_reused_pages,
            transfer_id,
        )
        return request

    def _reserve_choices(self, request: Request, n: int) -> None:
        """Under the lock, after `request` got its pages: pages for choices 1..n-1 (all or
        nothing: CapacityError frees every page taken, the request's too)."""
        shared = request.num_prompt_tokens // self.config.page_size  # the prompt's full pages
        choices = [request]
        try:
            for i in range(1, n):
                c = Request(
                    request.request_id,
                    num_prompt_tokens=request.num_prompt_tokens,
                    max_tokens=request.max_tokens,
                    status=RequestStatus.RESERVED,
                    block_hashes=request.block_hashes,
                    index=i,
                )
                self.kv_cache.allocate_choice(
                    c, request.num_prompt_tokens + request.max_tokens - 1, shared, CapacityError
                )
                choices.append(c)
        except BaseException:
            for c in choices:
                self.kv_cache.free(c.block_ids, c.state_slot)
            raise
        request.choices = choices

    def get(self, transfer_id: int) -> Request | None:
        """The request reserved under `transfer_id`, until its pages are freed."""
        return self._requests.get(transfer_id)

    def requests(self) -> list[Request]:
        """Every request reserved and not freed yet, in any state."""
        return list(self._requests.values())

    def begin(
        self,
        transfer_id: int,
        prompt_token_ids: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
        stop_token_ids: frozenset[int],
        emit: EmitFn,
    ) -> Request:
        """Queue a reserved request whose prompt KV has landed, continuing after first_token;
        its tokens go to `emit` (through dispatch). sampling.seed: the seed prefill drew the
        first token with (None: 0). Raises KeyError for an unknown transfer, ValueError when the
        prompt length differs from the reservation."""
        return self.begin_choices(transfer_id, prompt_token_ids, [first_token], sampling, stop_token_ids, [emit])

    def begin_choices(
        self,
        transfer_id: int,
        prompt_token_ids: Sequence[int],
        first_tokens: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: frozenset[int],
        emits: Sequence[EmitFn],
        grammars: Sequence[GrammarState] | None = None,
    ) -> Request:
        """`begin` for every choice of the reservation: choice i continues after first_tokens[i],
        sampling as sampling.for_choice(i) (prefill drew its first token with seed + i; decode
        goes on with seed + i + 1), its tokens to emits[i]; choices 1..n-1 share the prompt's full
        pages (KVCacheManager.fork). grammars: each choice's grammar state past its first token
        (structured output; None: free text). Raises KeyError for an unknown transfer,
        ValueError when the prompt length differs from the reservation or the counts from its n."""
        with self._cond:
            r = self._requests[transfer_id]
            choices = r.choices or [r]
            if not len(first_tokens) == len(emits) == len(choices):
                raise ValueError(f"reserved {len(choices)} choices, got {len(first_tokens)} first tokens")
            shared = r.num_prompt_tokens // self.config.page_size
            for c, first_token, emit in zip(choices, first_tokens, emits):
                params = sampling.for_choice(c.index) if len(choices) > 1 else sampling
                c.start_decoding(prompt_token_ids, first_token, params, stop_token_ids, emit)
                c.grammar = grammars[c.index] if grammars else None
                if c is not r:
                    self.kv_cache.fork(r, c, shared)
            for c in choices:
                if not c.sampling.greedy:  # prefill sampled the first token with the seed; go on with another stream
                    c.generator = torch.Generator().manual_seed(((c.sampling.seed or 0) + 1) % 2**63)
                if c.finish is not None:
                    assert c.emit is not None
                    c.emit([], c.finish, None)
                    self._free(c)
                    continue
                self.speculator.start(c)
                c.status = RequestStatus.WAITING
                self._waiting.append(c)
            self._cond.notify_all()
            return r

    def release(self, transfer_id: int, keep_pages: bool = False) -> bool:
        """Abort a request once: an attached Generate call gets RequestReleased, and its pages
        are freed now, at the next step if it is running, or with keep_pages on a later call
        (once no KV push can land in them any more). Returns False when the transfer is unknown
        (finished) or was aborted already."""
        with self._cond:
            r = self._requests.get(transfer_id)
            if r is None:
                return False
            first = r.status is not RequestStatus.ABORTED
            for c in r.choices or [r]:  # every choice ends with it
                if c.freed:
                    continue
                if c.status is not RequestStatus.ABORTED:
                    was, c.status = c.status, RequestStatus.ABORTED
                    if c.emit is not None:
                        ended = RequestReleased(f"[{c.request_id}] released while decoding")
                        self.dispatch([(c.emit, [], ended, None)])
                    if was is RequestStatus.RUNNING:
                        self._cond.notify_all()  # the loop drops it between steps
                        continue
                    if was is RequestStatus.WAITING:
                        self._waiting.remove(c)
                elif c in self._running:
                    continue  # the loop frees it
                if not keep_pages:
                    self._free(c)
            if not keep_pages:
                logger.info("[%s] released", r.request_id)
            return first

    def transfer_buffers(self, transfer_id: int, landing: bool = True) -> list:
        """The buffers a push for this transfer lands in (landing: host buffers for them on the
        staged path, KVCacheManager.inbound), or (landing=False) the pages themselves, where
        the model reads them: the prompt's pages after the reused ones, then the state slot
        (DeepSeek-V4). KeyError if unknown."""
        with self._cond:
            r = self._requests[transfer_id]
            pages = r.block_ids[r.num_reused_pages : r.num_prompt_pages]
            return (
                self.kv_cache.inbound(transfer_id, pages, r.state_slot)
                if landing
                else self.kv_cache.push_buffers(pages, r.state_slot)
            )

    def kv_landed(self, transfer_id: int) -> None:
        """The push for this transfer is complete: its bytes reach the pages (a copy from host
        buffers on the staged path; nothing to do for a transfer released meanwhile)."""
        with self._cond:
            self.kv_cache.landed(transfer_id)

    def publish_snapshot(self, publisher: KVEventPublisher) -> None:
        """Re-publish every block hash decode's prefix cache holds (publisher.resync), under the
        lock its KV events are emitted under, so none slips between the snapshot and the publish."""
        with self._cond:
            publisher.resync(self.kv_cache.snapshot())

    @property
    def num_active_requests(self) -> int:
        """Requests reserved, waiting or running."""
        return len(self._requests)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    def stats(self) -> dict[str, int | float | str | list[int]]:
        """Cache and batch figures for GetStats; integrity_error is '' when check_integrity() passes."""
        with self._cond:
            return {
                **self.kv_cache.stats(),
                "num_active_requests": len(self._requests),
                "max_batch_size": self.max_batch_size_seen,
                "num_steps": self.num_steps,
                "step_seconds": self.step_seconds,
                "num_generated_tokens": self.num_generated_tokens,
                "cpu_share_wait_seconds": self.cpu_share_wait_seconds,
                **expert_stats(self.runner.expert_token_counts()),
                **runner_ep_stats(self.runner),
            }

    def calibrate(self) -> float:
        """Measure what a speculative verification row costs here (Speculator.calibrate); runs
        where steps run, before the loop starts."""
        return self.speculator.calibrate(self.config.page_size)

    # --- the engine thread -----------------------------------------------------------

    def _free(self, r: Request) -> None:
        """Give back one choice's pages and slot; the transfer is forgotten once every choice of
        it is freed (its table entry lives while any choice runs, so a release finds them)."""
        assert not r.freed, r.request_id
        if r.status is not RequestStatus.ABORTED:
            r.status = RequestStatus.FINISHED
            if r.finish is not None:  # every byte landed and every step wrote: its full blocks stay
                self.kv_cache.cache_sequence(r)
        self.kv_cache.free(r.block_ids, r.state_slot)
        self.speculator.forget(r)
        r.freed = True
        self._num_sequences -= 1
        owner = self._requests.get(r.transfer_id)
        if owner is not None and all(c.freed for c in owner.choices or [owner]):
            self.kv_cache.forget_landing(r.transfer_id)
            del self._requests[r.transfer_id]

    def _schedule(self) -> list[Request]:
        """Under the lock: drop aborted requests, admit new ones, return this step's batch."""
        for r in [r for r in self._running if r.status is RequestStatus.ABORTED]:
            self._running.remove(r)
            self._free(r)
            logger.info("[%s] aborted while running", r.request_id)
        admitted = 0
        while (
            self._waiting
            and admitted < self.config.max_admit_per_step
            and len(self._running) < self.config.max_batch_size
        ):
            r = self._waiting.popleft()
            r.status = RequestStatus.RUNNING
            self._running.append(r)
            admitted += 1
        return list(self._running)

    def run_loop(self) -> None:
        """The batch loop; returns after shutdown()."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._waiting or self._running)
                if self._stopping:
                    return
                batch = self._schedule()
            if not batch:
                continue
            try:
                # on cores shared with a prefill instance, a step and a prefill forward take turns
                with self._cpu_share.decode_step() as waited:
                    metrics.CPU_SHARE_WAIT.inc(waited)
                    self.cpu_share_wait_seconds += waited
                    self._step(batch)
            except Exception as exc:  # a failed step ends these streams, never the service
                logger.exception("decode step failed for %d requests", len(batch))
                ending: Exception = StepFailed(f"decode step failed: {exc!r}")
                if isinstance(exc, EPWorldError):  # no later step can run: say so, and stop taking work
                    ending = InstanceBroken(f"decode cannot step any more: {exc}")
                    if not self.broken:
                        self.broken = str(exc)
                        for callback in self.on_broken:
                            callback(self.broken)
                with self._cond:
                    for r in batch:
                        if r.status is RequestStatus.RUNNING:
                            self._running.remove(r)
                            r.status = RequestStatus.ABORTED
                            self._free(r)
                            if r.emit is not None:
                                self.dispatch([(r.emit, [], ending, None)])

    def _step(self, batch: list[Request]) -> None:
        started = time.perf_counter()
        cpu_started = time.process_time()
        rows = self.speculator.rows(batch)  # one row a request, k + 1 with k drafts
        logits = self.runner.forward(rows.items)  # [rows, V]
        _mask_grammars(batch, rows.starts, rows.drafts, logits)
        hidden = self.speculator.hidden()  # [rows, N, H], for a drafter that reads them
        kept = self.speculator.sample(batch, rows, logits)
        logprobs = _kept_logprobs(batch, rows.starts, logits, kept)
        step_s = time.perf_counter() - started
        metrics.STEP_CPU.observe(time.process_time() - cpu_started)
        metrics.STEPS.inc()
        deliveries: list[Delivery] = []
        with self._cond:
            self.num_steps += 1
            self.step_seconds += step_s
            self.max_batch_size_seen = max(self.max_batch_size_seen, len(batch))
            for i, (r, tokens) in enumerate(zip(batch, kept)):
                if r.status is RequestStatus.ABORTED:
                    continue  # freed by the next _schedule
                ended_by_grammar = False
                if r.grammar is not None:
                    tokens, ended_by_grammar = r.grammar.advance(tokens)
                tokens = r.append_tokens(tokens)
                if ended_by_grammar and r.finish is None:
                    r.finish = FinishReason.STOP  # the grammar is complete (or refused a token): the answer ends
                lps = logprobs[i]
                if lps is not None:
                    lps = lps[: len(tokens)]
                accepted = self.speculator.keep(r, i, rows, tokens, hidden if r.finish is None else None)
                if rows.drafts[i]:
                    metrics.ACCEPTED.observe(accepted)
                assert r.emit is not None, r.request_id
                deliveries.append((r.emit, tokens, r.finish, lps))
                if r.finish is not None:
                    self._running.remove(r)
                    self._free(r)
        generated = sum(len(tokens) for _, tokens, _, _ in deliveries)
        self.num_generated_tokens += generated
        metrics.TOKENS.inc(generated)
        self.dispatch(deliveries)


def _mask_grammars(
    batch: Sequence[Request], starts: Sequence[int], drafts: Sequence[list[int]], logits: torch.Tensor
) -> None:
    """Structured output: the rows of each request with a grammar keep only the tokens its
    grammar allows there, in place (logits [rows, V]); a verification row's mask assumes the
    drafts before it kept (kvmesh.engine.grammar.fill_draft_masks), so drafts are checked against it."""
    masked = [i for i, r in enumerate(batch) if r.grammar is not None]
    if not masked:
        return
    grammars = batch[masked[0]].grammar.grammars
    rows: list[int] = []
    for i in masked:
        rows += range(starts[i], starts[i] + len(drafts[i]) + 1)
    bitmask = grammars.new_bitmask(len(rows))
    at = 0
    for i in masked:
        fill_draft_masks(batch[i].grammar.matcher, drafts[i], bitmask, at)
        at += len(drafts[i]) + 1
    grammars.apply(logits, bitmask, rows)


def _kept_logprobs(
    batch: Sequence[Request], starts: Sequence[int], logits: torch.Tensor, kept: Sequence[list[int]]
) -> list[list[TokenLogprobs] | None]:
    """The logprobs of each request's kept tokens, for those whose sampling asks for them (None
    for the others): kept token j of request i was drawn from logits row starts[i] + j (its own
    row without drafts, the verification row after draft j - 1 with them), so a token accepted
    from a draft gets the target's logprob at its position. logits [rows, V]."""
    out: list[list[TokenLogprobs] | None] = [None] * len(batch)
    rows: list[int] = []
    tokens: list[int] = []
    params: list[SamplingParams] = []
    for i, r in enumerate(batch):
        if r.sampling.logprobs is None:
            continue
        rows += range(starts[i], starts[i] + len(kept[i]))
        tokens += kept[i]
        params += [r.sampling] * len(kept[i])
    if not rows:
        return out
    found = iter(token_logprobs(logits[rows], tokens, params))
    for i, r in enumerate(batch):
        if r.sampling.logprobs is not None:
            out[i] = [next(found) for _ in kept[i]]
    return out
