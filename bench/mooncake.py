"""Mooncake Transfer Engine's TCP transport between two processes, the peer `kvmesh bench-transfer`
prints beside kvmesh's push (PyPI `mooncake-transfer-engine-non-cuda`, which needs Debian's
`libibverbs1`; an optional benchmark extra, never a dependency of the product or its tests).

The receiver registers one pool per shape; the sender registers its own pages and writes page i
into the receiver's page i with one `batch_transfer_sync_write` (Mooncake's scatter-gather
write), the way a prefill would push a request's pages. The peer is found by Mooncake's
P2P handshake (no metadata server). API: Mooncake's Python `TransferEngine`
(doc/en/transfer-engine-python.md in kvcache-ai/Mooncake).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    return engine


def _receiver(conn, shapes: dict[str, tuple[int, int]]) -> None:
    engine = _engine()
    pools = {name: np.zeros(n * size, dtype=np.uint8) for name, (n, size) in shapes.items()}
    for pool in pools.values():
        if engine.register_memory(pool.ctypes.data, pool.nbytes) != 0:
            raise RuntimeError("Mooncake register_memory failed")
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", {name: pool.ctypes.data for name, pool in pools.items()}))
    while (msg := conn.recv()) is not None:
        shape, fill = msg
        conn.send(bool((pools[shape][::4096] == fill).all()))


def run(shapes: dict[str, tuple[int, int]], rounds: int) -> dict[str, float]:
    """shape -> median GB/s of `rounds` pushes (after one warm-up push) of `shapes[shape]`
    = (pages, bytes a page), from this process into a receiver process. Raises RuntimeError
    when Mooncake fails to initialize, register or transfer."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, shapes), daemon=True)
    proc.start()
    try:
        session, remote = parent.recv()
        engine = _engine()
        out = {}
        for shape, (n, size) in shapes.items():
            src = np.empty(n * size, dtype=np.uint8)
            if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
                raise RuntimeError("Mooncake register_memory failed")
            local = [src.ctypes.data + i * size for i in range(n)]
            peer = [remote[shape] + i * size for i in range(n)]
            times = []
            for r in range(rounds + 1):
                fill = (r + 1) % 251
                src[:] = fill
                start = time.perf_counter()
                if engine.batch_transfer_sync_write(session, local, peer, [size] * n) != 0:
                    raise RuntimeError("Mooncake batch_transfer_sync_write failed")
                times.append(time.perf_counter() - start)
                parent.send((shape, fill))
                if not parent.recv():
                    raise RuntimeError("Mooncake: bytes differ on landing")
            engine.unregister_memory(src.ctypes.data)
            out[shape] = n * size / statistics.median(times[1:]) / 1e9
        return out
    finally:
        parent.send(None)
        proc.join(timeout=30)
