"""The sender's connections of the UCX KV push (kvstore/ucx_transfer.py): one cached pair of
endpoints per receiver address. The control endpoint comes from the receiver's listener
(host:port, TCP). The data endpoint, for a receiver on this host, is made from the UCX worker
address the receiver sends first (HELLO), so UCX may use shared memory; for a receiver on
another host it is the control endpoint itself (TCP, or RDMA where the listener's connection
manager has it).

Why not a worker-address endpoint across hosts: UCX connects its TCP lanes "to the interface"
(UCT_IFACE_FLAG_CONNECT_TO_IFACE) on such an endpoint and "to the endpoint" on one made through
a listener (ucp_wireup_connect_p2p, UCX v1.21.0 src/ucp/wireup/wireup.c). Destroying a connected
TCP endpoint of the first kind keeps it alive to receive and sends the peer a CONN_FIN
(uct_tcp_ep_destroy, src/uct/tcp/tcp_ep.c); the peer's CONN_FIN then destroys it inside
the read handler, and uct_tcp_iface_handle_events (src/uct/tcp/tcp_iface.c) goes on to call the
write handler of the freed endpoint when the socket was writable too: a use after free in
UCX's progress thread. The soak's prefill crashes (SIGSEGV in uct_tcp_iface_handle_events after
a peer froze or left mid-push; docs/operations.md "Known limits") match it; no UCX release
fixes it yet. Endpoints made through a listener take the other path (destroyed at once).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
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
            local = await asyncio.wait_for(on_this_host(host), timeout_s)  # a name lookup too is bounded
            ctrl = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout_s), timeout_s)
            data = await asyncio.wait_for(_data_endpoint(ctrl, local), max(0.0, deadline - time.monotonic()))
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
            for ep in {id(ep): ep for ep in pair}.values():  # one endpoint twice, for a remote receiver
                common.abort_endpoint(ep)  # idempotent; cancels the endpoint's outstanding requests

    def drop_all(self) -> None:
        for address in list(self.pairs):
            self.drop(address)


async def _data_endpoint(ctrl, local: bool) -> Any:
    """The endpoint pages go over: for a receiver on this host (`local`), one made from the
    worker address the receiver sends first (HELLO); else `ctrl` (the module docstring says
    why). HELLO is read either way."""
    length = np.empty(1, dtype="<u8")
    await ctrl.recv(length, tag=common._TAG_HELLO)
    if not 0 < int(length[0]) <= 1 << 16:
        raise RuntimeError(f"receiver sent a worker address of {int(length[0])} bytes")
    raw = np.empty(int(length[0]), dtype=np.uint8)
    await ctrl.recv(raw, tag=common._TAG_HELLO)
    if not local:
        return ctrl
    return await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(raw.tobytes()))


async def on_this_host(host: str) -> bool:
    """Whether `host` (a name or an IP) is an address of this host's network namespace: a
    loopback address, or one a socket here can bind. A name that does not resolve: False (the
    connect then fails on its own)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback:  # an IPv6 scope (%eth0) is not part of it
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
            return True
        except OSError:
            continue
    return False
