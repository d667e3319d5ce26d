"""Run from the repo root: .venv/bin/python -m kvmesh.bench.fault_freeze

Seconds from SIGSTOP of a decode (6 streams running over 2 decodes) to each stream's end."""

import asyncio
import signal
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from tests.conftest import instance_stats
from tests.integration.meshutil import running_mesh, wait_idle
from tests.integration.test_faults import _streams_under_fault, proc_of

with running_mesh(1, 2) as mesh:
    stopped = []

    async def freeze():
        active = [
            (await asyncio.to_thread(instance_stats, a, "decode")).num_active_requests for a in mesh.decode_addresses
        ]
        frozen = mesh.decode_addresses[active.index(max(active))]
        p = proc_of(mesh, frozen)
        p.send_signal(signal.SIGSTOP)
        stopped.append(p)
        return frozen

    async def main():
        try:
            return await _streams_under_fault(mesh, 6, 500, freeze)
        finally:
            for p in stopped:
                p.send_signal(signal.SIGCONT)

    frozen, results = asyncio.run(main())
    for r, s in results:
        print(r[0], (r[1][:80] if isinstance(r[1], str) else r[1].decode_instance), f"{s:.2f} s after the freeze")
    t = time.monotonic()
    wait_idle(mesh, 60)
    print("idle after SIGCONT in %.1f s" % (time.monotonic() - t))
