"""KV transport by name -> its sender, its receiver and its process-wide keeper (the interface
is kvstore/transport.py). Add a transport by adding its record here; `--kv-transport` on
prefill and decode picks one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.kvstore.transport import KVPushReceiver, KVPushSender


@dataclass(frozen=True)
class Transport:
    """What the mesh needs of one KV transport, each part built on use."""

    sender: Callable[..., KVPushSender]
    """Builds a sender from keyword options (UCX: connect_timeout_s, transfer_timeout_s)."""
    receiver: Callable[[str, int], KVPushReceiver]
    """Builds a receiver listening on (host, port); port 0 picks a free one."""
    keep_until_exit: Callable[[], None]
    """Keeps the transport's process-wide state until the process exits."""


def _ucx_sender(**options: Any) -> KVPushSender:
    from kvmesh.kvstore.ucx_transfer import KVSender  # imported on use: `import ucxx` alone takes ~0.6 s

    return KVSender(**options)


def _ucx_receiver(host: str, port: int) -> KVPushReceiver:
    from kvmesh.kvstore.ucx_receiver import KVReceiver

    return KVReceiver(host, port)


def _ucx_keep_until_exit() -> None:
    from kvmesh.kvstore.ucx_common import keep_until_exit

    keep_until_exit()


TRANSPORTS: dict[str, Transport] = {
    "ucx": Transport(sender=_ucx_sender, receiver=_ucx_receiver, keep_until_exit=_ucx_keep_until_exit),
}
"""Transport name -> its record."""


def get_transport(name: str) -> Transport:
    """The record of transport `name`. Raises ValueError naming the known transports when
    `name` is not one of them."""
    if name not in TRANSPORTS:
        raise ValueError(f"KV transport must be one of {list(TRANSPORTS)}, got {name!r}")
    return TRANSPORTS[name]


def check_transport(name: str) -> None:
    """Raise ValueError naming the known transports when `name` is not one of them."""
    get_transport(name)


def create_sender(name: str = "ucx", **options: Any) -> KVPushSender:
    """A sender of transport `name`; options go to its constructor (UCX: connect_timeout_s and
    transfer_timeout_s, in seconds). Raises ValueError for an unknown transport."""
    return get_transport(name).sender(**options)


def keep_until_exit(name: str = "ucx") -> None:
    """Transport `name` keeps its process-wide state when its last sender or receiver closes
    (UCX: kvmesh.kvstore.ucx_common.keep_until_exit): call it in a process that leaves with os._exit.
    Raises ValueError for an unknown transport."""
    get_transport(name).keep_until_exit()


def create_receiver(name: str = "ucx", host: str = "127.0.0.1", port: int = 0) -> KVPushReceiver:
    """A receiver of transport `name` listening on host:port (0: a free port); call start().
    Raises ValueError for an unknown transport."""
    return get_transport(name).receiver(host, port)
