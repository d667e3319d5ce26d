"""The decode engine: page reservations and the continuous-batching loop.

One thread runs the loop: each step it admits at most `max_admit_per_step` requests
whose pushed KV has landed, runs ONE forward over every running request (one new
token each), samples, streams the tokens out and frees the pages of finished
requests. Requests join and leave between steps (Orca-style iteration-level
scheduling, as in vLLM's v1 scheduler). Everything the gRPC side calls is guarded by
one lock; the forward itself runs outside it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from decode_svc import metrics
from decode_svc.config import DecodeConfig
from decode_svc.speculative import DraftCounts, SpeculationGovernor, propose_ngram
from engine.eplb import ep_stats, expert_stats
from engine.forward import DraftingRunner, DraftItem, ForwardItem, Runner, StateSlots
from engine.outcomes import FinishReason
from engine.request import finish_reason
from engine.sampler import sample, verify_drafts
from engine.sampling_params import SamplingParams
from kvstore.block_pool import BlockPool
from runtime.cpu_share import open_cpu_share

logger = logging.getLogger(__name__)

# Receives (new token ids, how the request ended) for one request: None while it goes on,
# a FinishReason when it finished, the exception when a failed step ended it.
Ending = FinishReason | Exception | None
EmitFn = Callable[[list[int], Ending], None]
# Runs one step's deliveries [(emit, token ids, ending)] where the emit functions may run
# (the servicer hands the whole list to its event loop in one call_soon_threadsafe).
Delivery = tuple[EmitFn, list[int], Ending]
DispatchFn = Callable[[list[Delivery]], object]


def deliver_all(deliveries) -> None:
    """Run each (emit, token ids, finish) delivery in order, here."""
    for emit, tokens, finish in deliveries:
        emit(tokens, finish)


class CapacityError(RuntimeError):
    """No room for another request (batch slots or pages); maps to RESOURCE_EXHAUSTED."""


class StepFailed(RuntimeError):
    """The model step a request was in raised; the request ends with INTERNAL."""


class RequestReleased(RuntimeError):
    """The request was released (its caller left, or Release was called) while a Generate
    call streamed it; that call ends with CANCELLED."""


class SeqState(enum.Enum):
    """Where a decode sequence is: reserved -> waiting -> running -> finished."""

    RESERVED = "reserved"
    """Pages held; the prompt's KV may still be landing."""
    WAITING = "waiting"
    """KV landed and a Generate call attached; waiting for admission into the batch."""
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DecodeSequence:
    """One request's decode state; num_computed_tokens trails len(token_ids) by one."""

    request_id: str
    transfer_id: int
    block_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    state_slot: int | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()
    emit: EmitFn | None = None
    aborted: bool = False
    state: SeqState = SeqState.RESERVED
    drafts: DraftCounts = field(default_factory=DraftCounts)
    governor: SpeculationGovernor = field(default_factory=SpeculationGovernor)
    mtp_pending: torch.Tensor | None = None
    """--speculative mtp: [n, N, H] the target's streams at the last n computed positions, which
    the MTP module has not run over yet (its next drafting pass starts with them)."""
    mtp_start: int = 0
    """--speculative mtp: the first position whose MTP K=V this sequence wrote."""

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class Reservation:
    """Pages reserved for one request; the first num_prompt_pages receive the pushed KV."""

    transfer_id: int
    block_ids: tuple[int, ...]
    num_prompt_pages: int
    state_slot: int | None = None
    """The request's state slot (DeepSeek-V4), received after the prompt pages."""


