"""The prefill engine: prefix-cache lookup, compute of the uncached suffix, first token.

Every pool operation and every forward runs on ONE worker thread (the service passes
its main-thread executor, where torch is fastest), so the prefix cache needs no lock and
requests are computed in arrival order. A request's pages stay referenced until its KV push is done, then full prompt
blocks stay in the prefix cache (evictable, LRU) and the rest go back to the free list.

Chunked prefill: a prompt longer than `chunked_prefill_size` tokens is computed in chunks
(`chunk_ends`), and after each chunk the job's `on_pages_ready` hears how many of its pages
are final, so the service pushes them to decode while the next chunk computes (the overlap
Mooncake and SGLang get from layer- or chunk-wise transfer). The last chunk is short, so
little of the push is left after the compute ends.
KV events (blocks stored / removed / cleared) are published to the Redis index as the
pool emits them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.eplb import expert_stats
from engine.forward import ForwardItem, Runner, StateSlots, chunk_ends
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from kvstore.block_hash import BlockHash, hash_blocks
from kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvstore.kv_events import KVEvent
from prefill_svc import metrics
from runtime.cpu_share import CpuShare

logger = logging.getLogger(__name__)


class Cancelled(Exception):
    """The request was cancelled before its compute started."""


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill produced; the caller must call release(block_ids, state_slot) after the push."""

    first_token: int
    block_ids: tuple[int, ...]
    state_slot: int | None
    """The request's state slot (models with state beyond pages, e.g. DeepSeek-V4), pushed after the pages."""
    num_cached_tokens: int
    num_computed_tokens: int
    queue_s: float
    compute_s: float


