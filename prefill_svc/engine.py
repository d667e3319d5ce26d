"""The prefill engine: prefix-cache lookup, compute of the uncached suffix, first token.

Each request is one `kvmesh.engine.request.Request` (its pages, cached prefix and state slot from
kvmesh.engine.kv_cache.KVCacheManager). Every cache operation and every forward runs on ONE worker
thread (the service passes its main-thread executor, where torch is fastest), so the prefix
cache needs no lock and requests are computed in arrival order. A request's pages stay
referenced until its KV push is done, then full prompt blocks stay in the prefix cache
(evictable, LRU) and the rest go back to the free list.

Chunked prefill (kvmesh.prefill_svc.chunked): a prompt longer than `chunked_prefill_size` tokens is
computed in chunks, its pages handed to the push as they become final. KV events (blocks
stored / removed / cleared) are published to the Redis index as the pool emits them.

Beside it: the queue of requests and its counts (kvmesh.prefill_svc.pending), what a prefill
produces (kvmesh.prefill_svc.result), each forward's turn on cores shared with a decode instance
(kvmesh.prefill_svc.forward_turns), the short calls other threads make on the worker, run between
two forwards (kvmesh.prefill_svc.worker_calls).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Sequence

from kvmesh.engine.ep.eplb import expert_stats
from kvmesh.engine.forward import Runner
from kvmesh.engine.kv_cache import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.kvstore.block_pool import NoFreeBlocksError
from kvmesh.kvstore.kv_events import KVEvent
from kvmesh.kvstore.kv_tier import KVTier
from kvmesh.prefill_svc import metrics
from kvmesh.prefill_svc.chunked import prefill_batch, short_last_chunk_pays
from kvmesh.prefill_svc.forward_turns import ForwardTurns
from kvmesh.prefill_svc.pending import PendingRequests
from kvmesh.prefill_svc.result import Cancelled, resolve
from kvmesh.prefill_svc.worker_calls import WorkerCalls
from kvmesh.runtime.cpu_share import CpuShare, NoCpuShare
from kvmesh.runtime.latency_fit import LinearFit

logger = logging.getLogger(__name__)


class PrefillEngine:
    """Prefix cache + model runner for one prefill instance."""

    def __init__(
        self,
        runner: Runner,
        page_size: int,
        num_pages: int,
        enable_prefix_caching: bool,
        publish=None,
        executor: concurrent.futures.Executor | None = None,
        max_batch_tokens: int = 4096,
        chunked_prefill_size: int = 0,
        cpu_share: CpuShare | NoCpuShare | None = None,
        forward_tokens_beside_decode: int = 0,
        push_path: str = "auto",
        tier: KVTier | None = None,
    ) -> None:
        """`publish(events)` is called on the worker thread with each batch of KV events.

        `executor` must run one callable at a time; None makes a single-thread executor.
        `max_batch_tokens` bounds the prompt tokens of the requests taken together (a longer
        prompt still runs, alone). `chunked_prefill_size` (tokens, 0 = off) splits each
        request's computed range into chunks (`chunk_ends`), one forward per chunk of every
        request taken together. `cpu_share`: each forward takes its turn with a decode instance
        on the same cores (`kvmesh.runtime.cpu_share`); None or a NoCpuShare when this instance has cores of its own;
        `forward_tokens_beside_decode` (tokens, 0 = off): with it, the most a forward computes while
        that decode instance has steps to run (`CpuShare.decode_busy`; chunks shrink to fit).
        `push_path`: how KV pushes leave the pages (kvmesh.kvstore.staging; KVCacheManager).
        `tier`: the second tier evicted blocks go to (kvmesh.kvstore.kv_tier; None: none).
        """
        self.runner = runner
        self.page_size = page_size
        self._publish = publish
        self.kv_cache = KVCacheManager(
            runner, num_pages, page_size, enable_prefix_caching, self._on_events, push_path=push_path, tier=tier
        )
        self._owns_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.turns = ForwardTurns(cpu_share, forward_tokens_beside_decode)
        """Each forward's turn on cores shared with decode, its budget there, and their counts."""
        self.pending = PendingRequests()
        self.calls = WorkerCalls()
        """What `call` and `release` queue: run before each forward and each batch, not behind them."""
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_cached = 0
        self._tokens_per_s: float | None = None
        self.compute_fit = LinearFit(4, relative=True)
        """A batch's compute seconds (its forwards' own: the turns waited on shared cores left out)
        on [forwards, requests, tokens computed, sum of tokens x (cached + tokens / 2)] (a
        forward's fixed cost, which the requests of a batch share; the attention's part grows
        with the context), to the least relative error: the TTFT predictor's input
        (kvmesh.gateway.prefill_queues.fitted_compute_s)."""
        self.push_fit = LinearFit(2)
        """A push's seconds after the compute (what TTFT pays) on [1, pages pushed]."""

    @property
    def pool(self):
        """The page pool (kvmesh.kvstore.block_pool.BlockPool) under the KV cache: its prefix cache."""
        return self.kv_cache.pool

    def _on_events(self, events: list[KVEvent]) -> None:
        if self._publish is None:
            return
        try:
            self._publish(events)
        except Exception as exc:  # the index lags; serving goes on
            logger.warning("could not publish %d KV events: %s", len(events), exc)

    def submit(self, request: Request) -> concurrent.futures.Future:
        """Queue a request; the future (also request.future) resolves to PrefillResult or raises
        Cancelled / NoFreeBlocksError. request.on_pages_ready, when set, hears on the worker
        thread how many of its pages (block_ids) are final before the compute ends.

        Requests queued while the worker is busy are computed together in one forward
        (up to max_batch_tokens prompt tokens), as vLLM and SGLang batch prefills.
        """
        future = self.pending.add(request)
        self._executor.submit(self._drain)
        return future

    def cancel(self, request: Request) -> None:
        """Stop a request whose compute has not started (it then fails with Cancelled)."""
        self.pending.cancel(request)

    def release(self, block_ids: Sequence[int], state_slot: int | None = None) -> concurrent.futures.Future:
        """Drop the request's references and its state slot (on the worker thread, between two
        forwards: `call`); full blocks stay cached."""
        return self.call(self._release, list(block_ids), state_slot)

    def _release(self, block_ids: list[int], state_slot: int | None) -> None:
        self.kv_cache.free(block_ids, state_slot)
        if self.pending:  # requests may be waiting for these pages: a batch of its own, not inside this one
            self._executor.submit(self._drain)

    def allocate_now(self, request: Request) -> bool:
        """On the worker thread (through call): give the request its pages now, prefix-cache and
        second-tier hits included (KVCacheManager.allocate_prompt), so a pull can land in them
        before the compute; submit() then computes it without allocating again. False when the
        pages are short now (the request then waits in the queue as any other)."""
        try:
            self.kv_cache.allocate_prompt(request)
        except NoFreeBlocksError:
            return False
        return True

    def tokens_per_s(self) -> float | None:
        """Prompt tokens this instance computed per second of compute, recently (an EWMA over
        batches; None before the first). The pull's estimate compares with it."""
        return self._tokens_per_s

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the worker thread, before the next forward (or at once when it is
        idle), not after the batches queued: an allocation, a hold on blocks, the stats
        (kvmesh.prefill_svc.worker_calls). fn must not compute a batch."""
        future = self.calls.put(fn, *args)
        self._executor.submit(self.calls.run)
        self.turns.cpu_share.wake()  # a forward waiting for its turn runs the calls meanwhile
        return future

    def shutdown(self) -> None:
        if self._owns_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _drain(self) -> None:
        """On the worker thread: prefill every queued request that fits the token budget at once.

        A request that finds too few free pages (or state slots) while other requests hold some
        waits at the head of the queue until a release frees them, as vLLM's scheduler keeps
        a request waiting; one that could not fit even in an empty pool fails at once.
        """
        self.calls.run()  # a release may free the pages this batch needs
        batch = self.pending.take(self.max_batch_tokens)
        waiting: list[Request] = []
        try:
            ready = []
            for r in batch:
                assert r.future is not None, r.request_id
                if r.status is RequestStatus.ABORTED:
                    if r.block_ids:  # allocated ahead of a pull: give the pages back
                        self.kv_cache.free(r.block_ids, r.state_slot)
                    r.future.set_exception(Cancelled(r.request_id))
                    continue
                if r.block_ids:  # allocated ahead (allocate_now): computed as it is, in order
                    if waiting:
                        waiting.append(r)
                    else:
                        ready.append(r)
                    continue
                if not self.kv_cache.fits_ever(r.num_prompt_tokens):
                    needs = self.kv_cache.num_pages_for(r.num_prompt_tokens)
                    r.future.set_exception(
                        NoFreeBlocksError(
                            f"[{r.request_id}] needs {needs} KV pages, more than this instance's {self.pool.num_blocks}"
                        )
                    )
                    continue
                if waiting:  # keep arrival order behind a request that waits
                    waiting.append(r)
                    continue
                try:
                    self.kv_cache.allocate_prompt(r)
                    ready.append(r)
                except NoFreeBlocksError as exc:
                    if self.kv_cache.fits_later():
                        waiting.append(r)
                    else:
                        r.future.set_exception(exc)
                except Exception as exc:  # this request fails, the others go on
                    r.future.set_exception(exc)
            if ready:
                self._compute(ready)
        finally:
            self.pending.settle(batch, waiting)

    def _compute(self, ready: list[Request]) -> None:
        """Compute every ready request (kvmesh.prefill_svc.chunked), resolve their futures, then cache
        their prompt blocks."""
        started = time.perf_counter()
        cpu_started = time.process_time()
        waited_before = self.turns.cpu_share_wait_seconds
        self.pending.start(ready)
        try:
            first_tokens, first_logprobs, num_chunks = prefill_batch(
                self.runner,
                self.kv_cache,
                ready,
                self.chunked_prefill_size,
                functools.partial(self._forward_turn, min(r.arrival_time for r in ready)),
                self.turns.budget_of_forwards(),
                short_last_chunk_pays(
                    self.push_fit.coefficients(),
                    self.compute_fit.coefficients(),
                    self.chunked_prefill_size,
                    self.page_size,
                ),
            )
        except Exception as exc:
            self._fail(ready, exc)
            return
        done = time.perf_counter()
        waited_s = self.turns.cpu_share_wait_seconds - waited_before
        self._measure_rate(ready, max(num_chunks, default=0), done - started, waited_s)
        # first tokens out first: caching the blocks (and their KV events) and the log lines
        # take ~1 ms for a 2K-token prompt that TTFT need not pay; nothing can read the cache
        # in between, since the next request runs on this thread after this one
        resolve(ready, first_tokens, first_logprobs, started, done)
        # let the event loop thread, woken by set_result, take the GIL now: otherwise it waits
        # for the caching and logging below to end (computed -> the servicer resuming, 32-token
        # prompts, p50: 0.54 ms without, 0.19 ms with)
        time.sleep(0)
        metrics.STEP_CPU.observe(time.process_time() - cpu_started)
        self._cache_prompts(ready, num_chunks, done - started)

    @contextlib.contextmanager
    def _forward_turn(self, since: float) -> Iterator[None]:
        """Around each forward of a batch whose oldest request arrived at `since`
        (time.perf_counter() seconds): the calls queued meanwhile, then the forward in its turn,
        first come first served across the prefill instances on these cores. The calls that come
        while it waits for its turn (behind other instances' prompts, for seconds under load) run
        as they come: a pull's allocation, a hold, the stats wait for no forward."""
        self.calls.run()
        with self.turns.turn(since, self.calls.run):
            yield

    def _fail(self, ready: list[Request], exc: Exception) -> None:
        """The batch's forward or sampling raised: free its requests' pages and fail them with `exc`."""
        for r in ready:
            self.kv_cache.free(r.block_ids, r.state_slot)
            r.status = RequestStatus.ABORTED
            assert r.future is not None
            r.future.set_exception(exc)
        # requests may wait for these pages: drain again once this drain has put them back
        # in the queue (not from here, where a nested drain would pass them by)
        self._executor.submit(self._drain)

    def _measure_rate(self, ready: list[Request], forwards: int, seconds: float, waited_s: float) -> None:
        """Fold the batch's prompt tokens computed per second into tokens_per_s (an EWMA; batches
        of fewer than 16 computed tokens say too little), and its compute seconds over its
        `forwards`, the `waited_s` its forwards waited for their turns on shared cores left out,
        into the profile (the gateway shares the cores out itself: kvmesh.gateway.prefill_queues)."""
        computed = sum(r.num_prompt_tokens - r.num_cached_tokens for r in ready)
        attention = sum(
            (r.num_prompt_tokens - r.num_cached_tokens) * (r.num_prompt_tokens + r.num_cached_tokens) / 2 for r in ready
        )
        self.compute_fit.add((forwards, len(ready), computed, attention), seconds - waited_s)
        if computed >= 16 and seconds > 0:
            rate = computed / seconds
            self._tokens_per_s = rate if self._tokens_per_s is None else 0.7 * self._tokens_per_s + 0.3 * rate

    def _cache_prompts(self, ready: list[Request], num_chunks: list[int], seconds: float) -> None:
        """Keep each computed request's full prompt blocks in the prefix cache (their KV events go
        out), count its tokens and log it."""
        for r, chunks in zip(ready, num_chunks):
            self.kv_cache.cache_prompt(r)
            self.num_prompt_tokens_computed += r.num_prompt_tokens - r.num_cached_tokens
            self.num_prompt_tokens_cached += r.num_cached_tokens
            logger.info(
                "[%s] prefill %d tokens (%d cached) in %.3f s, %d chunks, batch of %d",
                r.request_id,
                r.num_prompt_tokens,
                r.num_cached_tokens,
                seconds,
                chunks,
                len(ready),
            )

    @property
    def max_forward_tokens(self) -> int:
        """The most tokens one forward computes: the chunk size, or on shared cores the budget
        beside decode when smaller (0: unbounded)."""
        bounds = [self.chunked_prefill_size]
        if self.turns.cpu_share.shared:
            bounds.append(self.turns.forward_tokens_beside_decode)
        return min((b for b in bounds if b > 0), default=0)

    def stats(self, check: bool = True) -> dict[str, int | float | str | list[int] | list[float]]:
        """Cache figures. Through call() (on the worker thread) they are exact and the cache's
        integrity is checked; with check=False, from another thread while the worker computes,
        they may be a step stale and integrity_error is '' unchecked."""
        return {
            **self.kv_cache.stats(check),
            "num_active_requests": self.pending.num_active,
            "num_queued_tokens": self.pending.num_queued_tokens,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_prompt_tokens_cached": self.num_prompt_tokens_cached,
            "num_forwards": self.turns.num_forwards,
            "forward_seconds": self.turns.forward_seconds,
            "cpu_share_wait_seconds": self.turns.cpu_share_wait_seconds,
            "prefill_fit": self.compute_fit.coefficients() or [],
            "core_group": self.turns.cpu_share.group,
            "max_forward_tokens": self.max_forward_tokens,
            "push_fit": self.push_fit.coefficients() or [],
            **expert_stats(self.runner.expert_token_counts()),
        }
