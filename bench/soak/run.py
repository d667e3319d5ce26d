"""`kvmesh soak --duration SECONDS --seed N --json PATH [--plot PATH]`: the mesh on hosts
(bench/soak/mesh.py), a quiet reference run of every checked request, then the seeded workload
and fault schedule together for --duration seconds, then the drain: the mesh healed, every page
back. Prints the verdict (bench/soak/report.py) and exits 1 when anything was hung, wrong,
crashed or leaked. Bounded: the run stops by itself (every request within its deadline + 10 s,
every start within mesh.START_BOUND_S, the drain within DRAIN_BOUND_S).

Needs root (network namespaces; bench/hosts.py says what else).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from kvmesh.bench.hosts import Cluster, unavailable
from kvmesh.bench.soak import report
from kvmesh.bench.soak.clients import Clients
from kvmesh.bench.soak.faults import FaultSchedule
from kvmesh.bench.soak.mesh import API_KEYS, GATEWAYS, HOSTS, INSTANCES, PREFILLS, SoakMesh
from kvmesh.bench.soak.send import drive, reference_answers
from kvmesh.bench.soak.workload import outcome_json

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a soak early (Ctrl-C, a CI job's timeout, a closed terminal): the run is cancelled and
its mesh closed (every service, namespace and link gone), never left running."""

DRAIN_BOUND_S = 180.0
"""After the run: how long the mesh may take to serve again everywhere and free every page."""
SAMPLE_EVERY_S = 2.0


async def _watch(mesh: SoakMesh, samples: list[dict], stop: asyncio.Event) -> None:
    """Every SAMPLE_EVERY_S: pages and RSS, and a crashed service started again."""
    restarts: set[asyncio.Task] = set()
    while not stop.is_set():
        for name in mesh.check_crashes():
            task = asyncio.ensure_future(mesh.restart(name))
            restarts.add(task)
            task.add_done_callback(restarts.discard)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed start shows in the drain
        samples.append(await mesh.sample())
        await asyncio.sleep(SAMPLE_EVERY_S)
    if restarts:
        await asyncio.wait(restarts, timeout=DRAIN_BOUND_S)


async def _drain(mesh: SoakMesh) -> tuple[dict[str, int], list[str]]:
    """Wait (DRAIN_BOUND_S) until every service serves and every pool is back to its cached-only
    count; (pages still held per instance, -1 for one that does not answer; integrity errors)."""
    with contextlib.suppress(TimeoutError):  # one that does not serve by then shows as -1 below
        await mesh.wait_serving(HOSTS, DRAIN_BOUND_S)
    deadline = time.monotonic() + DRAIN_BOUND_S
    while True:
        stats = dict(zip(INSTANCES, await asyncio.gather(*(mesh.stats(n, 5.0) for n in INSTANCES)), strict=True))
        held = {}
        for name, s in stats.items():
            if s is None:
                held[name] = -1  # did not answer: counted as a leak, shown as -1
            elif name in PREFILLS:
                held[name] = s.num_referenced_pages + s.num_active_requests
            else:
                held[name] = s.num_pages - s.num_free_pages + s.num_active_requests
        if not any(held.values()) or time.monotonic() > deadline:
            integrity = [f"{n}: {s.integrity_error}" for n, s in stats.items() if s is not None and s.integrity_error]
            return held, integrity
        await asyncio.sleep(0.5)


