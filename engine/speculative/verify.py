# B=requests of the step, V=vocab, N=hyper-connection streams, H=hidden
"""Speculative decoding in decode's step: how many drafts each request carries, the verification
rows they become, and what a step keeps of them (Leviathan et al. 2023; vLLM's and SGLang's
batched verification).

A request with k drafts runs as k + 1 one-token rows at consecutive positions over its own pages.
The step writes every row's K/V before any row attends, so row j sees the rows before it, and
each row computes what a plain step at that position would. Where the model keeps per-request
state beyond its pages (DeepSeek-V4's open compressor windows), row 0 writes the request's slot
and row j > 0 a scratch slot continuing row j-1's state (`ForwardItem.state_from`); the step
then keeps the state of the last accepted row, so rejected drafts leave nothing behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.forward import ForwardItem, Runner
from kvmesh.engine.request import Request
from kvmesh.engine.sampler import sample, verify_drafts
from kvmesh.engine.speculative.base import Drafter
from kvmesh.engine.speculative.governor import SpeculationGovernor

logger = logging.getLogger(__name__)


@dataclass
class StepRows:
    """One step's rows: the forward items, each request's drafts, its rows' state slots, and the
    index of its first row (its rows are starts[i] .. starts[i] + len(drafts[i]))."""

    items: list[ForwardItem]
    drafts: list[list[int]]
    slots: list[list[int | None]]
    starts: list[int]


class Speculator:
    """Drafts and verification for decode's batch; with drafter None every request runs as one
    row and drafts nothing (plain decoding through the same code).

    scratch_slots: state slots set aside for verification rows (runners with state slots);
    num_draft_tokens: most drafts a request carries; max_verify_rows: most rows a step runs;
    row_cost: a verification row's cost relative to a one-row step (0: measure it, `calibrate`).
    """

    def __init__(
        self,
        drafter: Drafter | None,
        runner: Runner,
        scratch_slots: Sequence[int] = (),
        num_draft_tokens: int = 0,
        max_verify_rows: int = 1 << 30,
        row_cost: float = 0.0,
    ) -> None:
        self.drafter, self.runner = drafter, runner
        self.scratch_slots = list(scratch_slots)
        self.num_draft_tokens, self.max_verify_rows = num_draft_tokens, max_verify_rows
        self.configured_cost = row_cost
        self.row_cost = row_cost or 0.35
        self._governors: dict[int, SpeculationGovernor] = {}

    def start(self, request: Request) -> None:
        """A request joins the batch: a governor of its own, and the drafter's state."""
        if self.drafter is not None:
            self._governors[id(request)] = SpeculationGovernor(row_cost=self.row_cost)
            self.drafter.start(request)

    def forget(self, request: Request) -> None:
        """The request left the batch."""
        self._governors.pop(id(request), None)

    def rows(self, batch: Sequence[Request]) -> StepRows:
        """Each request's drafts (as many as its governor asks for, at most num_draft_tokens,
        never past its max_tokens, none once the step would exceed max_verify_rows) and the rows
        that verify them."""
        drafts: list[list[int]] = [[] for _ in batch]
        if self.drafter is not None:
            rows, wanted = len(batch), []
            for i, r in enumerate(batch):
                room = min(self.num_draft_tokens, r.max_tokens - r.num_generated - 1, self.max_verify_rows - rows)
                k = self._governors[id(r)].num_drafts(max(0, room))
                if k < 1:
                    continue
                if self.drafter.batched:  # drafted together below; k rows counted now
                    wanted.append((i, k))
                    rows += k
                else:  # drafted here, so later requests' room counts the drafts really found
                    drafts[i] = self.drafter.propose([r], [k])[0]
                    rows += len(drafts[i])
            if wanted:
                proposed = self.drafter.propose([batch[i] for i, _ in wanted], [k for _, k in wanted])
                for (i, _), d in zip(wanted, proposed):
                    drafts[i] = d
        items: list[ForwardItem] = []
        slots: list[list[int | None]] = []
        starts: list[int] = []
        scratch = iter(self.scratch_slots)
        for r, d in zip(batch, drafts):
            starts.append(len(items))
            own: list[int | None] = [r.state_slot]
            for j, tok in enumerate([r.last_token, *d]):
                if j and r.state_slot is not None:
                    own.append(next(scratch))
                stateful = r.state_slot is not None
                items.append(
                    ForwardItem(
                        token_ids=[tok],
                        num_computed_tokens=r.num_computed_tokens + j,
                        block_ids=r.block_ids,
                        state_slot=own[j] if stateful else None,
                        state_from=own[j - 1] if j and stateful else None,
                    )
                )
            slots.append(own)
        return StepRows(items, drafts, slots, starts)

    def sample(self, batch: Sequence[Request], rows: StepRows, logits: torch.Tensor) -> list[list[int]]:
        """The tokens each request keeps from the step's logits [rows, V]: one sampled token
        without drafts; with them, the accepted drafts plus the target's next token."""
        if len(rows.items) == len(batch):
            return [[t] for t in sample(logits, [r.sampling for r in batch], [r.generator for r in batch])]
        kept, row = [], 0
        for r, d in zip(batch, rows.drafts):
            kept.append(verify_drafts(logits[row : row + len(d) + 1], d, r.sampling, r.generator))
            row += len(d) + 1
        return kept

    def hidden(self) -> torch.Tensor | None:
        """[rows, N, H] the target's streams of the last step, for a drafter that reads them."""
        if self.drafter is None or not self.drafter.needs_hidden:
            return None
        return self.runner.last_hidden()  # type: ignore[attr-defined]

    def keep(self, request: Request, i: int, rows: StepRows, tokens: list[int], hidden: torch.Tensor | None) -> int:
        """After the step kept `tokens` of request i (already appended): keep the state of its
        last accepted row, hand the drafter its rows' streams, count the drafts. hidden: the
        step's streams ([rows, N, H], `hidden()`), None when the request finished or no drafter
        reads them. Returns the drafts accepted."""
        d = rows.drafts[i]
        if d and len(tokens) > 1 and request.state_slot is not None:
            # the rejected rows' scratch slots are simply reused, and what they wrote in the pages
            # lies past the accepted length, rewritten before any later step reads it
            kept_slot = rows.slots[i][len(tokens) - 1]
            assert kept_slot is not None, request.request_id
            self.runner.copy_state_slot(kept_slot, request.state_slot)
        if hidden is not None and self.drafter is not None:
            first = rows.starts[i]
            self.drafter.after_step(request, hidden[first : first + len(tokens)].clone())
        if not d:
            return 0
        accepted = len(tokens) - 1
        request.num_drafted += len(d)
        request.num_accepted += accepted
        self._governors[id(request)].record(len(d), accepted)
        return accepted

    def calibrate(self, page_size: int) -> float:
        """Measure a verification row's cost relative to a plain one-row step (on page 0, whose
        contents are garbage until a request's KV lands there; a drafting pass on top) and give
        it to new requests' governors; returns it. A configured cost is taken instead. Runs
        where steps run; a no-op without a drafter."""
        if self.drafter is None:
            return self.row_cost
        if self.configured_cost:
            self.row_cost = self.configured_cost
            return self.row_cost
        k = min(self.num_draft_tokens, page_size - 1)
        scratch = self.scratch_slots

        def timed(n: int) -> float:
            # on a model with state slots each row writes a scratch slot of its own (garbage too)
            items = [ForwardItem([0], j, [0], scratch[j % len(scratch)] if scratch else None) for j in range(n)]
            self.runner.forward(items)  # warm
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                self.runner.forward(items)
                best = min(best, time.perf_counter() - t)
            return best

        one, more = timed(1), timed(1 + k)
        self.row_cost = max(0.05, (more - one) / (k * one)) + self.drafter.pass_seconds() / one
        logger.info(
            "speculative decoding: a verification row costs %.2f of a one-row step (%d rows)", self.row_cost, 1 + k
        )
        return self.row_cost
