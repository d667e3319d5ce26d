"""KV transport by name -> its sender and receiver (the interface is kvstore/transport.py).
Add a transport by adding its builders here; `--kv-transport` on prefill and decode picks one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh.kvstore.transport import KVPushReceiver, KVPushSender


def _ucx_sender(**options: Any) -> KVPushSender:
    from kvmesh.kvstore.ucx_transfer import KVSender  # imported on use: `import ucxx` alone takes ~0.6 s

    return KVSender(**options)


def _ucx_receiver(host: str, port: int) -> KVPushReceiver:
    from kvmesh.kvstore.ucx_receiver import KVReceiver

    return KVReceiver(host, port)


TRANSPORTS: dict[str, tuple[Callable[..., KVPushSender], Callable[[str, int], KVPushReceiver]]] = {
    "ucx": (_ucx_sender, _ucx_receiver),
}
"""Transport name -> (sender builder(**options), receiver builder(host, port))."""


def _ucx_keep_until_exit() -> None:
    from kvmesh.kvstore.ucx_common import keep_until_exit

    keep_until_exit()


_KEEPERS: dict[str, Callable[[], None]] = {"ucx": _ucx_keep_until_exit}
"""Transport name -> what keeps its process-wide state until the process exits."""


def check_transport(name: str) -> None:
    """Raise ValueError naming the known transports when `name` is not one of them."""
    if name not in TRANSPORTS:
        raise ValueError(f"KV transport must be one of {list(TRANSPORTS)}, got {name!r}")


def create_sender(name: str = "ucx", **options: Any) -> KVPushSender:
    """A sender of transport `name`; options go to its constructor (UCX: connect_timeout_s and
    transfer_timeout_s, in seconds). Raises ValueError for an unknown transport."""
    check_transport(name)
    return TRANSPORTS[name][0](**options)


def keep_until_exit(name: str = "ucx") -> None:
    """Transport `name` keeps its process-wide state when its last sender or receiver closes
    (UCX: kvmesh.kvstore.ucx_common.keep_until_exit): call it in a process that leaves with os._exit.
    Raises ValueError for an unknown transport."""
    check_transport(name)
    _KEEPERS[name]()


def create_receiver(name: str = "ucx", host: str = "127.0.0.1", port: int = 0) -> KVPushReceiver:
    """A receiver of transport `name` listening on host:port (0: a free port); call start().
    Raises ValueError for an unknown transport."""
    check_transport(name)
    return TRANSPORTS[name][1](host, port)
