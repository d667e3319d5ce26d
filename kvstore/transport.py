"""The KV transport interface: how prefill pushes a request's pages into the pages a decode
instance reserved, whatever moves the bytes. UCX is the implementation (kvstore/ucx_transfer.py,
kvstore/ucx_receiver.py); `kvmesh.kvstore.transports` picks one by name.

The shape follows NIXL and Mooncake's transfer engine: the receiver registers destination
buffers under a transfer id (`expect`) and hands the sender its address; the sender pushes a
list of source buffers, buffer i into destination buffer i, and returns once the receiver
acknowledged every byte. A push may arrive a little before its `expect` (the gateway sends
Prefill while decode's Reserve is still in flight): the receiver holds it, for a bounded time,
until the transfer is expected or refused.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class TransferError(Exception):
    """A push failed: peer down, refused, timed out, or a protocol / size mismatch.

    The message names the address and the cause; servicers map it to gRPC UNAVAILABLE.
    """


@dataclass(frozen=True)
class TransferResult:
    """A completed push.

    Attributes:
        transfer_id: the id decode registered the pages under.
        num_buffers: pages moved.
        nbytes: bytes moved (sum of the page sizes).
        seconds: sender: connect (if needed) to ack; receiver: receives posted to last byte landed.
    """

    transfer_id: int
    num_buffers: int
    nbytes: int
    seconds: float


def pages_digest(buffers: Sequence[Any], layout: str) -> str:
    """SHA-256 (hex) over the page layout's description (kvmesh.engine.kv_layout.PageLayout.describe:
    its name, page shape and dtype), then page buffers in order (numpy arrays, or tensors on any
    device, read back to the host): proves pages arrived bitwise equal, in the layout and dtype
    both ends hold them in (the same bytes read as bf16 and as fp32 digest differently)."""
    h = hashlib.sha256(layout.encode() + b"\0")
    for buf in buffers:
        host = buf if isinstance(buf, np.ndarray) else buf.cpu().numpy()
        h.update(memoryview(host))  # type: ignore[arg-type]  # numpy arrays are buffers
    return h.hexdigest()


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (IPv6 hosts in brackets) -> (host, port); ValueError naming the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV receiver address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class KVPushSender(Protocol):
    """Prefill's end: pushes pages to receivers by address."""

    async def connect(self, address: str) -> None:
        """Connect ahead of the first push to `address` (a no-op when connected). Raises
        ValueError for a malformed address, TransferError when the receiver cannot be reached."""
        ...

    async def push(
        self, address: str, transfer_id: int, buffers: Sequence[np.ndarray], first: int = 0
    ) -> TransferResult:
        """Push `buffers` (C-contiguous uint8 pages, read zero-copy; keep them unchanged until
        this returns or raises) into the receiver's buffers first, first + 1, ... registered
        under `transfer_id`. A transfer may come in parts pushed in order, each starting where
        the last ended (chunked prefill pushes each chunk's pages as it completes them).

        Raises ValueError for a malformed address, id or `first`, TransferError when the push
        fails (refused, peer lost, stalled past the sender's timeout, size mismatch, a part out
        of order)."""
        ...

    async def close(self) -> None:
        """Abort every connection; pushes still running raise TransferError."""
        ...


class KVPushReceiver(Protocol):
    """Decode's end: a listener that lands pushes into registered buffers."""

    num_sent: int
    """Pushes whose pages the transport sent, since start."""
    num_pulled: int
    """Pushes this end copied from the sender's shared pool itself (same host), since start."""

    @property
    def address(self) -> str:
        """ "host:port" senders push to (valid after start())."""
        ...

    async def start(self) -> None:
        """Start listening."""
        ...

    def expect(self, transfer_id: int, buffers: Sequence[np.ndarray]) -> asyncio.Future:
        """Register writable destination buffers; the future resolves to a TransferResult when
        every byte landed (in one push or in parts), or raises TransferError. Raises ValueError
        for a duplicate id."""
        ...

    def cancel(self, transfer_id: int) -> None:
        """Forget `transfer_id`: a push in progress is cut off, a later one NACKed."""
        ...

    def refuse(self, transfer_id: int) -> None:
        """No `expect` will come for `transfer_id` (its Reserve was refused): a push for it,
        waiting for its reservation or yet to come, is NACKed at once."""
        ...

    async def close(self) -> None:
        """Stop listening and fail every expected transfer."""
        ...
