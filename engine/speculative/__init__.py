"""Speculative decoding: drafters behind one interface (base.Drafter), picked by name.

`ngram` drafts by prompt lookup (any model); `mtp` by a DeepSeek-V4 checkpoint's own
multi-token-prediction module. `verify.Speculator` runs the drafts through decode's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.engine.speculative.base import Drafter

if TYPE_CHECKING:
    from kvmesh.engine.forward import Runner
    from kvmesh.engine.kv_cache import KVCacheManager
    from kvmesh.engine.speculative.verify import Speculator

SPECULATIVE_METHODS = ("off", "ngram", "mtp")
"""--speculative choices."""


def _ngram(runner: Runner) -> Drafter:
    from kvmesh.engine.speculative.ngram import NgramDrafter

    return NgramDrafter()


def _mtp(runner: Runner) -> Drafter:
    from kvmesh.engine.speculative.mtp import MTPDrafter  # imported on use: it pulls in torch

    return MTPDrafter(runner)


DRAFTERS: dict[str, Callable[[Runner], Drafter]] = {"ngram": _ngram, "mtp": _mtp}
"""--speculative name -> builder(runner)."""


def create_drafter(name: str, runner: Runner) -> Drafter | None:
    """The drafter `name` names for `runner` (None for "off"). Raises ValueError for an unknown
    name (naming the known ones) or one the runner cannot serve (mtp without an MTP module)."""
    if name == "off":
        return None
    if name not in DRAFTERS:
        raise ValueError(f"speculative must be one of {list(SPECULATIVE_METHODS)}, got {name!r}")
    return DRAFTERS[name](runner)


def create_speculator(
    name: str,
    runner: Runner,
    kv_cache: KVCacheManager,
    max_requests: int,
    num_scratch_slots: int,
    num_draft_tokens: int = 0,
    max_verify_rows: int = 1 << 30,
    row_cost: float = 0.0,
) -> Speculator:
    """Decode's `verify.Speculator` with the drafter `name` ("off": plain decoding). A runner
    with state slots (DeepSeek-V4) sets num_scratch_slots of them aside in kv_cache for the
    verification rows. Raises ValueError when it has fewer than max_requests + num_scratch_slots
    slots, or as create_drafter does."""
    from kvmesh.engine.speculative.verify import Speculator  # imported on use: it pulls in torch

    scratch: list[int] = []
    if name != "off" and runner.num_state_slots:
        if runner.num_state_slots < max_requests + num_scratch_slots:
            raise ValueError(
                f"--speculative {name} needs {max_requests + num_scratch_slots} state slots (one a "
                f"request and {num_scratch_slots} for verification rows), the runner has "
                f"{runner.num_state_slots}"
            )
        scratch = kv_cache.hold_scratch_slots(num_scratch_slots)
    drafter = create_drafter(name, runner)
    return Speculator(drafter, runner, scratch, num_draft_tokens, max_verify_rows, row_cost)