class DecodeEngine:
    """Owns the decode page pool and the batch loop over a Runner."""

    def __init__(self, config: DecodeConfig, runner: Runner) -> None:
        """Raises ValueError when speculation needs more state slots than the runner has (a
        DeepSeek-V4 runner needs config.num_state_slots: one a request plus the verification
        rows' scratch slots), or `--speculative mtp` of a runner without an MTP module."""
        self.config = config
        self.runner = runner
        self._cpu_share = open_cpu_share(config.cpu_share, config.cpu_share_max_wait_s)
        self.pool = BlockPool(config.num_pages, config.page_size, enable_prefix_caching=False)
        self.slots = StateSlots(runner.num_state_slots)
        self._scratch: list[int] = []
        """State slots the verification rows after a sequence's first write to (DeepSeek-V4):
        row j continues row j-1's state in a slot of its own, and the step keeps the state of
        the last accepted row, so rejected drafts leave nothing behind (`_verify_items`)."""
        if config.speculative != "off" and runner.num_state_slots:
            if runner.num_state_slots < config.num_state_slots:
                raise ValueError(
                    f"--speculative {config.speculative} needs {config.num_state_slots} state slots (one a "
                    f"request and {config.num_scratch_slots} for verification rows), the runner has "
                    f"{runner.num_state_slots}"
                )
            self._scratch = [
                s for s in (self.slots.allocate() for _ in range(config.num_scratch_slots)) if s is not None
            ]
        self._drafter: DraftingRunner | None = None
        if config.speculative == "mtp":
            if not getattr(runner, "has_mtp", False):
                raise ValueError(
                    "--speculative mtp needs a DeepSeek-V4 checkpoint that carries its multi-token-prediction "
                    "module (mtp.* tensors); use --speculative ngram for this model"
                )
            self._drafter = cast(DraftingRunner, runner)
        self._cond = threading.Condition()
        self._by_transfer: dict[int, DecodeSequence] = {}
        self._waiting: deque[DecodeSequence] = deque()
        self._running: list[DecodeSequence] = []
        self._stopping = False
        self.max_batch_size_seen = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        self.row_cost = config.draft_row_cost or 0.35
        """A speculative verification row's cost relative to a one-row step (`calibrate`)."""
        """Wall seconds spent in steps (the batch's forward and sampling) since start."""
        self._loop_done: concurrent.futures.Future | None = None
        self.dispatch: DispatchFn = deliver_all

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

    def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int, transfer_id: int = 0) -> Reservation:
        """Reserve pages for the prompt's KV and every token the answer can add.

        The last sampled token never has KV, so the request needs pages for
        num_prompt_tokens + max_tokens - 1 tokens. `transfer_id` is the caller's id for the
        push (in [1, 2^63), so it can tell prefill before this answers); 0 picks one here.
        Raises CapacityError when the batch is full or the pool lacks pages, ValueError on
        bad counts or a transfer_id out of range or already in use.
        """
        if num_prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"num_prompt_tokens and max_tokens must be >= 1, got {num_prompt_tokens}, {max_tokens}")
        if not 0 <= transfer_id < 1 << 63:
            raise ValueError(f"transfer_id must be in [0, 2^63), got {transfer_id}")
        size = self.config.page_size
        num_pages = math.ceil((num_prompt_tokens + max_tokens - 1) / size)
        with self._cond:
            if transfer_id in self._by_transfer:
                raise ValueError(f"transfer_id {transfer_id:x} is in use; pick another")
            if len(self._by_transfer) >= self.config.max_batch_size:
                raise CapacityError(f"decode batch is full ({self.config.max_batch_size} requests); retry later")
            if num_pages > self.pool.num_free_blocks:
                raise CapacityError(
                    f"request needs {num_pages} KV pages, {self.pool.num_free_blocks} of "
                    f"{self.pool.num_blocks} are free; lower max_tokens or retry later"
                )
            self.slots.require_free(CapacityError)
            block_ids = list(self.pool.allocate(num_pages).block_ids)
            state_slot = self.slots.allocate()
            while not transfer_id or transfer_id in self._by_transfer:
                transfer_id = random.getrandbits(63)
            self._by_transfer[transfer_id] = DecodeSequence(
                request_id=request_id,
                transfer_id=transfer_id,
                block_ids=block_ids,
                num_prompt_tokens=num_prompt_tokens,
                max_tokens=max_tokens,
                state_slot=state_slot,
            )
        logger.info("[%s] reserved %d pages (transfer %x)", request_id, num_pages, transfer_id)
        return Reservation(transfer_id, tuple(block_ids), math.ceil(num_prompt_tokens / size), state_slot)

    def begin(
        self,
        transfer_id: int,
        prompt_token_ids: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
        seed: int,
        stop_token_ids: frozenset[int],
        emit: EmitFn,
        drafts: DraftCounts | None = None,
    ) -> None:
        """Queue a reserved request whose prompt KV has landed, continuing after first_token.

        `drafts` (optional) is kept up to date with the request's speculation counts.
        Raises KeyError for an unknown transfer, ValueError when the prompt length
        differs from the reservation.
        """
        with self._cond:
            seq = self._by_transfer[transfer_id]
            if len(prompt_token_ids) != seq.num_prompt_tokens:
                raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, reserved {seq.num_prompt_tokens}")
            seq.token_ids = [*prompt_token_ids, first_token]
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.sampling = sampling
            seq.stop_token_ids = stop_token_ids
            seq.emit = emit
            seq.governor = SpeculationGovernor(row_cost=self.row_cost)
            if self._drafter is not None and seq.state_slot is not None:
                # the pushed slot ends on the prompt's last streams: MTP's first pending pair
                seq.mtp_pending = self._drafter.slot_hidden(seq.state_slot)[None]
                seq.mtp_start = seq.num_prompt_tokens - 1
            if drafts is not None:
                seq.drafts = drafts
            if not sampling.greedy:
                # prefill sampled the first token with `seed`; continue on another stream
                seq.generator = torch.Generator().manual_seed((seed + 1) % 2**63)
            finish = self._finish_reason(seq, first_token)
            if finish is not None:
                emit([], finish)
                self._free(seq)
                return
            seq.state = SeqState.WAITING
            self._waiting.append(seq)
            self._cond.notify_all()

    def release(self, transfer_id: int) -> bool:
        """Abort a request: free its pages now, or at the next step if it is running.

        Callers must only release once no KV push can still land in its pages. A Generate
        call attached to it gets RequestReleased, so it never waits on tokens that will not
        come. Returns False when the transfer is unknown (already finished).
        """
        with self._cond:
            seq = self._by_transfer.get(transfer_id)
            if seq is None:
                return False
            seq.aborted = True
            if seq.emit is not None:
                self.dispatch([(seq.emit, [], RequestReleased(f"[{seq.request_id}] released while decoding"))])
            if seq.state == SeqState.RUNNING:
                self._cond.notify_all()  # the loop drops it between steps
                return True
            if seq.state == SeqState.WAITING:
                self._waiting.remove(seq)
            self._free(seq)
            logger.info("[%s] released", seq.request_id)
            return True

    def transfer_buffers(self, transfer_id: int) -> list:
        """The buffers a push for this transfer lands in: the prompt's pages, then the state
        slot (DeepSeek-V4). KeyError if unknown."""
        with self._cond:
            seq = self._by_transfer[transfer_id]
            prompt_pages = seq.block_ids[: math.ceil(seq.num_prompt_tokens / self.config.page_size)]
            return [self.runner.page_buffer(b) for b in prompt_pages] + self.runner.state_buffers(seq.state_slot)

    @property
    def num_active_requests(self) -> int:
        """Requests reserved, waiting or running."""
        return len(self._by_transfer)

    def stats(self) -> dict[str, int | float | str | list[int]]:
        """Pool and batch figures for GetStats; integrity_error is '' when check_integrity() passes."""
        with self._cond:
            error = self.pool.integrity_error()
            held = self.slots.num_used - len(self._scratch)  # the scratch slots are held for good
            if not error and held != len(self._by_transfer):
                error = f"{held} state slots held, {len(self._by_transfer)} requests"
            return {
                "num_pages": self.pool.num_blocks,
                "num_free_pages": self.pool.num_free_blocks,
                "num_cached_pages": self.pool.num_cached_blocks,
                "num_referenced_pages": self.pool.num_referenced_blocks,
                "num_active_requests": len(self._by_transfer),
                "max_batch_size": self.max_batch_size_seen,
                "num_steps": self.num_steps,
                "step_seconds": self.step_seconds,
                "integrity_error": error,
                **expert_stats(self.runner.expert_token_counts()),
                **self._ep_stats(),
            }

    def _ep_stats(self) -> dict[str, int | list[int]]:
        """An expert-parallel runner's measured rank loads and placement in use; {} otherwise."""
        loads, placement = getattr(self.runner, "loads", None), getattr(self.runner, "placement", None)
        if loads is None or placement is None:
            return {}
        return ep_stats(loads.rank_tokens.copy(), np.asarray(placement.phy2log))

    # --- the engine thread -----------------------------------------------------------

    def _finish_reason(self, seq: DecodeSequence, token: int) -> FinishReason | None:
        """Why the answer ends at `token`, already appended to seq.token_ids (None: it goes on)."""
        return self._finish_reason_after(seq, token, 0)

    @staticmethod
    def _finish_reason_after(seq: DecodeSequence, token: int, n: int) -> FinishReason | None:
        """Why the answer ends at `token`, the n-th of this step's tokens not yet appended."""
        return finish_reason(token, seq.num_generated + n, seq.max_tokens, seq.stop_token_ids)

    def _free(self, seq: DecodeSequence) -> None:
        seq.state = SeqState.FINISHED
        self.pool.free(seq.block_ids)
        self.slots.free(seq.state_slot)
        del self._by_transfer[seq.transfer_id]

    def _schedule(self) -> list[DecodeSequence]:
        """Under the lock: drop aborted requests, admit new ones, return this step's batch."""
        for seq in [s for s in self._running if s.aborted]:
            self._running.remove(seq)
            self._free(seq)
            logger.info("[%s] aborted while running", seq.request_id)
        admitted = 0
        while (
            self._waiting
            and admitted < self.config.max_admit_per_step
            and len(self._running) < self.config.max_batch_size
        ):
            seq = self._waiting.popleft()
            seq.state = SeqState.RUNNING
            self._running.append(seq)
            admitted += 1
        return list(self._running)

    def run_loop(self) -> None:
        """The batch loop; returns after shutdown()."""
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
                batch = self._schedule()
            if not batch:
                continue
            if self._cpu_share is not None:  # prefill first on shared cores (runtime/cpu_share.py)
                metrics.CPU_SHARE_WAIT.inc(self._cpu_share.wait_for_prefill())
            try:
                self._step(batch)
            except Exception as exc:  # a failed step ends these streams, never the service
                logger.exception("decode step failed for %d requests", len(batch))
                with self._cond:
                    for seq in batch:
                        if seq.state == SeqState.RUNNING:
                            self._running.remove(seq)
                            self._free(seq)
                            if seq.emit is not None:
                                self.dispatch([(seq.emit, [], StepFailed(f"decode step failed: {exc!r}"))])

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    def _drafts(self, batch: list[DecodeSequence]) -> list[list[int]]:
        """Each sequence's draft tokens for this step ([] for none): n-gram prompt lookup or the
        checkpoint's MTP module (--speculative), as many as its governor asks for and at most
        num_draft_tokens, never past the answer's max_tokens (nor so its KV would leave the
        reserved pages), and none once the step would exceed max_verify_rows rows."""
        cfg = self.config
        out: list[list[int]] = [[] for _ in batch]
        if cfg.speculative == "off":
            return out
        rows = len(batch)
        wanted: list[tuple[int, int]] = []  # (sequence, k) for the draft module
        for i, seq in enumerate(batch):
            room = min(cfg.num_draft_tokens, seq.max_tokens - seq.num_generated - 1, cfg.max_verify_rows - rows)
            k = seq.governor.num_drafts(max(0, room))
            if k < 1:
                continue
            if self._drafter is None:
                out[i] = propose_ngram(seq.token_ids, k)
                rows += len(out[i])
            else:
                wanted.append((i, k))
                rows += k
        if wanted:
            out = self._mtp_drafts(batch, wanted, out)
        return out

    def _mtp_drafts(
        self, batch: list[DecodeSequence], wanted: list[tuple[int, int]], out: list[list[int]]
    ) -> list[list[int]]:
        """k drafts for each (sequence, k) from the checkpoint's MTP module, in one batched pass
        over every pending pair and then k - 1 autoregressive ones (DeepseekV4MTP.propose)."""
        assert self._drafter is not None
        items = []
        for i, k in wanted:
            s = batch[i]
            assert s.mtp_pending is not None, s.request_id
            first = s.num_computed_tokens - s.mtp_pending.shape[0]
            tokens = s.token_ids[first + 1 : s.num_computed_tokens + 1]
            items.append(DraftItem(first, tokens, s.mtp_pending, s.block_ids, s.mtp_start, k))
        for (i, _), drafts in zip(wanted, self._drafter.propose_drafts(items)):
            out[i] = drafts
            batch[i].mtp_pending = None  # the module's K=V now covers them
        return out

    def _keep_mtp_pending(self, seq: DecodeSequence, hidden: torch.Tensor) -> None:
        """After a step: the target's streams at the positions it just computed ([n, N, H]) join
        the pairs the MTP module has yet to run over. Only the last sliding_window of them can
        reach the next draft, so older ones are dropped and the module's window starts after
        them (what it then computes is what keeping them all would give)."""
        pending = hidden if seq.mtp_pending is None else torch.cat([seq.mtp_pending, hidden])
        assert self._drafter is not None
        window = self._drafter.draft_window
        if pending.shape[0] > window:
            pending = pending[-window:]
            seq.mtp_start = seq.num_computed_tokens - window
        seq.mtp_pending = pending

    def calibrate(self) -> float:
        """Measure a verification row's cost relative to a plain one-row step (on page 0, whose
        contents are garbage until a request's KV lands there; with MTP drafts plus one pass of
        the module) and give it to new sequences' governors; returns it. --draft-row-cost, when
        set, is taken instead. Runs where steps run; a no-op without speculation."""
        if self.config.speculative == "off":
            return self.row_cost
        if self.config.draft_row_cost:
            self.row_cost = self.config.draft_row_cost
            return self.row_cost
        k = min(self.config.num_draft_tokens, self.config.page_size - 1)

        def timed(rows: int) -> float:
            # on a model with state slots each row writes a scratch slot of its own (garbage too)
            items = [
                ForwardItem([0], j, [0], self._scratch[j % len(self._scratch)] if self._scratch else None)
                for j in range(rows)
            ]
            self.runner.forward(items)  # warm
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                self.runner.forward(items)
                best = min(best, time.perf_counter() - t)
            return best

        one, more = timed(1), timed(1 + k)
        self.row_cost = max(0.05, (more - one) / (k * one))
        if self._drafter is not None:  # an MTP draft also costs a pass of the module
            hidden = self._drafter.last_hidden()[:1].clone()  # [1, N, H] garbage, as page 0 is
            item = DraftItem(0, [0], hidden, [0], 0, 1)
            self._drafter.propose_drafts([item])  # warm (and allocate its K=V)
            t = time.perf_counter()
            self._drafter.propose_drafts([item])
            self.row_cost += (time.perf_counter() - t) / one
        logger.info(
            "speculative decoding: a verification row costs %.2f of a one-row step (%d rows)", self.row_cost, 1 + k
        )
        return self.row_cost

    def _verify_items(
        self, batch: list[DecodeSequence], drafts: list[list[int]]
    ) -> tuple[list[ForwardItem], dict[int, list[int | None]]]:
        """The step's rows: a sequence with k drafts runs as k + 1 one-token rows at consecutive
        positions over its own pages. The step writes every row's K/V before any row attends, so
        row j sees the rows before it, and each row computes what a plain step at that position
        would. Where the model keeps per-request state beyond its pages (DeepSeek-V4's open
        compressor windows), row 0 writes the sequence's slot and row j > 0 a scratch slot,
        continuing row j-1's state (`ForwardItem.state_from`). Returns the rows and, per
        transfer id, each row's slot."""
        items: list[ForwardItem] = []
        row_slots: dict[int, list[int | None]] = {}
        scratch = iter(self._scratch)
        for s, d in zip(batch, drafts):
            slots: list[int | None] = [s.state_slot]
            for j, tok in enumerate([s.token_ids[-1], *d]):
                if j and s.state_slot is not None:
                    slots.append(next(scratch))
                items.append(
                    ForwardItem(
                        token_ids=[tok],
                        num_computed_tokens=s.num_computed_tokens + j,
                        block_ids=s.block_ids,
                        state_slot=slots[j] if s.state_slot is not None else None,
                        state_from=slots[j - 1] if j and s.state_slot is not None else None,
                    )
                )
            row_slots[s.transfer_id] = slots
        return items, row_slots

    def _step(self, batch: list[DecodeSequence]) -> None:
        started = time.perf_counter()
        cpu_started = time.process_time()
        drafts = self._drafts(batch)
        # a sequence with k drafts runs as k + 1 one-token rows at consecutive positions over its
        # own pages: the step writes every row's K/V before any row attends, so row j sees the
        # rows before it, and each row computes exactly what a plain step at that position would
        items, row_slots = self._verify_items(batch, drafts)
        logits = self.runner.forward(items)  # [rows, V]
        hidden = self._drafter.last_hidden() if self._drafter is not None else None  # [rows, N, H]
        if len(items) == len(batch):
            kept = [[t] for t in sample(logits, [s.sampling for s in batch], [s.generator for s in batch])]
        else:
            kept, row = [], 0
            for s, d in zip(batch, drafts):
                kept.append(verify_drafts(logits[row : row + len(d) + 1], d, s.sampling, s.generator))
                row += len(d) + 1
        step_s = time.perf_counter() - started
        metrics.STEP_CPU.observe(time.process_time() - cpu_started)
        metrics.STEPS.inc()
        deliveries: list[Delivery] = []
        with self._cond:
            self.num_steps += 1
            self.step_seconds += step_s
            self.max_batch_size_seen = max(self.max_batch_size_seen, len(batch))
            row = 0
            for seq, d, tokens in zip(batch, drafts, kept):
                first_row, row = row, row + len(d) + 1
                if seq.aborted:
                    continue  # freed by the next _schedule
                finish = None
                for n, token in enumerate(tokens, 1):  # stop at EOS or max_tokens, mid-run too
                    finish = self._finish_reason_after(seq, token, n)
                    if finish is not None:
                        tokens = tokens[:n]
                        break
                seq.token_ids.extend(tokens)
                seq.num_computed_tokens += len(tokens)
                if d and len(tokens) > 1 and seq.state_slot is not None:
                    # keep the state after the last accepted row; the rejected rows' scratch
                    # slots are simply reused, and what they wrote in the pages lies past the
                    # accepted length, rewritten before any later step reads it
                    kept_slot = row_slots[seq.transfer_id][len(tokens) - 1]
                    assert kept_slot is not None, seq.request_id
                    self.runner.copy_state_slot(kept_slot, seq.state_slot)
                if hidden is not None and finish is None:
                    self._keep_mtp_pending(seq, hidden[first_row : first_row + len(tokens)].clone())
                if d:
                    accepted = len(tokens) - 1
                    seq.drafts.drafted += len(d)
                    seq.drafts.accepted += accepted
                    seq.governor.record(len(d), accepted)
                    metrics.ACCEPTED.observe(accepted)
                assert seq.emit is not None, seq.request_id
                deliveries.append((seq.emit, tokens, finish))
                if finish is not None:
                    self._running.remove(seq)
                    self._free(seq)
        metrics.TOKENS.inc(sum(len(tokens) for _, tokens, _ in deliveries))
        # one hand-off per step, not one per request: each wake-up of the event loop
        # thread competes with this thread for the GIL between ops
        self.dispatch(deliveries)
