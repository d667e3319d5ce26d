# N=hyper-connection streams, H=hidden
"""Draft tokens from a DeepSeek-V4 checkpoint's own multi-token-prediction module
(`--speculative mtp`; kvmesh.engine.deepseek_v4.mtp, checkpoints with mtp.* tensors)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvmesh.engine.forward import DraftingRunner, DraftItem, Runner
from kvmesh.engine.request import Request
from kvmesh.engine.speculative.base import Drafter


@dataclass
class MTPState:
    """What the MTP drafter keeps for one request."""

    pending: torch.Tensor | None
    """[n, N, H] the target's streams at the last n computed positions, which the MTP module has
    not run over yet (its next drafting pass starts with them)."""
    window_start: int
    """The first position whose MTP K=V this request wrote."""


class MTPDrafter(Drafter):
    """Drafts with the runner's MTP module: one batched pass over every pending pair, then k - 1
    autoregressive ones (DeepseekV4MTP.propose). Raises ValueError for a runner without one."""

    name = "mtp"
    batched = True
    needs_hidden = True

    def __init__(self, runner: Runner) -> None:
        if not getattr(runner, "has_mtp", False):
            raise ValueError(
                "--speculative mtp needs a DeepSeek-V4 checkpoint that carries its multi-token-prediction "
                "module (mtp.* tensors); use --speculative ngram for this model"
            )
        self.runner = cast(DraftingRunner, runner)

    def start(self, request: Request) -> None:
        # the pushed slot ends on the prompt's last streams: MTP's first pending pair
        assert request.state_slot is not None, request.request_id
        pending = self.runner.slot_hidden(request.state_slot)[None]  # [1, N, H]
        request.draft_state = MTPState(pending, request.num_prompt_tokens - 1)

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        items = []
        for r, k in zip(requests, ks):
            state = cast(MTPState, r.draft_state)
            assert state.pending is not None, r.request_id
            first = r.num_computed_tokens - state.pending.shape[0]
            tokens = r.token_ids[first + 1 : r.num_computed_tokens + 1]
            items.append(DraftItem(first, tokens, state.pending, r.block_ids, state.window_start, k))
        drafts = self.runner.propose_drafts(items)
        for r in requests:
            cast(MTPState, r.draft_state).pending = None  # the module's K=V now covers them
        return drafts

    def after_step(self, request: Request, hidden: torch.Tensor) -> None:
        """The streams the step computed join the pairs the module has yet to run over. Only the
        last sliding window of them can reach the next draft, so older ones are dropped and the
        module's window starts after them (what it then computes is what keeping them all gives)."""
        state = cast(MTPState, request.draft_state)
        pending = hidden if state.pending is None else torch.cat([state.pending, hidden])
        window = self.runner.draft_window
        if pending.shape[0] > window:
            pending = pending[-window:]
            state.window_start = request.num_computed_tokens - window
        state.pending = pending

    def pass_seconds(self) -> float:
        """One pass of the module on page 0 (garbage until a request's KV lands there)."""
        hidden = self.runner.last_hidden()[:1].clone()  # [1, N, H] garbage, as page 0 is
        item = DraftItem(0, [0], hidden, [0], 0, 1)
        self.runner.propose_drafts([item])  # warm (and allocate its K=V)
        t = time.perf_counter()
        self.runner.propose_drafts([item])
        return time.perf_counter() - t
