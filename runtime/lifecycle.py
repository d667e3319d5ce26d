"""One life cycle for every kvmesh service process: start, register, serve, drain, leave, stop.

    def main(args):                                   # `kvmesh serve <name>`
        lifecycle.main("prefill", PrefillConfig, args, serve)

    async def serve(config, stop, executor):
        svc = service.Service([...], config.host, config.port)
        ...                                           # the service's own parts
        life = Lifecycle(svc, config.drain_grace_s)
        await life.start()                            # the port opens, health NOT_SERVING
        ...                                           # warm-up
        await life.serve(stop, banner, registration, release=[engine.shutdown, sender.close])

The order is the one STYLE.md names: register once warm, report SERVING, and on SIGTERM
leave the registry first (gateways stop routing here), stop admitting on every front at once,
give in-flight work the drain grace period, then release resources in the order given and
flush the traces. Prefill and decode take their start-up steps through
kvmesh.runtime.model_start.ModelStart, whose `open_ports` makes and starts their Lifecycle.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from kvmesh.runtime import service, settings, tracing
from kvmesh.runtime.registration import Registration

logger = logging.getLogger(__name__)


class Front(Protocol):
    """A second way in beside the gRPC server (the gateway's HTTP API)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Lifecycle:
    """Start, serve and stop one service's gRPC server (and its other fronts) in one order.

    Args:
        svc: the gRPC server with its health service.
        drain_grace_s: seconds in-flight RPCs (and HTTP answers) get once admitting stops.
        fronts: other servers started after and stopped with the gRPC server.
    """

    def __init__(self, svc: service.Service, drain_grace_s: float, fronts: Sequence[Front] = ()) -> None:
        self.svc = svc
        self.drain_grace_s = drain_grace_s
        self.fronts = list(fronts)

    async def start(self) -> None:
        """Open the ports; health says NOT_SERVING until `serve` (the model warms meanwhile)."""
        await self.svc.start()
        for front in self.fronts:
            await front.start()

    async def serve(
        self,
        stop: asyncio.Event,
        banner: str,
        registration: Registration | None = None,
        release: Sequence[Callable[[], Awaitable[Any] | Any]] = (),
        drain: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """Register, report SERVING, print `banner`, serve until `stop` is set, then drain and stop.

        release: what to let go once the servers stopped (engines, transports, clients), in
        this order; each a plain or an async callable.
        drain: awaited after leaving the registry and before the servers stop admitting, with
        the seconds left of the grace period: work the service promised and whose RPC is still
        to come (decode's reservations, claimed by a Generate after the push) comes in meanwhile.
        """
        self.svc.admit()  # before registering: a gateway that reads the record finds it admitting
        if registration is not None:
            registration.start()
        await self.svc.mark_serving()
        print(banner, flush=True)
        await stop.wait()
        logger.info("shutting down")
        if registration is not None:
            await registration.leave()  # gateways stop routing here while in-flight work finishes
        grace_s = self.drain_grace_s
        if drain is not None:
            started = time.monotonic()
            await self.svc.health.enter_graceful_shutdown()  # NOT_SERVING, the port still open
            await drain(grace_s)
            grace_s = max(0.0, grace_s - (time.monotonic() - started))
        # every front stops admitting at once, then in-flight answers get the rest of the grace period
        await asyncio.gather(self.svc.stop(grace_s=grace_s), *(f.stop() for f in self.fronts))
        for close in release:
            result = close()
            if inspect.isawaitable(result):
                await result
        tracing.shutdown_tracing()


def main(
    name: str,
    config_cls: type,
    args: argparse.Namespace,
    serve: Callable[[Any, asyncio.Event, service.MainThreadExecutor], Awaitable[None]],
) -> None:
    """`kvmesh serve <name>`: logging and tracing for service `name`, its config (`config_cls`)
    from `args` and KVMESH_* variables, then `serve(config, stop, executor)` on the event-loop
    thread while the main thread runs the model (kvmesh.runtime.service.run).

    Raises ValueError from the config's validation, and whatever `serve` raised."""
    service.setup_logging(name)
    tracing.setup_tracing(f"kvmesh-{name}")
    config = settings.from_args(config_cls, args)
    service.run(lambda stop, executor: serve(config, stop, executor))
