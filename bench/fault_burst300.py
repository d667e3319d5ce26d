"""Run from the repo root: .venv/bin/python -m kvmesh.bench.fault_burst300

Issue 10 case 7 as measured: 300 concurrent streams (max_tokens 32) against 2 decodes of 64 slots."""

import asyncio
import sys
import time
from collections import Counter

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
import grpc

from kvmesh.client import GatewayClient, make_request
from tests.integration.meshutil import running_mesh

with running_mesh(1, 2) as mesh:

    async def run():
        async with GatewayClient(mesh.gateway_address) as c:

            async def one(k):
                t = time.monotonic()
                try:
                    out = await c.complete(
                        make_request(f"Write one sentence about the number {k}.", chat=True, max_tokens=32),
                        timeout_s=600,
                    )
                    return "OK", time.monotonic() - t, out.final.admission_s
                except grpc.aio.AioRpcError as e:
                    return e.code().name, time.monotonic() - t, 0.0

            t0 = time.monotonic()
            res = await asyncio.gather(*(one(k) for k in range(300)))
            return res, time.monotonic() - t0

    res, wall = asyncio.run(run())
    print("statuses", Counter(r[0] for r in res), f"wall {wall:.1f} s")
    adm = sorted(r[2] for r in res)
    print(
        f"admission wait s: p50 {adm[150]:.2f} p90 {adm[270]:.2f} max {adm[-1]:.2f}; queued {sum(a > 0 for a in adm)}"
    )
