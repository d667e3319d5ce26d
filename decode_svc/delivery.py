"""How decode's tokens and failures leave the engine thread: each step's deliveries go out in
one hand-off (`DispatchFn`), and the errors a request can end with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvmesh.engine.request import EmitFn, Ending
from kvmesh.engine.sampling_params import TokenLogprobs

# One step's deliveries [(emit, token ids, ending, their logprobs or None)]; a DispatchFn runs
# them where the emit functions may run (the service hands the whole list to its event loop in
# one call).
Delivery = tuple[EmitFn, list[int], Ending, list[TokenLogprobs] | None]
DispatchFn = Callable[[list[Delivery]], object]


def deliver_all(deliveries: list[Delivery]) -> None:
    """Run each (emit, token ids, ending, logprobs) delivery in order, here."""
    for emit, tokens, ending, logprobs in deliveries:
        emit(tokens, ending, logprobs)


def deliver_on(loop: asyncio.AbstractEventLoop) -> DispatchFn:
    """A DispatchFn that runs each step's deliveries on `loop`, in one call_soon_threadsafe: each
    wake-up of the loop's thread competes with the engine thread for the GIL between ops."""
    return lambda deliveries: loop.call_soon_threadsafe(deliver_all, deliveries)


class CapacityError(RuntimeError):
    """No room for another request (batch slots or pages); maps to RESOURCE_EXHAUSTED."""


class StepFailed(RuntimeError):
    """The model step a request was in raised; the request ends with INTERNAL."""


class InstanceBroken(StepFailed):
    """The step failed because this instance cannot step any more (its expert-parallel world
    lost a rank); the request ends with INSTANCE_LOST (UNAVAILABLE: another instance can serve
    a retry)."""


class RequestReleased(RuntimeError):
    """The request was released (its caller left, or Release was called) while a Generate
    call streamed it; that call ends with CANCELLED."""
