"""`kvmesh bench-transfer`: the KV push between two processes on one host, next to memcpy of the
same bytes and (when installed) Mooncake Transfer Engine over TCP, in one run.

Shapes:
- `request`: a real request's pages, 2K tokens of the default model (128 pages of 737,280 B,
  every layer's K and V for 16 tokens, 94 MB), as prefill pushes them into decode's pool;
- `64x1MiB`: 64 buffers of 1 MiB.

The push goes through the same sender and receiver the services use (`kvmesh.kvstore.transports`):
the receiver process registers its pool's pages (`expect`) and the sender process pushes its
own pages, which lie in a shared-memory pool as the runners' do, into them: the receiver pulls
them from that pool with one copy when it can map it, as here (`push_gbps`). The same pushes
from pages outside any shared pool go over UCX's data endpoint, as they do between hosts
(`ucx_gbps`). As prefill does, the sender connects to a receiver it has not seen while
the request computes (`connect_s`, off the push); `first_push_s` is then the first push to it
(its first use of the connection), and `push_gbps` the median over `--rounds` later pushes. memcpy copies the same
buffers in one process (numpy `copyto`, page by page). Mooncake Transfer Engine
(`mooncake-transfer-engine-non-cuda`, an optional benchmark extra) writes the same buffers
from one process's registered memory into the other's over its TCP transport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

REQUEST_PAGES, REQUEST_PAGE_NBYTES = 128, 737_280  # 2K tokens of SmolLM2-135M: 30 layers x K,V x 16 x 3 x 64 x fp32
SHAPES = {"request": (REQUEST_PAGES, REQUEST_PAGE_NBYTES), "64x1MiB": (64, 1 << 20)}


@dataclass
class ShapeResult:
    shape: str
    nbytes: int
    push_gbps: float
    ucx_gbps: float
    memcpy_gbps: float
    mooncake_gbps: float | None
    first_push_s: float
    connect_s: float


def _pages(num: int, nbytes: int, fill: int, shared: bool = False, device: str = "cpu") -> list:
    """`num` page views of one pool (as the KV cache is one tensor), each `nbytes` bytes; in
    shared memory (as the runners allocate their pools) when `shared`; on a GPU (uint8 device
    tensors, which UCX reads through `__cuda_array_interface__`) when `device` is one."""
    if device != "cpu":
        import torch

        gpu_pool = torch.full((num * nbytes,), fill, dtype=torch.uint8, device=device)
        return [gpu_pool[i * nbytes : (i + 1) * nbytes] for i in range(num)]
    if shared:
        from kvmesh.kvstore.shared_memory import SharedRegion

        pool = SharedRegion(num * nbytes).array
        pool[:] = fill
    else:
        pool = np.full(num * nbytes, fill, dtype=np.uint8)
    return [pool[i * nbytes : (i + 1) * nbytes] for i in range(num)]


def _receiver(conn, transport: str, device: str = "cpu") -> None:
    """Decode's side: register a fresh pool's pages (on `device`) for each push the sender announces."""
    from kvmesh.kvstore.transports import create_receiver

    async def main() -> None:
        rx = create_receiver(transport, "127.0.0.1", 0)
        await rx.start()
        conn.send(rx.address)
        pools = {name: _pages(n, size, 0, device=device) for name, (n, size) in SHAPES.items()}
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg is None:
                break
            tid, shape = msg
            landed = rx.expect(tid, pools[shape])
            conn.send("ready")
            await landed
            conn.send(all(int(p[0]) == tid % 251 and int(p[-1]) == tid % 251 for p in pools[shape]))
        await rx.close()

    asyncio.run(main())


def _memcpy_gbps(src: list[np.ndarray], rounds: int) -> float:
    dst = [np.empty_like(p) for p in src]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for d, s in zip(dst, src):
            np.copyto(d, s)
        times.append(time.perf_counter() - start)
    return sum(p.nbytes for p in src) / statistics.median(times) / 1e9


def _push_figures(
    transport: str, shape: str, rounds: int, shared: bool, device: str = "cpu"
) -> tuple[float, float, float]:
    """(connect seconds, first push seconds, median GB/s of the later pushes) of `shape`, from
    this process to a receiver in a new process; the source pages in a shared pool or not, both
    ends' pages on `device` (a GPU: the push moves device memory to device memory)."""
    from kvmesh.kvstore.transports import create_sender

    n, size = SHAPES[shape]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, transport, device), daemon=True)
    proc.start()
    times: list[float] = []
    connect: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        address = await loop.run_in_executor(None, parent.recv)
        sender = create_sender(transport)
        try:
            start = time.perf_counter()
            await sender.connect(address)
            connect.append(time.perf_counter() - start)
            pools = [_pages(n, size, 0, shared, device) for _ in range(2)]  # reused, as a KV pool is
            for tid in range(1, rounds + 2):
                src = pools[tid % 2]
                for page in src:
                    page[:] = tid % 251
                parent.send((tid, shape))
                assert await loop.run_in_executor(None, parent.recv) == "ready"
                start = time.perf_counter()
                await sender.push(address, tid, src)
                times.append(time.perf_counter() - start)
                assert await loop.run_in_executor(None, parent.recv), f"push {tid}: bytes differ on landing"
        finally:
            parent.send(None)
            await sender.close()

    asyncio.run(main())
    proc.join(timeout=30)
    first = times.pop(0)
    return connect[0], first, n * size / statistics.median(times) / 1e9