class PrefillJob:
    """Handle on a submitted prefill; cancel() stops it if compute has not started."""

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        block_hashes: Sequence[BlockHash] | None = None,
        on_pages_ready: Callable[[tuple[int, ...], int], None] | None = None,
    ) -> None:
        """block_hashes: the prompt's full blocks' chained hashes (kvstore.block_hash) when the
        caller computed them already (the gateway does, for routing); None hashes here.

        on_pages_ready(block_ids, n): called on the worker thread when the first n of the
        request's pages (block_ids, all of them) are final before the compute ends: the
        cached prefix's pages at once, then each chunk's (chunked prefill). It must not block;
        the pages stay referenced until the caller's release()."""
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.block_hashes = block_hashes
        self.sampling = sampling
        self.seed = seed
        self.on_pages_ready = on_pages_ready
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        """Resolves to PrefillResult, or raises Cancelled / NoFreeBlocksError (see submit)."""

    def cancel(self) -> None:
        self.cancelled.set()


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
        cpu_share: CpuShare | None = None,
    ) -> None:
        """`publish(events)` is called on the worker thread with each batch of KV events.

        `executor` must run one callable at a time; None makes a single-thread executor.
        `max_batch_tokens` bounds the prompt tokens of the jobs taken together (a longer
        prompt still runs, alone). `chunked_prefill_size` (tokens, 0 = off) splits each
        job's computed range into chunks (`chunk_ends`), one forward per chunk of every job
        taken together. `cpu_share`: marks each forward for a decode instance on the same cores
        (`runtime.cpu_share`), None when this instance has cores of its own.
        """
        self.runner = runner
        self.page_size = page_size
        self._publish = publish
        self.pool = BlockPool(
            num_pages, page_size, enable_prefix_caching=enable_prefix_caching, on_events=self._on_events
        )
        self.slots = StateSlots(runner.num_state_slots)
        self._owns_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self._forward_mark = cpu_share.prefill_forward if cpu_share is not None else contextlib.nullcontext
        self._pending: deque[PrefillJob] = deque()
        self._count_lock = threading.Lock()
        self.num_queued_tokens = 0
        self.num_active = 0
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_cached = 0

    def _on_events(self, events: list[KVEvent]) -> None:
        if self._publish is None:
            return
        try:
            self._publish(events)
        except Exception as exc:  # the index lags; serving goes on
            logger.warning("could not publish %d KV events: %s", len(events), exc)

    def submit(self, job: PrefillJob) -> concurrent.futures.Future:
        """Queue a job; the future resolves to PrefillResult or raises Cancelled / NoFreeBlocksError.

        Jobs queued while the worker is busy are computed together in one forward
        (up to max_batch_tokens prompt tokens), as vLLM and SGLang batch prefills.
        """
        with self._count_lock:
            self.num_queued_tokens += len(job.token_ids)
            self.num_active += 1
            self._pending.append(job)
        self._executor.submit(self._drain)
        return job.future

    def release(self, block_ids: Sequence[int], state_slot: int | None = None) -> concurrent.futures.Future:
        """Drop the request's references and its state slot (on the worker thread); full blocks stay cached."""
        return self._executor.submit(self._release, list(block_ids), state_slot)

    def _release(self, block_ids: list[int], state_slot: int | None) -> None:
        self.pool.free(block_ids)
        self.slots.free(state_slot)
        if self._pending:  # jobs may be waiting for these pages
            self._drain()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the worker thread (for stats and integrity checks)."""
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        if self._owns_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _take_batch(self) -> list[PrefillJob]:
        with self._count_lock:
            batch: list[PrefillJob] = []
            tokens = 0
            while self._pending and (not batch or tokens + len(self._pending[0].token_ids) <= self.max_batch_tokens):
                job = self._pending.popleft()
                batch.append(job)
                tokens += len(job.token_ids)
            return batch

    def _drain(self) -> None:
        """On the worker thread: prefill every queued job that fits the token budget at once.

        A job that finds too few free pages (or state slots) while other requests hold some
        waits at the head of the queue until a release frees them, as vLLM's scheduler keeps
        a request waiting; one that could not fit even in an empty pool fails at once.
        """
        batch = self._take_batch()
        waiting: list[PrefillJob] = []
        try:
            ready = []
            for job in batch:
                if job.cancelled.is_set():
                    job.future.set_exception(Cancelled(job.request_id))
                    continue
                needs = math.ceil(len(job.token_ids) / self.page_size)
                if needs > self.pool.num_blocks:
                    job.future.set_exception(
                        NoFreeBlocksError(
                            f"[{job.request_id}] needs {needs} KV pages, more than this instance's {self.pool.num_blocks}"
                        )
                    )
                    continue
                if waiting:  # keep arrival order behind a job that waits
                    waiting.append(job)
                    continue
                try:
                    ready.append((job, *self._allocate(job)))
                except NoFreeBlocksError as exc:
                    if self._fits_later(job):
                        waiting.append(job)
                    else:
                        job.future.set_exception(exc)
                except Exception as exc:  # this job fails, the others go on
                    job.future.set_exception(exc)
            if ready:
                self._compute(ready)
        finally:
            with self._count_lock:
                for job in batch:
                    if job not in waiting:
                        self.num_queued_tokens -= len(job.token_ids)
                        self.num_active -= 1
                self._pending.extendleft(reversed(waiting))

    def _fits_later(self, job: PrefillJob) -> bool:
        """Releases by requests in flight will make room for `job` (pages, state slot)."""
        return self.pool.num_referenced_blocks > 0 or self.slots.num_used > 0

    def _allocate(self, job: PrefillJob) -> tuple[Sequence[BlockHash], tuple[int, ...], int, int | None]:
        """Reuse the cached prefix and allocate pages for the rest, plus a state slot:
        (hashes, block ids, cached tokens, slot)."""
        self.slots.require_free(NoFreeBlocksError)
        tokens, size = job.token_ids, self.page_size
        hashes = job.block_hashes if job.block_hashes is not None else hash_blocks(tokens, size)
        # recompute at least the last prompt token so its logits exist
        match = self.pool.match_prefix(hashes[: (len(tokens) - 1) // size])
        try:
            new = self.pool.allocate(math.ceil(len(tokens) / size) - len(match.block_ids))
        except Exception:
            self.pool.free(match.block_ids)
            raise
        slot = self.slots.allocate()
        if slot is not None and match.block_ids:  # continue from the end of the cached prefix
            self.runner.resume_state_slot(slot, match.block_ids[-1])
        return hashes, (*match.block_ids, *new.block_ids), match.num_cached_tokens, slot

    def _compute(self, ready: list) -> None:
        """Compute every ready job chunk by chunk (one forward per round, a chunk of each job
        still computing), tell each job as its pages become final, then sample first tokens."""
        started = time.perf_counter()
        cpu_started = time.process_time()
        size = self.page_size
        plans = [
            chunk_ends(cached, len(job.token_ids), self.chunked_prefill_size, size) for job, _, _, cached, _ in ready
        ]
        num_chunks = [len(plan) for plan in plans]
        done_at = [cached for _, _, _, cached, _ in ready]
        last_logits: list[torch.Tensor | None] = [None] * len(ready)
        try:
            for job, _, block_ids, cached, _ in ready:
                self._pages_ready(job, block_ids, cached // size)  # the cached prefix: at once
            while any(plans):
                rows = [k for k, plan in enumerate(plans) if plan]
                items = []
                for k in rows:
                    job, _, block_ids, _, slot = ready[k]
                    end = plans[k][0]
                    items.append(
                        ForwardItem(
                            job.token_ids[done_at[k] : end], done_at[k], block_ids[: math.ceil(end / size)], slot
                        )
                    )
                with self._forward_mark():
                    logits = self.runner.forward(items)  # [rows, V]
                for row, k in enumerate(rows):
                    job, _, block_ids, _, _ = ready[k]
                    done_at[k] = plans[k].pop(0)
                    if plans[k]:
                        self._pages_ready(job, block_ids, done_at[k] // size)
                    else:
                        last_logits[k] = logits[row]
            first_tokens = sample(
                torch.stack([t for t in last_logits if t is not None]),  # [B, V]
                [job.sampling for job, *_ in ready],
                [torch.Generator().manual_seed(job.seed) if not job.sampling.greedy else None for job, *_ in ready],
            )
        except Exception as exc:
            for job, _, block_ids, _, slot in ready:
                self._release(list(block_ids), slot)
                job.future.set_exception(exc)
            return
        done = time.perf_counter()
        # first tokens out first: caching the blocks (and their KV events) and the log lines
        # take ~1 ms for a 2K-token prompt that TTFT need not pay; nothing can read the cache
        # in between, since the next job runs on this thread after this one
        for (job, _, block_ids, cached, slot), first_token in zip(ready, first_tokens):
            job.future.set_result(
                PrefillResult(
                    first_token,
                    block_ids,
                    slot,
                    cached,
                    len(job.token_ids) - cached,
                    queue_s=started - job.submitted_at,
                    compute_s=done - started,
                )
            )
        # let the event loop thread, woken by set_result, take the GIL now: otherwise it waits
        # for the caching and logging below to end (computed -> the servicer resuming, 32-token
        # prompts, p50: 0.54 ms without, 0.19 ms with)
        time.sleep(0)
        metrics.STEP_CPU.observe(time.process_time() - cpu_started)
        for (job, hashes, block_ids, cached, _), chunks in zip(ready, num_chunks):
            self.pool.cache_blocks(block_ids[: len(hashes)], hashes)
            self.num_prompt_tokens_computed += len(job.token_ids) - cached
            self.num_prompt_tokens_cached += cached
            logger.info(
                "[%s] prefill %d tokens (%d cached) in %.3f s, %d chunks, batch of %d",
                job.request_id,
                len(job.token_ids),
                cached,
                done - started,
                chunks,
                len(ready),
            )

    @staticmethod
    def _pages_ready(job: PrefillJob, block_ids: tuple[int, ...], n: int) -> None:
        if job.on_pages_ready is None or n <= 0:
            return
        try:
            job.on_pages_ready(block_ids, n)
        except Exception:  # the caller's hook must not fail the compute of the whole batch
            logger.exception("[%s] on_pages_ready failed", job.request_id)

    def stats(self, check: bool = True) -> dict[str, int | str | list[int]]:
        """Pool figures. Through call() (on the worker thread) they are exact and the pool's
        integrity is checked; with check=False, from another thread while the worker computes,
        they may be a step stale and integrity_error is '' unchecked."""
        error = self.pool.integrity_error() if check else ""
        if check and not error and not self.pool.num_referenced_blocks and self.slots.num_used:
            error = f"{self.slots.num_used} state slots held by no request"
        return {
            "num_pages": self.pool.num_blocks,
            "num_free_pages": self.pool.num_free_blocks,
            "num_cached_pages": self.pool.num_cached_blocks,
            "num_referenced_pages": self.pool.num_referenced_blocks,
            "num_active_requests": self.num_active,
            "num_queued_tokens": self.num_queued_tokens,
            "integrity_error": error,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_prompt_tokens_cached": self.num_prompt_tokens_cached,
            **expert_stats(self.runner.expert_token_counts()),
        }