async def soak(
    duration_s: float,
    seed: int,
    concurrency: int,
    gap_s: tuple[float, float],
    kinds: list[str] | None,
    workdir: Path,
    plot_path: str | None,
) -> dict:
    """One soak run; its verdict (report.summarize)."""
    from kvmesh.warm import warm

    warm()  # the default model converted and its kernels compiled before seven services start
    cluster = Cluster(HOSTS)
    cluster.start()
    mesh = SoakMesh(cluster, workdir)
    try:
        await mesh.start_all()
        http = [mesh.http[g] for g in GATEWAYS]
        async with Clients(http, [mesh.address[g] for g in GATEWAYS], list(API_KEYS)) as clients:
            reference = await reference_answers(clients, mesh.now)
            shift = time.monotonic() - mesh.t0
            mesh.t0, start = time.monotonic(), 0.0  # times from here on: seconds into the soak
            for lives in mesh.starts.values():
                lives[:] = [t - shift for t in lives]
            until = start + duration_s
            samples: list[dict] = []
            stop = asyncio.Event()
            watcher = asyncio.ensure_future(_watch(mesh, samples, stop))
            schedule = FaultSchedule(mesh, random.Random(seed), gap_s, until - 5.0, kinds)
            faults_task = asyncio.ensure_future(schedule.run())
            outcomes = await drive(clients, reference, seed, concurrency, until, mesh.now, len(GATEWAYS), len(API_KEYS))
            await asyncio.wait_for(faults_task, DRAIN_BOUND_S)
            leaked, integrity = await _drain(mesh)
            stop.set()
            await watcher
        slopes = report.rss_slopes(samples, dict(mesh.starts), start, mesh.now())
        verdict = report.summarize(
            outcomes,
            schedule.done,
            mesh.crashes,
            leaked,
            integrity,
            slopes,
            mesh.read_logs(),
            mesh.now() - start,
            seed,
        )
        verdict["reference_requests"] = len(reference)
        if plot_path:
            report.plot(plot_path, outcomes, samples, schedule.done)
        with open(workdir / "outcomes.jsonl", "w") as f:
            for o in outcomes:
                f.write(json.dumps(outcome_json(o)) + "\n")
        return verdict
    finally:
        mesh.close()


def bad(verdict: dict) -> list[str]:
    """What makes a run fail: hung, wrong, crashed, leaked pages, integrity errors."""
    out = [f"{k}: {verdict[k]}" for k in ("hung", "wrong", "crashed") if verdict[k]]
    if any(verdict["leaked_pages"].values()):
        out.append(f"leaked pages: {verdict['leaked_pages']}")
    if verdict["integrity_errors"]:
        out.append(f"integrity errors: {verdict['integrity_errors']}")
    return out


class Interrupted(Exception):
    """A soak stopped by one of STOP_SIGNALS (`signum`) before it ended; its mesh was closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; the mesh was closed")
        self.signum = signum


async def until_signal(run: Awaitable[T]) -> T:
    """Await `run` (a soak) in this task; one of STOP_SIGNALS cancels it, so its `finally` closes
    the mesh, and raises Interrupted. The handlers are set even where the signal was ignored (a
    job started in the background of a script ignores SIGINT) and removed after."""
    loop, task, got = asyncio.get_running_loop(), asyncio.current_task(), []

    def stop(signum: int) -> None:
        got.append(signum)
        task.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await run
    except asyncio.CancelledError:
        if got:
            raise Interrupted(got[0]) from None
        raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


def run(args: argparse.Namespace) -> int:
    if args.table:
        print(report.markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    why = unavailable()
    if why:
        print(f"kvmesh soak cannot run here: {why}", file=sys.stderr)
        return 1
    try:
        lo, hi = (float(x) for x in args.fault_gap.split(":"))
        if not 0 < lo <= hi or not 0 < args.duration <= 7 * 24 * 3600 or not 1 <= args.concurrency <= 64:
            raise ValueError
    except ValueError:
        print(
            "kvmesh soak: --fault-gap must be LO:HI with 0 < LO <= HI, --duration in (0, 1 week], --concurrency in [1, 64]"
        )
        return 1
    kinds = [k for k in args.faults.split(",") if k] or None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvmesh-soak-"))
    try:
        verdict = asyncio.run(
            until_signal(soak(args.duration, args.seed, args.concurrency, (lo, hi), kinds, workdir, args.plot or None))
        )
    except Interrupted as exc:
        print(f"kvmesh soak: {exc} (logs in {workdir / 'logs'})", file=sys.stderr)
        return 128 + exc.signum
    except (RuntimeError, ValueError, TimeoutError) as exc:
        print(f"kvmesh soak: {exc} (logs in {workdir / 'logs'})", file=sys.stderr)
        return 1
    text = json.dumps(verdict, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    problems = bad(verdict)
    print(f"logs and outcomes in {workdir}", file=sys.stderr)
    if problems:
        print("kvmesh soak: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0