def _mooncake_gbps(rounds: int) -> dict[str, float] | None:
    """shape -> median GB/s of Mooncake TE's TCP transport between two processes; None when
    `mooncake.engine` is not importable."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return None
    from kvmesh.bench.mooncake import run as run_mooncake

    return run_mooncake(SHAPES, rounds)


def run(args: argparse.Namespace) -> int:
    pushes = {shape: _push_figures(args.transport, shape, args.rounds, shared=True) for shape in SHAPES}
    over_ucx = {shape: _push_figures(args.transport, shape, args.rounds, shared=False)[2] for shape in SHAPES}
    mooncake = _mooncake_gbps(args.rounds)
    results = []
    for shape, (n, size) in SHAPES.items():
        connect_s, first, gbps = pushes[shape]
        results.append(
            ShapeResult(
                shape=shape,
                nbytes=n * size,
                push_gbps=round(gbps, 3),
                ucx_gbps=round(over_ucx[shape], 3),
                memcpy_gbps=round(_memcpy_gbps(_pages(n, size, 1), args.rounds), 3),
                mooncake_gbps=None if mooncake is None else round(mooncake[shape], 3),
                first_push_s=round(first, 4),
                connect_s=round(connect_s, 4),
            )
        )
    if args.json:
        print(json.dumps({"transport": args.transport, "rounds": args.rounds, "shapes": [asdict(r) for r in results]}))
        return 0
    print(f"KV push between two processes on this host ({args.transport}), median of {args.rounds} pushes")
    print(
        f"{'shape':10} {'MB':>8} {'push GB/s':>10} {'memcpy GB/s':>12} {'push/memcpy':>12} "
        f"{'Mooncake GB/s':>14} {'push/Mooncake':>14} {'UCX data path GB/s':>19}"
    )
    for r in results:
        moon = "-" if r.mooncake_gbps is None else f"{r.mooncake_gbps:.2f}"
        vs_moon = "-" if r.mooncake_gbps is None else f"{r.push_gbps / r.mooncake_gbps:.2f}x"
        print(
            f"{r.shape:10} {r.nbytes / 1e6:8.1f} {r.push_gbps:10.2f} {r.memcpy_gbps:12.2f} "
            f"{r.push_gbps / r.memcpy_gbps:12.2f} {moon:>14} {vs_moon:>14} {r.ucx_gbps:19.2f}"
        )
    firsts = ", ".join(f"{r.shape} {r.first_push_s * 1000:.1f} ms" for r in results)
    connects = ", ".join(f"{r.connect_s * 1000:.1f} ms" for r in results)
    print(f"first push to a new receiver, connected ahead: {firsts} (connecting took {connects})")
    if mooncake is None:
        print("Mooncake TE not installed (pip install mooncake-transfer-engine-non-cuda; needs Debian's libibverbs1)")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=10, help="timed pushes per shape; the median counts (default 10)")
    parser.add_argument("--transport", default="ucx", help="KV transport (default ucx)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
