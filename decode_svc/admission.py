"""How a request comes into the decode engine's batch: reserved, begun, admitted.

    Reserve -> RESERVED (pages held, the KV push may land; decode_svc/transfers.py: LANDED,
    CLAIMED) -> begin -> WAITING (its KV landed, its stream attached) -> admitted -> RUNNING

`reserve` takes pages for the prompt's KV and every token the answer can add, for each of its
n choices, and enters the request into the table (decode_svc/table.py) under its transfer id;
`begin_choices` starts each choice after prefill's first token and queues it; the loop
(decode_svc/engine.py) admits at most `max_admit_per_step` queued choices a step, while the
running batch has room.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import torch

from kvmesh.decode_svc.delivery import CapacityError
from kvmesh.decode_svc.table import RequestTable
from kvmesh.engine.grammar import GrammarState
from kvmesh.engine.request import EmitFn, Request, RequestStatus
from kvmesh.engine.sampling_params import MAX_CHOICES, SamplingParams
from kvmesh.kvstore.block_hash import BlockHash, check_block_hashes

logger = logging.getLogger(__name__)


class Admission(RequestTable):
    """The way into the table and the running batch (module docstring); the arguments are
    RequestTable's."""

    # --- reserving -------------------------------------------------------------------

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
        _check_transfer_id_and_n(transfer_id, n)
        check_block_hashes(block_hashes, num_prompt_tokens, self.config.page_size)
        request = Request(
            request_id,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            status=RequestStatus.RESERVED,
            block_hashes=list(block_hashes) or None,
        )
        with self._cond:
            self._check_room(transfer_id, n)
            self._take_pages(request, block_hashes if reuse_cached else (), n)
            self._enter(request, transfer_id, n)
        logger.info(
            "[%s] reserved %d pages, %d of them held already (transfer %x)",
            request_id,
            len(request.block_ids),
            request.num_reused_pages,
            request.transfer_id,
        )
        return request

    def _check_room(self, transfer_id: int, n: int) -> None:
        """Under the lock: the transfer id is free and the batch has room for n more sequences.
        Raises ValueError (an id in use, more choices than the batch holds) or CapacityError."""
        if transfer_id in self._requests:
            raise ValueError(f"transfer_id {transfer_id:x} is in use; pick another")
        if self._num_sequences + n > self.config.max_batch_size:
            if n > self.config.max_batch_size:
                raise ValueError(f"n is {n}, more than this decode's batch of {self.config.max_batch_size}")
            raise CapacityError(f"decode batch is full ({self.config.max_batch_size} sequences); retry later")

    def _take_pages(self, request: Request, reuse: Sequence[BlockHash], n: int) -> None:
        """Under the lock: the request's pages, reusing the cached ones of the leading `reuse`
        hashes, then its further choices' (all or nothing). Raises CapacityError."""
        self.kv_cache.allocate(
            request,
            request.num_prompt_tokens + request.max_tokens - 1,
            CapacityError,
            # never the page of the last prompt token: the push always carries it (as prefill
            # recomputes that token rather than reuse its block)
            reuse=reuse[: (request.num_prompt_tokens - 1) // self.config.page_size],
        )
        if n > 1:
            self._reserve_choices(request, n)

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

    def _enter(self, request: Request, transfer_id: int, n: int) -> None:
        """Under the lock: the request (with its pages) into the table under `transfer_id`, or
        (0) an unused random one, and its n sequences counted against the batch."""
        while not transfer_id or transfer_id in self._requests:
            transfer_id = random.getrandbits(63)
        request.transfer_id = transfer_id
        for c in request.choices or ():
            c.transfer_id = transfer_id
        self._requests[transfer_id] = request
        self._num_sequences += n

    # --- beginning: the KV landed and a Generate call attached ------------------------

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
                self._queue(c)
            self._cond.notify_all()
            return r

    def _queue(self, c: Request) -> None:
        """Under the lock: a choice that began waits for admission, or ends now when its first
        token already finished the answer."""
        if not c.sampling.greedy:  # prefill sampled the first token with the seed; go on with another stream
            c.generator = torch.Generator().manual_seed(((c.sampling.seed or 0) + 1) % 2**63)
        if c.finish is not None:
            assert c.emit is not None
            c.emit([], c.finish, None)
            self._free(c)
            return
        self.speculator.start(c)
        c.status = RequestStatus.WAITING
        self._waiting.append(c)

    # --- admitting, on the engine thread between steps --------------------------------

    def _admit(self) -> None:
        """Under the lock: move queued choices into the running batch, at most
        max_admit_per_step of them and while the batch has room."""
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


def _check_transfer_id_and_n(transfer_id: int, n: int) -> None:
    """A Reserve's transfer id and number of choices are in range; ValueError says which is not."""
    if not 0 <= transfer_id < 1 << 63:
        raise ValueError(f"transfer_id must be in [0, 2^63), got {transfer_id}")
    if not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
