"""The sender's connections of the UCX KV push (kvstore/ucx_transfer.py): one cached pair of
endpoints per receiver address. The control endpoint comes from the receiver's listener
(host:port, TCP); the data endpoint is made from the UCX worker address the receiver sends first
(HELLO), so UCX may choose every transport the two share (shared memory and CMA on one host,
TCP or RDMA across hosts)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import ucxx
from ucxx.exceptions import UCXError

import kvmesh.kvstore.ucx_common as common
from kvmesh.kvstore.transport import TransferError


class SenderEndpoints:
    """The (control, data) endpoints to each receiver address, connected on first use and
    reconnected when either one closed."""

    def __init__(self) -> None:
        self.pairs: dict[str, tuple[Any, Any]] = {}  # address -> (control, data) endpoints

    async def get(self, address: str, host: str, port: int, timeout_s: float) -> tuple[Any, Any]:
        """The (control, data) endpoints to `address`, connected now unless cached and open, both
        within timeout_s seconds. Raises TransferError when it cannot connect."""
        cached = self.pairs.get(address)
        if cached is not None and not cached[0].closed and not cached[1].closed:
            return cached
        self.drop(address)
        ctrl = None
        deadline = time.monotonic() + timeout_s  # both endpoints within the bound
        try:
            ctrl = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s)
            data = await asyncio.wait_for(_data_endpoint(ctrl), max(0.0, deadline - time.monotonic()))
        except (UCXError, TimeoutError, OSError, RuntimeError) as exc:
            # a bad host: UCXError at once. Nobody listening, or a listener that is closed
            # but whose process lives: TimeoutError after connect_timeout_s (with Python
            # futures on, ucxx does not surface the refused connect before its timeout).
            if ctrl is not None:
                common.abort_endpoint(ctrl)
            raise TransferError(f"cannot connect to KV receiver at {address}: {exc!r}") from exc
        self.pairs[address] = (ctrl, data)
        return ctrl, data

    def drop(self, address: str) -> None:
        """Abort the endpoints to `address`, if any: every request still on them is cancelled."""
        pair = self.pairs.pop(address, None)
        if pair is not None:
            for ep in pair:
                common.abort_endpoint(ep)  # idempotent; cancels the endpoint's outstanding requests

    def drop_all(self) -> None:
        for address in list(self.pairs):
            self.drop(address)


async def _data_endpoint(ctrl) -> Any:
    """An endpoint made from the worker address the receiver sends first (HELLO)."""
    length = np.empty(1, dtype="<u8")
    await ctrl.recv(length, tag=common._TAG_HELLO)
    if not 0 < int(length[0]) <= 1 << 16:
        raise RuntimeError(f"receiver sent a worker address of {int(length[0])} bytes")
    raw = np.empty(int(length[0]), dtype=np.uint8)
    await ctrl.recv(raw, tag=common._TAG_HELLO)
    return await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(raw.tobytes()))
