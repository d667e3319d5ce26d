"""Speculative decoding: drafters behind one interface (base.Drafter), picked by name.

`ngram` drafts by prompt lookup (any model); `mtp` by a DeepSeek-V4 checkpoint's own
multi-token-prediction module. `verify.Speculator` runs the drafts through decode's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.speculative.base import Drafter

if TYPE_CHECKING:
    from engine.forward import Runner

SPECULATIVE_METHODS = ("off", "ngram", "mtp")
"""--speculative choices."""


def _ngram(runner: Runner) -> Drafter:
    from engine.speculative.ngram import NgramDrafter

    return NgramDrafter()


def _mtp(runner: Runner) -> Drafter:
    from engine.speculative.mtp import MTPDrafter  # imported on use: it pulls in torch

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
